"""Whether a survivor's live state is a complete state of one step (the rescue decision, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic_ddp.resilience.rescue import LiveState, StepPhase, has_persistent_buffers, why_not_kept

PLAIN = LiveState(phase=StepPhase.FORWARD, forward_changes_state=False, sharded_optimizer=False, rank_objects=False)


def test_a_plain_ddp_state_is_kept_at_a_step_boundary_and_before_the_optimizer_step() -> None:
    assert why_not_kept(PLAIN) is None
    assert why_not_kept(dataclasses.replace(PLAIN, phase=StepPhase.BETWEEN)) is None


def test_a_state_caught_in_its_optimizer_step_is_not_kept() -> None:
    assert why_not_kept(dataclasses.replace(PLAIN, phase=StepPhase.UPDATE)) == "a peer was lost during the optimizer step"


def test_buffers_or_script_objects_keep_a_state_only_at_a_step_boundary() -> None:
    changes = dataclasses.replace(PLAIN, forward_changes_state=True)
    assert "forward pass" in (why_not_kept(changes) or "")
    assert why_not_kept(dataclasses.replace(changes, phase=StepPhase.BETWEEN)) is None


@pytest.mark.parametrize(("field", "reason"), [
    ("sharded_optimizer", "the optimizer state is sharded over the ranks, and a lost rank's shard is gone"),
    ("rank_objects", "the script keeps per-rank state (Built.rank_state), and a lost rank's is gone"),
    ("device_busy", "the device still has work queued, which may wait for the lost peer"),
])
def test_state_that_cannot_be_kept_whole_is_never_kept(field: str, reason: str) -> None:
    for phase in StepPhase:
        if phase is not StepPhase.UPDATE:
            assert why_not_kept(dataclasses.replace(PLAIN, phase=phase, **{field: True})) == reason


def test_batch_norm_statistics_are_buffers_and_a_tied_weight_is_not() -> None:
    tied = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    assert set(tied.state_dict()) == {"0.weight", "1.weight"}
    assert not has_persistent_buffers(tied)
    assert has_persistent_buffers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))

    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.register_buffer("mask", torch.ones(4), persistent=False)

    assert not has_persistent_buffers(Cached())
