"""The elastic step loop: global-cursor data, gradient accumulation, AMP, clipping, checkpoints.

One step, on every rank::

    plan = sampler.plan()                     # which samples form this step (world-size independent)
    for each of this rank's micro-batches:    # no_sync on all but the last
        loss = loss_fn(model(inputs), targets).sum() * world_size / step_size
        backward
    clip, optimizer.step, scheduler.step      # DDP averaged => the mean over the global batch
    sampler.commit(plan)                      # the position and data digest a checkpoint records
    agreement.after_step(...)                 # stop requests, time-based saves: all ranks alike

Weighting each rank's summed loss by ``world_size / step_size`` makes DDP's averaged gradient
equal to the mean over the whole global batch even when ranks hold unequal shares; a loss that
returns a weighted mean is handled as :mod:`elastic_ddp.build` describes. The model, data,
optimizer, schedule, loss, evaluation and extra state are the script's (:class:`~elastic_ddp.build.Built`).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, default_collate

from elastic_ddp._torch_compat import foreach_div_
from elastic_ddp.build import Built, EvalFn, WeightedLoss, accuracy_on
from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.checkpoint.replica import Replicas, default_root
from elastic_ddp.collection import StepCollection
from elastic_ddp.config import BUILD_PREFIX, TrainConfig, fingerprint, storage_options
from elastic_ddp.data import ElasticSampler, StepPlan
from elastic_ddp.distributed import DistContext, cpu_group
from elastic_ddp.errors import CheckpointError, DataError
from elastic_ddp.events import Event, EventLog
from elastic_ddp.logs import LogContext, main_only
from elastic_ddp.metrics import MetricsWriter, Progress, StepTimer
from elastic_ddp.resilience.agreement import StopAgreement
from elastic_ddp.resilience.consistency import check_consistency
from elastic_ddp.resilience.exits import peer_loss
from elastic_ddp.resilience.rescue import LiveState, StepPhase, has_persistent_buffers, why_not_kept
from elastic_ddp.resilience.stop import SpotNoticePoller, StopRequests
from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog
from elastic_ddp.state import TrainState, derive_rng_seed, model_digest, rng_digest, seed_rng_streams

logger = logging.getLogger(__name__)

LR_HORIZON_KEY = "lr_horizon"
"""Meta entry recording the step at which the runtime's LR decay reaches its floor."""


@dataclass(frozen=True)
class TrainResult:
    step: int
    epoch: int
    loss: float | None
    accuracy: float | None
    model_digest: str
    data_digest: str
    reason: str = "done"
    """Why the run returned: done, preempted (this rank was asked to stop) or peer-lost (another was)."""
    stop_source: str | None = None
    """What asked this rank to stop (signal:SIGTERM, spot-notice), when it was asked."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The final evaluation's metrics (rank 0)."""


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
    from torch.distributed.optim import ZeroRedundancyOptimizer  # a 2 s import: only when asked for

    groups = [dict(group) for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold keys __init__ does not take
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


class Trainer:
    """Runs one launch of a training run; resumes from the newest valid checkpoint if there is one."""

    def __init__(
        self,
        config: TrainConfig,
        context: DistContext,
        built: Built,
        *,
        log_context: LogContext | None = None,
        events: EventLog | None = None,
    ) -> None:
        """``events``: the run's event stream (resumed, committed, stop agreed, done, ...); none: not written."""
        self.config = config
        self.context = context
        self.device = context.device
        self.loss_fn = built.loss_fn
        self.train_data = built.train_data
        self.evaluate_fn: EvalFn | None = built.evaluate or (
            accuracy_on(built.eval_data) if built.eval_data is not None and len(built.eval_data) else None  # type: ignore[arg-type]
        )
        self.tokens_per_sample = built.tokens_per_sample
        self.log_context = log_context
        self.events = events or EventLog.off()
        self.log0 = main_only(logger, context.rank)
        self.model = built.model.to(self.device)
        self.optimizer = self._make_optimizer(built)
        self.scheduler = self._make_scheduler(built)
        use_scaler = config.use_amp and config.amp_dtype == "float16"
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None
        self.sampler = ElasticSampler(
            len(self.train_data),  # type: ignore[arg-type]
            global_batch_size=config.global_batch_size,
            seed=config.seed,
            rank=context.rank,
            world_size=context.world_size,
            grad_accum_steps=config.grad_accum_steps,
            shuffle=config.loader.shuffle,
            drop_last=config.loader.drop_last,
        )
        self.state = TrainState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            sampler=self.sampler,
            fingerprint={**fingerprint(config), **{BUILD_PREFIX + k: v for k, v in built.fingerprint.items()}},
            seed=config.seed,
            extra=built.state,
            rank_extra=built.rank_state,
        )
        if built.scheduler is None:  # the runtime's schedule: its horizon is recorded with each checkpoint
            self.state.annotations[LR_HORIZON_KEY] = config.decay_steps
        timeout_s = config.dist.collective_timeout_s
        self.control_group = cpu_group(context.world_size, timeout_s, own=True)
        """Checkpoint coordination: object collectives work whatever the training backend is, and a
        background save's commit (its own thread) never interleaves with the step's collectives."""
        self.agreement_group = cpu_group(context.world_size, timeout_s, own=False)
        """The per-step stop agreement and the consistency check (training thread only): their flags stay
        on the CPU, so reading them never waits for the device (on the default NCCL group that read
        would synchronise the host with every step). None: the default group, already a CPU one."""
        self.checkpoints = self._make_checkpoint_manager()
        self.async_checkpoints = (
            AsyncCheckpointer(self.checkpoints) if self.checkpoints is not None and config.checkpoint.async_save else None
        )
        self.replicas = self._make_replicas()
        self.metrics = MetricsWriter(config.log.dir, enabled=context.is_main, tensorboard=config.log.tensorboard,
                                     events=self.events)
        self._start_resilience()
        self._restore_or_start_fresh()
        self.events.set_step(self.state.counters.step)
        self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self._empty_batch: Any = None
        amp_dtype = getattr(torch, config.amp_dtype)
        self._autocast: Callable[[], Any] = (
            (lambda: torch.autocast(self.device.type, dtype=amp_dtype)) if config.use_amp else nullcontext
        )
        self._last_commit_step = self.state.counters.step
        self._last_commit_time = time.monotonic()
        self._last_eval: tuple[int, dict[str, float]] | None = None
        """The step and metrics of the last evaluation (the final one is not repeated at the same step)."""
        self._phase = StepPhase.BETWEEN
        self._rng_at_start = ""
        """This rank's RNG streams when the loop began (a rescue needs them unmoved)."""

    # -- setup -------------------------------------------------------------------

    def _make_optimizer(self, built: Built) -> torch.optim.Optimizer:
        optim = self.config.optim
        if built.optimizer is not None:
            optimizer = built.optimizer(self.model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"the script's optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
                )
        else:
            optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        return shard_optimizer(optimizer) if optim.zero else optimizer

    def _make_scheduler(self, built: Built) -> Any:
        if built.scheduler is None:
            return torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        scheduler = built.scheduler(self.optimizer)
        if all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
            return scheduler
        if callable(scheduler):
            return torch.optim.lr_scheduler.LambdaLR(self.optimizer, scheduler)
        raise TypeError(f"the script's scheduler factory returned {type(scheduler).__name__}: "
                        "expected an LR scheduler or a step -> multiplier callable")

    def _lr_lambda(self, step: int) -> float:
        optim = self.config.optim
        return lr_multiplier(
            step, warmup=optim.warmup_steps, decay_steps=self.config.decay_steps,
            schedule=optim.schedule, min_ratio=optim.min_lr_ratio,
        )

    def _make_checkpoint_manager(self) -> CheckpointManager | None:
        if not self.config.checkpoint.dir:
            return None
        return CheckpointManager(
            self.config.checkpoint.dir,
            rank=self.context.rank,
            world_size=self.context.world_size,
            run_id=self.context.env.run_id,
            generation=self.context.env.restart_count,
            keep=self.config.checkpoint.keep,
            storage_options=storage_options(self.config.checkpoint),
            group=self.control_group,
            probe=True,
            events=self.events,
        )

    def _make_replicas(self) -> Replicas | None:
        checkpoint = self.config.checkpoint
        if self.checkpoints is None or not checkpoint.replica_every:
            return None
        env = self.context.env
        return Replicas(
            checkpoint.replica_dir or default_root(), run_id=env.run_id, checkpoint_uri=checkpoint.dir, rank=self.context.rank,
            world_size=self.context.world_size, local_rank=env.local_rank, node_rank=env.group_rank,
            token=self.checkpoints.token, every=checkpoint.replica_every, budget=checkpoint.replica_budget,
            generation=env.restart_count,
            group=self.agreement_group, events=self.events,
        )

    def _start_resilience(self) -> None:
        resilience = self.config.resilience
        self.stop = StopRequests()
        if resilience.handle_signals:
            self.stop.install_signal_handlers()
        self.spot_poller = (
            SpotNoticePoller(resilience.spot_notice_url, resilience.spot_poll_interval_s, self.stop).start()
            if resilience.spot_notice_url else None
        )
        step_limit = PhaseLimit(resilience.watchdog_timeout_s, "hang")
        log = self.config.log
        self.watchdog = Watchdog(
            {
                Phase.DATA: step_limit,
                Phase.STEP: step_limit,
                Phase.COLLECTIVE: step_limit,
                Phase.EVAL: step_limit,
                Phase.CHECKPOINT: PhaseLimit(resilience.watchdog_checkpoint_timeout_s, "hang"),
                Phase.EMERGENCY_SAVE: PhaseLimit(resilience.save_deadline_s, "save-deadline"),
            },
            log_file=os.path.join(log.dir, f"rank-{self.context.rank}.log") if log.per_rank_files else "",
            events=self.events,
        ).start()
        self.agreement = StopAgreement(
            world_size=self.context.world_size, requests=self.stop, group=self.agreement_group,
            interval_s=resilience.agreement_interval_s, watchdog=self.watchdog, events=self.events,
        )

    def _restore_or_start_fresh(self) -> None:
        """Resume, or start at step 0; the manager's restore writes its ``resumed`` or ``started_fresh`` event."""
        restored = None
        if self.checkpoints is not None and self.config.checkpoint.resume:
            restored = self.checkpoints.restore(self.state, allow_fresh_start=self.config.checkpoint.allow_fresh_start,
                                                replicas=self.replicas)
        else:
            if self.checkpoints is not None:
                self.checkpoints.refuse_if_committed()
            self.events.emit(Event.STARTED_FRESH, world_size=self.context.world_size,
                             reason="no-checkpoint-dir" if self.checkpoints is None else "resume-disabled")
        if restored is None:
            seed_rng_streams(derive_rng_seed(self.config.seed, 0, self.context.rank))
            self.log0.info("starting fresh at step 0 (world size %d)", self.context.world_size)
            return
        position = self.sampler.position
        self.log0.info(
            "resumed from %s%s: step %d, epoch %d, cursor %d (saved at world size %d, now %d%s)",
            "the replica in " if restored.source == "replica" else "", restored.path, restored.step, position.epoch,
            position.cursor, restored.world_size,
            self.context.world_size, "" if restored.rank_state_reused else "; RNG streams re-derived",
        )
        self._check_lr_horizon()

    def _check_lr_horizon(self) -> None:
        """Warn when the LR schedule's horizon differs from the one the checkpoint was trained with."""
        saved = self.state.restored_meta.get(LR_HORIZON_KEY)
        now = self.state.annotations.get(LR_HORIZON_KEY)
        if saved is None or now is None or saved == now:
            return
        self.log0.warning(
            "the learning-rate schedule changes on this resume: its decay ended at step %s, now at step %s%s; "
            "pass --optim-decay-steps %s to keep the schedule the run started with",
            saved, now, "" if self.config.optim.decay_steps else " (--optim-decay-steps 0 follows --max-steps)", saved,
        )
        if self.context.is_main:
            self.events.emit(Event.LR_HORIZON_CHANGED, step=self.state.counters.step, saved=saved, now=now)

    def _make_loader(self) -> Iterator[Any]:
        workers = self.config.loader.num_workers
        loader = DataLoader(
            self.train_data,
            batch_sampler=self.sampler,
            num_workers=workers,
            prefetch_factor=self.config.loader.prefetch_factor if workers else None,
            pin_memory=self.device.type == "cuda",
            # Workers' seeds come from this generator, not the global RNG, so building the loader
            # leaves the model's RNG streams untouched (bitwise resume).
            generator=torch.Generator().manual_seed(
                derive_rng_seed(self.config.seed, self.state.counters.step, self.context.rank)
            ),
        )
        return iter(loader)

    # -- the loop ----------------------------------------------------------------

    def done(self, plan: StepPlan) -> bool:
        config = self.config
        return (config.max_steps > 0 and self.state.counters.step >= config.max_steps) or (
            config.max_epochs > 0 and plan.epoch >= config.max_epochs
        )

    def run(self) -> TrainResult:
        """Train until max_steps / max_epochs, or until a stop request is agreed; commit a checkpoint.
        When a peer is lost, this rank's live state is kept for the restart where it can be (:meth:`_rescue`)."""
        try:
            return self._run()
        except RuntimeError as exc:
            if self.replicas is not None and peer_loss(exc) is not None:
                self._rescue()
            raise

    def _run(self) -> TrainResult:
        counters = self.state.counters
        progress = Progress(self.config.max_steps, Progress.wanted(self.config.log.progress, self.context.is_main))
        timer = StepTimer()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of losses, samples or units)
        batches = self._make_loader()
        collection = StepCollection(self.config.gc_every).start()  # after the loader forked its workers
        self._rng_at_start = rng_digest()
        last_loss: float | None = None
        stop_reason: str | None = None
        try:
            while not self.done(plan := self.sampler.plan()):
                started = time.perf_counter()
                data_wait = self._step(plan, batches, loss_sum)
                step_time = time.perf_counter() - started
                timer.add(plan.size, step_time, data_wait)
                self._set_log_step(counters.step)
                stop_reason, save_due = self._agree(step_time)
                if counters.step % self.config.log.every == 0:
                    last_loss = self._log_step(timer, loss_sum, plan)
                    timer.reset()
                    loss_sum.zero_()
                progress.update(counters.step, f"loss {last_loss:.4f}" if last_loss is not None else "")
                if stop_reason is not None:
                    break
                self._periodic_checks(save_due)
                collection.step(counters.step)
            self.agreement.settle()
        finally:
            collection.stop()
            progress.close()
            del batches
        if stop_reason is not None:
            return self._stop(stop_reason, last_loss)
        return self._finish(last_loss)

    def _agree(self, step_time: float) -> tuple[str | None, bool]:
        """The decision all ranks share at this step boundary: stop now (and why), and is a time-based save due."""
        every_s = self.config.checkpoint.every_seconds
        time_due = bool(every_s) and self.checkpoints is not None and time.monotonic() - self._last_commit_time >= every_s
        failed = self.async_checkpoints is not None and self.async_checkpoints.failed()
        decision = self.agreement.after_step(self.state.counters.step, step_time, time_due, failed)
        if decision.save_failed:
            self._raise_agreed_save_failure()
        return decision.stop, decision.save_due

    def _raise_agreed_save_failure(self) -> None:
        """Every rank, at the same step: raise the failed background save's error (waiting for this rank's
        own outcome if it is still in flight)."""
        assert self.async_checkpoints is not None
        self.watchdog.enter(Phase.CHECKPOINT)
        self.async_checkpoints.wait()  # raises the failure, which every rank's committer learned
        raise CheckpointError(f"rank {self.context.rank}: a background checkpoint save failed on another rank")

    def _periodic_checks(self, save_due: bool) -> None:
        step = self.state.counters.step
        if self.config.eval_every and step % self.config.eval_every == 0:
            self.watchdog.enter(Phase.EVAL)
            self.evaluate()
        if self.config.resilience.consistency_every and step % self.config.resilience.consistency_every == 0:
            self.watchdog.enter(Phase.COLLECTIVE)
            # not the control group: a background save's commit uses that one from its own thread
            check_consistency(self.model, step, self.agreement_group)
        every = self.config.checkpoint.every
        if self.checkpoints is not None and (save_due or (every and step % every == 0)):
            self.watchdog.enter(Phase.CHECKPOINT)
            self.save_checkpoint()
        if self.replicas is not None and self.replicas.due(step):
            self.watchdog.enter(Phase.COLLECTIVE)
            self.replicas.save(self.state)
        self.watchdog.enter(Phase.STEP)

    def _stop(self, reason: str, last_loss: float | None) -> TrainResult:
        """A stop request was agreed at this step: commit it (within the save deadline) and return."""
        step = self.state.counters.step
        self.log0.warning("stop agreed at step %d (%s%s)", step, reason,
                          f": {self.stop.reason}" if self.stop.reason else ": requested by a peer")
        if self.checkpoints is not None:
            self.watchdog.enter(Phase.EMERGENCY_SAVE)
            started = time.perf_counter()
            if self.async_checkpoints is not None:
                self.async_checkpoints.wait()
            if self._last_commit_step != step:
                self.checkpoints.save(self.state)
                self._last_commit_step = step
            self.log0.info("emergency checkpoint of step %d committed in %.2f s", step, time.perf_counter() - started)
        self.watchdog.enter(Phase.IDLE)
        return TrainResult(step=step, epoch=self.sampler.position.epoch, loss=last_loss, accuracy=None,
                           model_digest="", data_digest=self.sampler.data_digest, reason=reason,
                           stop_source=self.stop.reason)

    def _finish(self, last_loss: float | None) -> TrainResult:
        counters = self.state.counters
        self.watchdog.enter(Phase.CHECKPOINT)
        if self.async_checkpoints is not None:
            self.async_checkpoints.wait()
        if self.checkpoints is not None and self.config.checkpoint.save_final and self._last_commit_step != counters.step:
            self.save_checkpoint(blocking=True)
        if self.replicas is not None and self.checkpoints is not None and self.config.checkpoint.save_final:
            self.replicas.discard()  # the final state is committed: nothing will resume from node memory
        self.watchdog.enter(Phase.EVAL)
        evaluated_here = self._last_eval is not None and self._last_eval[0] == counters.step
        metrics = self._last_eval[1] if evaluated_here else self.evaluate()  # type: ignore[index]
        self.watchdog.enter(Phase.IDLE)
        result = TrainResult(
            step=counters.step,
            epoch=self.sampler.position.epoch,
            loss=last_loss,
            accuracy=metrics.get("accuracy"),
            model_digest=model_digest(self.model.state_dict()),
            data_digest=self.sampler.data_digest,
            metrics=metrics,
        )
        self.log0.info(
            "done: step=%d epoch=%d loss=%s accuracy=%s %smodel_digest=%s data_digest=%s",
            result.step, result.epoch, _fmt(result.loss), _fmt(result.accuracy),
            "".join(f"eval_{name}={_fmt(value)} " for name, value in metrics.items()),
            result.model_digest, result.data_digest,
        )
        self.events.emit(Event.DONE, step=result.step, epoch=result.epoch, model_digest=result.model_digest,
                         data_digest=result.data_digest, loss=result.loss, accuracy=result.accuracy, metrics=metrics)
        return result

    def _step(self, plan: StepPlan, batches: Iterator[Any], loss_sum: torch.Tensor) -> float:
        """One optimizer step over the plan's samples; returns the seconds spent waiting for data."""
        self._phase = StepPhase.FORWARD
        micro_batches = self.sampler.local_micro_batches(plan)
        weight = self.sampler.loss_scale(plan)
        data_wait = 0.0
        count = max(len(micro_batches), 1)  # a rank with no share still joins the gradient all-reduce
        units: torch.Tensor | None = None  # this rank's summed loss weights, for a WeightedLoss
        for index in range(count):
            waited = time.perf_counter()
            self.watchdog.enter(Phase.DATA)
            if micro_batches:
                batch = next(batches)
                self._check_ids(batch, micro_batches[index], plan)
            else:
                batch = self._empty()
            data_wait += time.perf_counter() - waited
            self.watchdog.enter(Phase.STEP)
            inputs, targets = (t.to(self.device, non_blocking=True) for t in batch[:2])
            with nullcontext() if index == count - 1 else self.ddp.no_sync():
                with self._autocast():
                    outputs = self.ddp(inputs)
                    losses = self.loss_fn(outputs, targets)
                if isinstance(losses, WeightedLoss):
                    weight_units = torch.as_tensor(losses.weight, dtype=torch.float64, device=self.device)
                    units = weight_units if units is None else units + weight_units
                    numel: torch.Tensor | int = weight_units
                    # an empty share's mean may be NaN: its zero must still reach every parameter the forward used
                    total = losses.mean * losses.weight if micro_batches else _zero_like_outputs(outputs)
                    loss = total * self.context.world_size
                else:
                    total = losses.sum()
                    loss = total * weight
                    numel = losses.numel()
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum[0] += total.detach()
            loss_sum[1] += numel
        if units is not None:  # the same on every rank: the loss function's kind does not depend on the share
            self._divide_gradients_by_global_weight(units)
        self._phase = StepPhase.UPDATE
        self._optimizer_step()
        self.state.counters.step += 1
        self.sampler.commit(plan)
        self._phase = StepPhase.BETWEEN
        return data_wait

    def _rescue(self) -> None:
        """A peer was lost: keep this rank's live state in node memory for the restart, when it is a complete
        state of its step (:mod:`elastic_ddp.resilience.rescue`); never raises (the peer's loss is the error)."""
        assert self.replicas is not None
        step = self.state.counters.step
        reason = why_not_kept(LiveState(
            phase=self._phase, forward_changes_state=has_persistent_buffers(self.model) or bool(self.state.extra),
            sharded_optimizer=self.state.sharded_optimizer, rank_objects=bool(self.state.rank_extra),
            rng_used=self._rng_at_start != rng_digest(),
            device_busy=self.device.type == "cuda" and not torch.cuda.current_stream(self.device).query(),
        ))
        if reason is not None:
            logger.warning("rank %d: the state of step %d is not kept for the restart: %s", self.context.rank, step,
                           reason)
            return
        self.watchdog.enter(Phase.EMERGENCY_SAVE)
        started = time.perf_counter()
        try:
            path = self.replicas.rescue(self.state)
        except (OSError, RuntimeError, ValueError) as exc:
            logger.warning("rank %d: keeping the state of step %d for the restart failed: %s", self.context.rank,
                           step, exc)
            return
        if path is not None:
            logger.info("rank %d: kept the state of step %d in %s for the restart (%.3f s)", self.context.rank, step,
                        path, time.perf_counter() - started)

    def _divide_gradients_by_global_weight(self, units: torch.Tensor) -> None:
        """Gradients hold the global sum of ``mean * weight``; divide them by the global total weight."""
        total = units.clone()
        if self.context.world_size > 1:
            self.watchdog.enter(Phase.COLLECTIVE)
            dist.all_reduce(total)
            self.watchdog.enter(Phase.STEP)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        weight = float(total)  # one read (on CUDA, one synchronisation)
        if grads and weight > 0:
            foreach_div_(grads, weight)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.config.optim.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _check_ids(self, batch: Any, expected: list[int], plan: StepPlan) -> None:
        """When the dataset returns sample ids, check the loader delivered exactly the planned samples."""
        if len(batch) < 3:
            return
        got = batch[2].tolist()
        if got != expected:
            raise DataError(
                f"rank {self.context.rank}: step {self.state.counters.step + 1} (epoch {plan.epoch}) expected samples "
                f"{expected[:8]}… but the loader delivered {got[:8]}…: the DataLoader must use the ElasticSampler"
            )

    def _empty(self) -> Any:
        """A zero-sample batch shaped like the dataset's samples (for a rank whose share of a step is empty)."""
        if self._empty_batch is None:
            self._empty_batch = [t[:0] for t in default_collate([self.train_data[0]])]
        return self._empty_batch

    # -- logging, eval, checkpoints ------------------------------------------------

    def _set_log_step(self, step: int) -> None:
        self.events.set_step(step)
        if self.log_context is not None:
            self.log_context.set_step(step)

    def _log_step(self, timer: StepTimer, loss_sum: torch.Tensor, plan: StepPlan) -> float:
        totals = loss_sum.clone()
        if self.context.world_size > 1:
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        summary = timer.summary()
        if self.tokens_per_sample:
            summary["tokens_per_s"] = summary["samples_per_s"] * self.tokens_per_sample
        lr = self.optimizer.param_groups[0]["lr"]
        self.log0.info(
            "loss %.4f | lr %.2e | %.0f samples/s | step %.1f ms | data wait %.1f ms | epoch %d | world %d",
            loss, lr, summary["samples_per_s"], 1e3 * summary["step_time_s"], 1e3 * summary["data_wait_s"],
            plan.epoch, self.context.world_size,
        )
        self.metrics.write(
            {
                "step": self.state.counters.step,
                "epoch": self.sampler.position.epoch,
                "loss": loss,
                "lr": lr,
                "world_size": self.context.world_size,
                "time": time.time(),
                **summary,
            }
        )
        return loss

    def evaluate(self) -> dict[str, float]:
        """The script's evaluation of the current model (rank 0 computes and logs it); {} when there is none."""
        if self.evaluate_fn is None or not self.context.is_main:
            return {}
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = {name: float(value) for name, value in self.evaluate_fn(self.model, self.device).items()}
        finally:
            self.model.train()
        self._last_eval = (self.state.counters.step, metrics)
        logger.info("eval %s", " ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        evaluated = {f"eval_{name}": value for name, value in metrics.items()}
        self.metrics.write({"step": self.state.counters.step, **evaluated, "time": time.time()})
        return metrics

    def save_checkpoint(self, blocking: bool = False) -> None:
        """Commit a checkpoint of the current step: staged and committed in the background unless ``blocking``."""
        assert self.checkpoints is not None
        step = self.state.counters.step
        if self.async_checkpoints is not None and not blocking:
            blocked = self.async_checkpoints.save(self.state)
            self.log0.info("checkpoint of step %d captured in %.3f s; parameters and optimizer state are copied during "
                           "the next step, then committed in the background", step, blocked)
        else:
            started = time.perf_counter()
            if self.async_checkpoints is not None:
                self.async_checkpoints.wait()
            self.checkpoints.save(self.state)
            self.log0.info("checkpoint of step %d committed in %.2f s", step, time.perf_counter() - started)
        self._last_commit_step = step
        self._last_commit_time = time.monotonic()

    def close(self) -> None:
        self.watchdog.enter(Phase.CHECKPOINT)  # a save still in flight is waited for under that phase's limit
        if self.async_checkpoints is not None:
            self.async_checkpoints.close()
        if self.replicas is not None:
            self.replicas.close()
        if self.checkpoints is not None:
            self.checkpoints.wait_for_retention()
        self.watchdog.close()
        if self.spot_poller is not None:
            self.spot_poller.close()
        self.stop.restore_signal_handlers()
        self.metrics.close()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _zero_like_outputs(outputs: Any) -> torch.Tensor:
    """A zero loss that still reaches every parameter the forward used (for a rank with no share of a step)."""
    tensors = [t for t in (outputs if isinstance(outputs, (tuple, list)) else [outputs]) if isinstance(t, torch.Tensor)]
    return sum((t.float().sum() * 0.0 for t in tensors), torch.zeros((), device=tensors[0].device if tensors else None))
