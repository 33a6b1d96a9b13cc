"""Whether a survivor's live state may be kept for the restart after a peer's loss (docs/design.md, "Replicas").

When a peer dies, the survivors' collective fails and they exit so that torchrun re-forms the
group. Under DDP their model and optimizer are the whole job's, at the last step every rank
finished, so keeping them in node memory (:meth:`elastic_ddp.checkpoint.replica.Replicas.rescue`)
makes the restart redo at most the interrupted step. That holds only when the live state *is* a
complete state of one step; :func:`why_not_kept` says when it is not, and :func:`ruled_out` what
makes that so at every step (the runtime says it at the run's first step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class StepPhase(enum.Enum):
    """Where the training thread is in its step when a collective fails."""

    BETWEEN = "between"
    """At a step boundary: the state is the step's, whole."""
    FORWARD = "forward"
    """Forward and backward of the next step: parameters and optimizer state are untouched until its optimizer
    step, but a forward may change buffers (batch-norm statistics) and a loss the script's own objects."""
    UPDATE = "update"
    """From the optimizer step until the step is recorded: part of the state is the next step's."""


@dataclass(frozen=True)
class LiveState:
    """What decides whether a survivor's state can be kept (the runtime fills it in)."""

    phase: StepPhase
    forward_changes_state: bool
    """The model has persistent buffers, or the script hands over objects of its own (either may change in a
    forward or a loss)."""
    sharded_optimizer: bool
    """Each rank holds only its shard of the optimizer state: the lost ranks' shards are gone."""
    rank_objects: bool
    """The script's per-rank objects: the lost ranks' are gone, and a resume re-derives rather than reloads them."""
    device_busy: bool = False
    """The accelerator still has queued work: a collective there may be waiting for the lost peer, and copying
    the state off the device would wait behind it."""


def has_persistent_buffers(model: torch.nn.Module) -> bool:
    """Whether ``model``'s state dict holds anything but parameters (a tied parameter saved under two names
    is still a parameter)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return any(name not in parameters for name in model.state_dict())


def why_not_kept(live: LiveState) -> str | None:
    """Why the live state is not a complete state of one step that every rank can resume from; None: it is."""
    if live.phase is StepPhase.UPDATE:
        return "a peer was lost during the optimizer step"
    if live.phase is StepPhase.FORWARD and live.forward_changes_state:
        return "a peer was lost in a forward pass, which may have changed buffers or the script's objects"
    never = ruled_out(sharded_optimizer=live.sharded_optimizer, rank_objects=live.rank_objects)
    if never is not None:
        return never.reason
    if live.device_busy:
        return "the device still has work queued, which may wait for the lost peer"
    return None


@dataclass(frozen=True)
class RuledOut:
    """Why no state of a run can ever be kept, and what the script can change (known at its first step)."""

    reason: str
    fix: str


def ruled_out(*, sharded_optimizer: bool, rank_objects: bool) -> RuledOut | None:
    """What rules out every rescue of a run, whatever step a peer is lost at; None: nothing does. The RNG
    streams do not: they are keyed by step (:func:`elastic_ddp.state.key_rng_streams`), so a resume that
    re-derives them draws what the run drew."""
    if sharded_optimizer:
        return RuledOut("the optimizer state is sharded over the ranks, and a lost rank's shard is gone",
                        "a restart resumes from the newest replica (every rank's shard): keep "
                        "--checkpoint-replica-every small, or use an unsharded optimizer")
    if rank_objects:
        return RuledOut("the script keeps per-rank state (Built.rank_state), and a lost rank's is gone",
                        "hand replicated objects as Built.state, or derive the per-rank ones from the rank and step")
    return None
