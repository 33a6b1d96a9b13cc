"""The training parts a config and a script's :class:`~elastic_ddp.build.Built` make, each checked as it is made.

The optimizer (the script's factory, or AdamW from ``--optim-*``; sharded with ``--optim-zero``), the LR
schedule (the script's, or warmup then constant, cosine or linear decay), the grad scaler, the
global-cursor sampler, and the :class:`~elastic_ddp.state.TrainState` that binds them for checkpoints.
A factory that returns the wrong kind of object, training items without targets, or a loss that is not
one value per sample is refused here, in one line naming the fix (:class:`~elastic_ddp.errors.ConfigError`),
before the step that would train on it.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from elastic_ddp.batch import collate
from elastic_ddp.build import Built, WeightedLoss
from elastic_ddp.config import BUILD_PREFIX, LoaderConfig, OptimConfig, TrainConfig, fingerprint
from elastic_ddp.data import ElasticSampler
from elastic_ddp.errors import ConfigError
from elastic_ddp.events import Event, EventLog
from elastic_ddp.state import TrainState

logger = logging.getLogger(__name__)

LR_HORIZON_KEY = "lr_horizon"
"""Meta entry recording the step at which the runtime's LR decay reaches its floor."""


def lr_multiplier(step: int, *, warmup: int, decay_steps: int, schedule: str, min_ratio: float) -> float:
    """Learning-rate factor at ``step``: linear warmup, then constant, cosine or linear decay to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or decay_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (decay_steps - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - min_ratio) * progress


def shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, defaults, param groups) with its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # a slow import: only when asked for

    groups = [dict(group) for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold keys __init__ does not take
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


def make_optimizer(built: Built, model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    if built.optimizer is not None:
        optimizer = built.optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"Built.optimizer returned a {type(optimizer).__name__}, not a torch.optim.Optimizer: "
                              "the factory must return the optimizer it builds over the model's parameters")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                      weight_decay=optim.weight_decay)
    return shard_optimizer(optimizer) if optim.zero else optimizer


def _is_scheduler(candidate: Any) -> bool:
    return all(callable(getattr(candidate, name, None)) for name in ("step", "state_dict", "load_state_dict"))


def make_scheduler(built: Built, optimizer: torch.optim.Optimizer, config: TrainConfig) -> Any:
    """The script's schedule: ``optimizer -> LR scheduler``, ``optimizer -> (step -> multiplier)``, or a plain
    ``step -> multiplier``; the runtime's from ``--optim-*`` when there is none. Multipliers go into ``LambdaLR``."""
    if built.scheduler is None:
        optim = config.optim
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
            step, warmup=optim.warmup_steps, decay_steps=config.decay_steps, schedule=optim.schedule,
            min_ratio=optim.min_lr_ratio))
    try:
        made: Any = built.scheduler(optimizer)
    except TypeError:
        if _multiplier_at_step_0(built.scheduler):  # a plain step -> multiplier: arithmetic on the optimizer fails
            return torch.optim.lr_scheduler.LambdaLR(optimizer, built.scheduler)  # type: ignore[arg-type]
        raise
    if _is_scheduler(made):
        return made
    if callable(made):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, made)
    raise ConfigError(f"Built.scheduler returned a {type(made).__name__} when called with the optimizer: give an "
                      "optimizer -> LR scheduler factory, or a step -> multiplier function")


def _multiplier_at_step_0(candidate: Callable[..., Any]) -> bool:
    try:
        value = candidate(0)
    except Exception:  # noqa: BLE001 - not a multiplier, whatever it raised
        return False
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def check_items(data: Dataset) -> None:
    """Refuse training data whose items are not ``(inputs, targets)`` or ``(inputs, targets, sample_id)``."""
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise ConfigError(f"Built.train_data is a {type(data).__name__}: a map-style dataset (__len__ and "
                          "__getitem__) is needed for the global cursor")
    if len(data) == 0:
        return  # the sampler names an empty dataset
    item = data[0]
    if isinstance(item, Mapping):
        raise ConfigError(f"Built.train_data's items must be (inputs, targets) or (inputs, targets, sample_id); item 0 "
                          f"is a {type(item).__name__}: return the model's inputs and the targets apart, e.g. "
                          f"(features, labels, index), where each may itself be a dict of tensors")
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        kind = type(item).__name__ if not isinstance(item, (tuple, list)) else f"{type(item).__name__} of {len(item)}"
        raise ConfigError(f"Built.train_data's items must be (inputs, targets) or (inputs, targets, sample_id); "
                          f"item 0 is a {kind}")


def check_losses(losses: Any, samples: int) -> None:
    """Refuse a loss that is not one value per sample of the micro-batch (nor a :class:`WeightedLoss`)."""
    if isinstance(losses, WeightedLoss):
        return
    if not isinstance(losses, torch.Tensor):
        raise ConfigError(f"Built.loss_fn returned a {type(losses).__name__}: return per-sample losses "
                          '(reduction="none") or a WeightedLoss(mean, weight)')
    if losses.dim() == 0:
        raise ConfigError(f"Built.loss_fn returned a scalar for a micro-batch of {samples} samples: return per-sample "
                          'losses (reduction="none"), or a WeightedLoss(mean, weight) for a mean over units such as tokens')
    if list(losses.shape) != [samples]:
        raise ConfigError(f"Built.loss_fn returned shape {list(losses.shape)} for a micro-batch of {samples} samples; "
                          f'expected [{samples}]: one loss per sample (reduction="none"), or a WeightedLoss(mean, weight)')


def make_loader(data: Dataset, sampler: ElasticSampler, loader: LoaderConfig, device: torch.device, *,
                seed: int) -> Iterator[Any]:
    """The training batches: the sampler's micro-batches of ``data``. The workers' seeds come from ``seed``,
    not the global RNG, so building the loader leaves the model's RNG streams untouched (bitwise resume)."""
    return iter(DataLoader(
        data, batch_sampler=sampler, collate_fn=collate, num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None, pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),
    ))


def start_prefetch(data: Dataset, sampler: ElasticSampler) -> AbstractContextManager[Any]:
    """A shard dataset (:mod:`elastic_ddp.shards`) fetches ahead, in the background, what this rank's next steps
    read; any other dataset: nothing. Start it after the loader forked its workers (a fork copies no thread)."""
    from elastic_ddp.shards.dataset import ShardedDataset

    return data.prefetch(sampler) if isinstance(data, ShardedDataset) else nullcontext()


@dataclass
class Parts:
    """What the trainer steps: the model on its device, optimizer, schedule, scaler, sampler, and their state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    sampler: ElasticSampler
    state: TrainState


def check_model(model: Any) -> None:
    """Built.model must be the module itself: a module returned by ``torch.compile`` names its parameters
    ``_orig_mod.*``, so checkpoints would depend on whether the model was compiled; ``--compile`` compiles it
    for the run and keeps the module's own names."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"Built.model must be a torch.nn.Module; build returned a {type(model).__name__}")
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise ConfigError("Built.model is compiled (torch.compile): return the module itself and pass --compile "
                          "(and --compile-mode), so that checkpoints keep the module's parameter names")


def make_parts(config: TrainConfig, built: Built, device: torch.device, rank: int, world_size: int) -> Parts:
    check_model(built.model)
    check_items(built.train_data)
    model = built.model.to(device)
    optimizer = make_optimizer(built, model, config.optim)
    scheduler = make_scheduler(built, optimizer, config)
    scaler = torch.amp.GradScaler(device.type) if config.use_amp and config.amp_dtype == "float16" else None
    sampler = ElasticSampler(
        len(built.train_data),  # type: ignore[arg-type]
        global_batch_size=config.global_batch_size, seed=config.seed, rank=rank, world_size=world_size,
        grad_accum_steps=config.grad_accum_steps, shuffle=config.loader.shuffle, drop_last=config.loader.drop_last,
    )
    state = TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
        fingerprint={**fingerprint(config), **{BUILD_PREFIX + k: v for k, v in built.fingerprint.items()}},
        seed=config.seed, extra=built.state, rank_extra=built.rank_state,
    )
    if built.scheduler is None:  # the runtime's schedule: its horizon is recorded with each checkpoint
        state.annotations[LR_HORIZON_KEY] = config.decay_steps
    return Parts(model, optimizer, scheduler, scaler, sampler, state)


def check_lr_horizon(state: TrainState, config: TrainConfig, events: EventLog | None) -> None:
    """Warn when the runtime's LR schedule ends at another step than the one the checkpoint was trained with
    (``events``: where the ``lr_horizon_changed`` event goes, rank 0's; None: not written)."""
    saved = state.restored_meta.get(LR_HORIZON_KEY)
    now = state.annotations.get(LR_HORIZON_KEY)
    if saved is None or now is None or saved == now or events is None:
        return
    logger.warning(
        "the learning-rate schedule changes on this resume: its decay ended at step %s, now at step %s%s; "
        "pass --optim-decay-steps %s to keep the schedule the run started with",
        saved, now, "" if config.optim.decay_steps else " (--optim-decay-steps 0 follows --max-steps)", saved,
    )
    events.emit(Event.LR_HORIZON_CHANGED, step=state.counters.step, saved=saved, now=now)
