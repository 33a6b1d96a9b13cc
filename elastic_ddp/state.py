"""TrainState: everything a resume needs, as one state dict (docs/design.md, "Resume").

The state has three parts, matching who writes them:

* ``replicated``: model, optimizer, LR scheduler, grad scaler and any extra ``Stateful``
  objects the script hands over. Identical on every rank under DDP, so rank 0 writes it once.
* ``rank_local``: this rank's RNG streams, sharded state — state whose content differs per
  rank, such as a ``ZeroRedundancyOptimizer``'s shard of the optimizer state — and the
  script's per-rank ``Stateful`` objects. Every rank writes its own.
* ``meta``: step, data position (epoch, cursor, samples seen, data digest), the config
  fingerprint and the LR schedule's horizon. Small, JSON, identical everywhere; it goes into
  the checkpoint's manifest.

RNG rule: a rank's RNG streams are keyed by step. When a step is planned (the committed
position's ``ElasticSampler.plan()``, where both doors start a step) the runtime sets them to
:func:`key_rng_streams` of ``(seed, step, rank)``, so what a step draws (dropout, random
augmentation in the training process) does not depend on how the run got there: a resume from
a checkpoint, a replica or a survivor's rescue, at any world size, draws what an uninterrupted
run of that world size drew. The saved streams are still restored at the same world size (a
script may draw before its first plan); per-rank ``Stateful`` objects start fresh on a
world-size change. The data order never depends on these streams (it is a function of
``(seed, epoch)``), so the data contract holds either way.
Sharded optimizer state is tied to its partition: it is restored per rank at the same world
size, and a resume onto another world size is refused with an error saying so.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from elastic_ddp.config import fingerprint_mismatches
from elastic_ddp.data import DataPosition, ElasticSampler
from elastic_ddp.errors import ConfigError, IncompatibleCheckpointError, ResumeRefusedError

_RNG_STEP_STRIDE = 10_007
_RNG_RANK_STRIDE = 1_000_003


def derive_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s RNG streams for the step after ``step`` (:func:`key_rng_streams`), in the
    range torch's generators take."""
    return ((seed * _RNG_RANK_STRIDE + step) * _RNG_STEP_STRIDE + rank) % (1 << 64)


def seed_rng_streams(seed: int) -> None:
    """Seed torch (CPU and CUDA, also a CUDA not yet initialised) and Python's ``random`` from one integer."""
    torch.manual_seed(seed)
    random.seed(seed)


def key_rng_streams(seed: int, step: int, rank: int) -> None:
    """Set this rank's RNG streams (torch's CPU and CUDA generators, Python's ``random``) to those of the step
    after ``step``: a function of (seed, step, rank) alone, so a resume at any step from any state draws what an
    uninterrupted run drew (docs/design.md, "Resume"). Cheap enough for every step: unlike ``torch.manual_seed``
    it queues no call for a CUDA that is not initialised (each such call keeps a stack trace)."""
    value = derive_rng_seed(seed, step, rank)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
    random.seed(value)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers, a script's own
    objects. Its state dict may hold tensors and plain containers of str, int, float, bool and None."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass
class Counters:
    """Progress of the run, counted over all its launches (the data position lives in the sampler)."""

    step: int = 0


_REPLICATED_NAMES = frozenset({"model", "optimizer", "optimizer_groups", "scheduler", "scaler"})
_RANK_NAMES = frozenset({"rng", "optimizer_shard"})


class TrainState:
    """Binds the live training objects so they can be saved and restored as one unit.

    It is what :class:`~elastic_ddp.checkpoint.CheckpointManager` saves: ``replicated_state_dict()``,
    ``rank_state_dict()``, ``meta()`` and ``load_state_dict()``.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        fingerprint: dict[str, Any],
        seed: int,
        scheduler: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extra: Mapping[str, Stateful] | None = None,
        rank_extra: Mapping[str, Stateful] | None = None,
    ) -> None:
        _check_parts(model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler, scaler=scaler)
        _check_json(fingerprint)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.fingerprint = fingerprint
        self.seed = seed
        self.extra = _named(extra, _REPLICATED_NAMES, "state")
        self.rank_extra = _named(rank_extra, _RANK_NAMES, "rank_state")
        self.counters = Counters()
        self.annotations: dict[str, Any] = {}
        """JSON values recorded in every checkpoint's meta beside the position (e.g. the LR horizon)."""
        self.restored_meta: dict[str, Any] = {}
        """The meta of the checkpoint this state was last restored from."""

    # -- saving ------------------------------------------------------------------

    @property
    def sharded_optimizer(self) -> bool:
        """True when each rank holds only its shard of the optimizer state."""
        return is_zero_optimizer(self.optimizer)

    def replicated_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.sharded_optimizer:
            # The shard's own param groups hold the hyperparameters of its last step; the scheduler has
            # moved the outer (replicated) groups on since, so those are what a resume must see.
            state["optimizer_groups"] = [_hyperparameters(group) for group in self.optimizer.param_groups]
        else:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        state.update((name, obj.state_dict()) for name, obj in self.extra.items())
        return state

    def rank_state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": rng_streams()}
        if self.sharded_optimizer:
            state["optimizer_shard"] = self.optimizer.optim.state_dict()  # type: ignore[attr-defined]
        state.update((name, obj.state_dict()) for name, obj in self.rank_extra.items())
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
        return {
            "step": self.counters.step,
            **self.sampler.state_dict(),
            "fingerprint": dict(self.fingerprint),
            **self.annotations,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"replicated": self.replicated_state_dict(), "rank_local": self.rank_state_dict(), "meta": self.meta()}

    # -- restoring ---------------------------------------------------------------

    def check_compatible(self, meta: dict[str, Any], replicated: dict[str, Any] | None = None) -> None:
        """Refuse a checkpoint whose fingerprint, parameter shapes or set of saved objects differ from this run's."""
        saved_fingerprint = meta.get("fingerprint", {})
        problems = fingerprint_mismatches(saved_fingerprint if isinstance(saved_fingerprint, dict) else {}, self.fingerprint)
        if replicated is not None:
            model = replicated.get("model")
            problems += _shape_mismatches(model if isinstance(model, dict) else {}, self.model.state_dict())
            wanted = [*self.extra] + (["scheduler"] if self.scheduler is not None else [])
            missing = [name for name in wanted if not isinstance(replicated.get(name), dict)]
            problems += [f"the checkpoint holds no state for {name!r}" for name in missing]
        if problems:
            raise ResumeRefusedError(
                f"checkpoint at step {meta.get('step')} cannot be resumed by this run:\n  " + "\n  ".join(problems)
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state; ``rank_local`` may be ``None`` (world size changed: RNG re-derived)."""
        meta, replicated, rank_local = state["meta"], state["replicated"], state.get("rank_local")
        self.check_compatible(meta, replicated)
        if self.sharded_optimizer and rank_local is None:
            raise ResumeRefusedError(
                f"checkpoint at step {meta.get('step')} holds optimizer state sharded over another world size; "
                "sharded (ZeroRedundancyOptimizer) state resumes only at the world size that saved it"
            )
        self.model.load_state_dict(replicated["model"])
        self._load_optimizer(replicated, rank_local)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(replicated["scheduler"])
        if self.scaler is not None and "scaler" in replicated:
            self.scaler.load_state_dict(replicated["scaler"])
        for name, obj in self.extra.items():
            obj.load_state_dict(replicated[name])
        self.sampler.load_state_dict(meta)
        self.counters.step = _step_of(meta)  # in place: a loop holding the counters reads the restored step
        self.restored_meta = dict(meta)
        if rank_local is not None:
            _set_rng(rank_local["rng"])
            for name, obj in self.rank_extra.items():
                if name in rank_local:
                    obj.load_state_dict(rank_local[name])
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


def _named(objects: Mapping[str, Stateful] | None, reserved: frozenset[str], what: str) -> dict[str, Stateful]:
    objects = dict(objects or {})
    for name, obj in objects.items():
        if name in reserved or not name.isidentifier():
            raise ConfigError(f"{what}: {name!r} is not a usable name (reserved: {', '.join(sorted(reserved))})")
        missing = [method for method in ("state_dict", "load_state_dict") if not callable(getattr(obj, method, None))]
        if missing:
            raise ConfigError(f"{what}[{name!r}] (a {type(obj).__name__}) has no {'/'.join(m + '()' for m in missing)}: "
                              "objects saved with the model need state_dict() and load_state_dict()")
    return objects


def _check_parts(**parts: Any) -> None:
    """The objects a state binds are of the kinds it saves (a factory that returned the wrong thing is named)."""
    kinds: dict[str, tuple[type, ...]] = {
        "model": (torch.nn.Module,), "optimizer": (torch.optim.Optimizer,), "sampler": (ElasticSampler,),
        "scaler": (torch.amp.GradScaler, type(None)),
    }
    for name, kind in kinds.items():
        if not isinstance(parts[name], kind):
            raise ConfigError(f"{name} is a {type(parts[name]).__name__}, not a {' or '.join(k.__name__ for k in kind)}")
    scheduler = parts["scheduler"]
    if scheduler is not None and not isinstance(scheduler, Stateful):
        raise ConfigError(f"scheduler is a {type(scheduler).__name__}, without state_dict()/load_state_dict()")


def _check_json(fingerprint: Mapping[str, Any]) -> None:
    """The fingerprint goes into every checkpoint's manifest: refuse at the start what could not be written there."""
    if not isinstance(fingerprint, Mapping):
        raise ConfigError(f"fingerprint is a {type(fingerprint).__name__}, not a mapping of names to JSON values")
    for name, value in fingerprint.items():
        try:
            json.dumps({str(name): value}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fingerprint[{name!r}] = {value!r} is not JSON ({exc}): use str, int, float, bool, "
                              "None, or lists and dicts of them") from None


def _step_of(meta: Mapping[str, Any]) -> int:
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise IncompatibleCheckpointError(f"checkpoint meta has no valid step ({step!r})")
    return step


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def is_zero_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ZeroRedundancyOptimizer, without importing torch.distributed.optim
    (a slow import): if its module was never imported, no such optimizer can exist."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def rng_streams() -> dict[str, Any]:
    """This process's RNG streams, as a rank file saves them: torch's CPU (and CUDA) generator, Python's ``random``."""
    rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    return rng


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
