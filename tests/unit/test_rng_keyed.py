"""RNG streams keyed by step: what a step draws depends on (seed, step, rank) alone, so a resume from any state
draws what the uninterrupted run drew, and a run whose own objects rule out every rescue is told so before its
first step (one process, no group)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_ddp.config import CheckpointConfig
from elastic_ddp.data import ElasticSampler
from elastic_ddp.events import EventLog, read_events
from elastic_ddp.resilience.rescue import ruled_out
from elastic_ddp.runtime import Runtime
from elastic_ddp.state import TrainState, key_rng_streams, model_digest

DATASET, BATCH, SEED = 64, 16, 3


def _draws() -> tuple[list[float], float]:
    return torch.rand(4).tolist(), random.random()


def test_the_streams_of_a_step_are_the_same_whatever_was_drawn_before_and_differ_by_step_and_rank() -> None:
    key_rng_streams(SEED, 5, 1)
    first = _draws()
    torch.rand(1000)
    random.random()
    key_rng_streams(SEED, 5, 1)
    assert _draws() == first
    key_rng_streams(SEED, 6, 1)
    assert _draws() != first
    key_rng_streams(SEED, 5, 0)
    assert _draws() != first


def test_only_planning_the_committed_position_marks_a_step_s_start() -> None:
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    calls: list[int] = []
    sampler.on_plan = lambda: calls.append(1)
    plan = sampler.plan()
    sampler.plan(plan.next_position)  # a prefetcher's look ahead
    batches = iter(sampler)
    next(batches), next(batches)  # the loader's iterator plans the steps it hands out
    assert len(calls) == 1


def _runtime(tmp_path: Path, *, rank_state: bool = False, replicas: bool = False) -> Runtime:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler,
                       fingerprint={}, seed=SEED, rank_extra={"counter": _Counter()} if rank_state else None)
    return Runtime(state, checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2, replica_every=int(replicas),
                                                      replica_dir=str(tmp_path / "replicas")),
                   events=EventLog(str(tmp_path / "logs"), run_id="t", rank=0))


class _Counter:
    def state_dict(self) -> dict[str, int]:
        return {"n": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def _train(runtime: Runtime, until: int) -> None:
    state = runtime.state
    while state.counters.step < until:
        plan = state.sampler.plan()
        state.model(torch.ones(plan.size, 8)).sum().backward()  # the dropout draws
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.sampler.commit(plan)
        runtime.after_step(state.counters.step + 1)


def test_a_run_with_dropout_resumed_from_streams_it_did_not_save_ends_with_the_uninterrupted_run_s_weights(
    tmp_path: Path,
) -> None:
    with _runtime(tmp_path / "whole") as whole:
        whole.restore()
        _train(whole, 6)
    with _runtime(tmp_path / "cut") as first:
        first.restore()
        _train(first, 3)
    with _runtime(tmp_path / "cut") as resumed:
        assert resumed.restore() == 3
        # what a rescue's restart does (the lost ranks' streams are gone), and what a script may draw between the
        # resume and its first step (a DataLoader without a generator of its own draws at its iterator's start)
        torch.manual_seed(999)
        random.seed(999)
        iter(DataLoader(TensorDataset(torch.zeros(4)), batch_size=2, shuffle=True))
        _train(resumed, 6)
        assert model_digest(resumed.state.model.state_dict()) == model_digest(whole.state.model.state_dict())


def test_keying_stops_with_the_membership_that_started_it(tmp_path: Path) -> None:
    with _runtime(tmp_path) as runtime:
        runtime.restore()
        assert runtime.state.sampler.on_plan is not None
    assert runtime.state.sampler.on_plan is None


def test_a_run_whose_per_rank_state_rules_out_every_rescue_is_told_before_its_first_step(tmp_path: Path) -> None:
    with _runtime(tmp_path, rank_state=True, replicas=True) as runtime:
        runtime.restore()
        (event,) = _events(tmp_path / "logs", "rescue_ruled_out")
        never = ruled_out(sharded_optimizer=False, rank_objects=True)
        assert never is not None and (event["reason"], event["fix"]) == (never.reason, never.fix)
    with _runtime(tmp_path / "plain", replicas=True) as plain:
        plain.restore()
        assert not _events(tmp_path / "plain" / "logs", "rescue_ruled_out")


def _events(log_dir: Path, kind: str) -> list[dict]:
    records, problems = read_events(log_dir)
    assert not problems
    return [record for record in records if record["event"] == kind]
