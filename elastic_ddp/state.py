"""TrainState: everything a resume needs, as one state dict (DESIGN.md, contract 2).

The state has three parts, matching who writes them:

* ``replicated``: model, optimizer, LR scheduler and grad scaler. Identical on every rank
  under DDP, so rank 0 writes it once.
* ``rank_local``: this rank's RNG streams, and sharded state — state whose content differs per
  rank, such as a ``ZeroRedundancyOptimizer``'s shard of the optimizer state. Every rank writes
  its own.
* ``meta``: step, data position, data digest and the config fingerprint. Small and
  identical everywhere; it goes into the checkpoint's manifest.

RNG rule on a world-size change: a rank's saved RNG streams belong to that rank of that
world size. When the world size differs on resume they are not reused; every rank derives
fresh streams from ``(seed, step, rank)``, so the run stays deterministic for the new
world size. The data order never depends on these streams (it is a function of
``(seed, epoch)``), so the data contract holds either way. Sharded optimizer state is tied to
its partition: it is restored per rank at the same world size, and a resume onto another world
size is refused with an error saying so.
"""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.config import fingerprint_mismatches
from elastic_ddp.data import EMPTY_DATA_DIGEST, DataPosition, ElasticSampler
from elastic_ddp.errors import IncompatibleCheckpointError

_RNG_STEP_STRIDE = 10_007
_RNG_RANK_STRIDE = 1_000_003


def derive_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank's RNG streams after a resume onto a different world size."""
    return (seed * _RNG_RANK_STRIDE + step) * _RNG_STEP_STRIDE + rank


def seed_rng_streams(seed: int) -> None:
    """Seed torch (CPU and CUDA) and Python's ``random`` from one integer."""
    torch.manual_seed(seed)
    random.seed(seed)


@dataclass
class Counters:
    """Progress of the run, counted over all its launches."""

    step: int = 0
    samples_seen: int = 0
    data_digest: str = EMPTY_DATA_DIGEST


class TrainState:
    """Binds the live training objects so they can be saved and restored as one unit."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        sampler: ElasticSampler,
        fingerprint: dict[str, Any],
        seed: int,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.fingerprint = fingerprint
        self.seed = seed
        self.counters = Counters()

    # -- saving ------------------------------------------------------------------

    @property
    def sharded_optimizer(self) -> bool:
        """True when each rank holds only its shard of the optimizer state."""
        return is_zero_optimizer(self.optimizer)

    def replicated_state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.sharded_optimizer:
            # The shard's own param groups hold the hyperparameters of its last step; the scheduler has
            # moved the outer (replicated) groups on since, so those are what a resume must see.
            state["optimizer_groups"] = [_hyperparameters(group) for group in self.optimizer.param_groups]
        else:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def rank_state_dict(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        state: dict[str, Any] = {"rng": rng}
        if self.sharded_optimizer:
            state["optimizer_shard"] = self.optimizer.optim.state_dict()  # type: ignore[attr-defined]
        return state

    def optimizer_owned(self) -> frozenset[int]:
        """Data pointers of the tensors that only the optimizer's ``step()`` changes: the parameters it
        updates and its per-parameter state (for a sharded optimizer, this rank's shard of it).

        An asynchronous save copies these while the next forward and backward run, and makes that
        ``step()`` wait for the copy (:class:`~elastic_ddp.checkpoint.async_save.AsyncCheckpointer`).
        Buffers, scaler and RNG state change elsewhere (a forward updates batch-norm statistics)
        and are copied before the save returns.
        """
        optimizer = self.optimizer.optim if self.sharded_optimizer else self.optimizer  # type: ignore[attr-defined]
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
        return frozenset(t.data_ptr() for t in tensors if t.numel())

    def meta(self) -> dict[str, Any]:
        position = self.sampler.position
        return {
            "step": self.counters.step,
            "epoch": position.epoch,
            "cursor": position.cursor,
            "samples_seen": self.counters.samples_seen,
            "data_digest": self.counters.data_digest,
            "fingerprint": dict(self.fingerprint),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"replicated": self.replicated_state_dict(), "rank_local": self.rank_state_dict(), "meta": self.meta()}

    # -- restoring ---------------------------------------------------------------

    def check_compatible(self, meta: dict[str, Any], replicated: dict[str, Any] | None = None) -> None:
        """Refuse a checkpoint whose fingerprint or parameter shapes differ from this run's."""
        problems = fingerprint_mismatches(meta.get("fingerprint", {}), self.fingerprint)
        if replicated is not None:
            problems += _shape_mismatches(replicated.get("model", {}), self.model.state_dict())
        if problems:
            raise IncompatibleCheckpointError(
                f"checkpoint at step {meta.get('step')} cannot be resumed by this run:\n  " + "\n  ".join(problems)
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state; ``rank_local`` may be ``None`` (world size changed: RNG re-derived)."""
        meta, replicated, rank_local = state["meta"], state["replicated"], state.get("rank_local")
        self.check_compatible(meta, replicated)
        if self.sharded_optimizer and rank_local is None:
            raise IncompatibleCheckpointError(
                f"checkpoint at step {meta.get('step')} holds optimizer state sharded over another world size; "
                "sharded (ZeroRedundancyOptimizer) state resumes only at the world size that saved it"
            )
        self.model.load_state_dict(replicated["model"])
        self._load_optimizer(replicated, rank_local)
        self.scheduler.load_state_dict(replicated["scheduler"])
        if self.scaler is not None and "scaler" in replicated:
            self.scaler.load_state_dict(replicated["scaler"])
        self.sampler.load_state_dict({"epoch": meta["epoch"], "cursor": meta["cursor"]})
        self.counters = Counters(
            step=int(meta["step"]), samples_seen=int(meta["samples_seen"]), data_digest=str(meta["data_digest"])
        )
        if rank_local is not None:
            _set_rng(rank_local["rng"])
        else:
            seed_rng_streams(derive_rng_seed(self.seed, self.counters.step, self.sampler.rank))

    def _load_optimizer(self, replicated: dict[str, Any], rank_local: dict[str, Any] | None) -> None:
        if not self.sharded_optimizer:
            self.optimizer.load_state_dict(replicated["optimizer"])
            return
        assert rank_local is not None
        local = self.optimizer.optim  # type: ignore[attr-defined]
        local.load_state_dict(rank_local["optimizer_shard"])
        for group, saved in zip(self.optimizer.param_groups, replicated["optimizer_groups"]):
            group.update(saved)

    @property
    def position(self) -> DataPosition:
        return self.sampler.position


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def is_zero_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ZeroRedundancyOptimizer, without importing torch.distributed.optim
    (a 2 s import): if its module was never imported, no such optimizer can exist."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    random.setstate(_as_tuple(rng["python"]))
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])


def _as_tuple(value: Any) -> Any:
    """random.setstate needs tuples; a round trip through storage may give lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _shape_mismatches(saved: dict[str, Any], current: dict[str, torch.Tensor]) -> list[str]:
    problems = [f"parameter {name!r} is missing from the checkpoint" for name in current if name not in saved]
    problems += [f"checkpoint has unexpected parameter {name!r}" for name in saved if name not in current]
    for name, tensor in current.items():
        other = saved.get(name)
        if isinstance(other, torch.Tensor) and other.shape != tensor.shape:
            problems.append(f"parameter {name!r} has shape {tuple(other.shape)} in the checkpoint, {tuple(tensor.shape)} now")
    return problems


def model_digest(model_state: dict[str, Any]) -> str:
    """SHA-256 over a model's tensors in sorted-name order: name, dtype, shape, then the raw bytes.

    Independent of the file format and of the order tensors were saved in, so two runs (or a run
    and a checkpoint) can be compared by this one string.
    """

    hasher = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
