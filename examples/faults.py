"""Faults a test or the chaos harness can inject into the example job from the outside.

Set ``ELASTIC_DDP_FAULT`` to ``KIND:RANK:STEP`` (comma-separated for several):

  crash:1:30     rank 1 raises an exception in the 30th step of this launch
  corrupt:1:30   rank 1 silently changes one of its parameters in the 30th step (divergence)

A fault fires only in the first attempt of a launch (TORCHELASTIC_RESTART_COUNT 0), so the
restarted job can recover. Steps count from the start of the launch, not of the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from elastic_ddp.build import LossFn, WeightedLoss, per_sample_cross_entropy


class InjectedCrash(RuntimeError):
    """The exception a ``crash`` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, rank, step = item.split(":")
        if kind not in ("crash", "corrupt"):
            raise ValueError(f"ELASTIC_DDP_FAULT: unknown fault kind {kind!r} in {item!r}")
        faults.append(Fault(kind, int(rank), int(step)))
    return faults


def faulty_loss(model: torch.nn.Module, base: LossFn = per_sample_cross_entropy) -> LossFn:
    """``base``, wrapped so that the faults named in ELASTIC_DDP_FAULT fire on this rank."""
    rank = int(os.environ.get("RANK", "0"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mine = [f for f in parse_faults(os.environ.get("ELASTIC_DDP_FAULT", "")) if f.rank == rank] if first_attempt else []
    if not mine:
        return base
    calls = 0

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | WeightedLoss:
        nonlocal calls
        calls += 1
        for fault in mine:
            if fault.step == calls and fault.kind == "crash":
                raise InjectedCrash(f"injected crash on rank {rank} in step {calls} of this launch")
            if fault.step == calls and fault.kind == "corrupt":
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3
        return base(outputs, targets)

    return loss
