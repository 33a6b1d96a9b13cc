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
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp._torch_compat import foreach_div_
from elastic_ddp.batch import collate, map_tensors, tensors, to_device
from elastic_ddp.build import Built, WeightedLoss
from elastic_ddp.collection import StepCollection
from elastic_ddp.config import DdpConfig, TrainConfig
from elastic_ddp.data import StepPlan, check_delivered
from elastic_ddp.distributed import DistContext
from elastic_ddp.errors import ConfigError
from elastic_ddp.events import Event, EventLog
from elastic_ddp.logs import LogContext, main_only
from elastic_ddp.metrics import Progress, StepTimer
from elastic_ddp.parts import check_losses, check_lr_horizon, make_loader, make_parts, start_prefetch
from elastic_ddp.report import StepReport
from elastic_ddp.resilience.consistency import check_consistency
from elastic_ddp.resilience.watchdog import Phase
from elastic_ddp.runtime import Runtime
from elastic_ddp.state import derive_rng_seed, model_digest

if TYPE_CHECKING:
    from elastic_ddp.inprocess import LaunchedMembership

logger = logging.getLogger(__name__)

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


class Trainer:
    """The step engine of one launch: the script's model, data, optimizer, loss and evaluation, stepped on
    top of a :class:`~elastic_ddp.runtime.Runtime` (checkpoints, replicas, stops, exits)."""

    def __init__(
        self,
        config: TrainConfig,
        context: DistContext,
        built: Built,
        *,
        log_context: LogContext | None = None,
        events: EventLog | None = None,
        launched: LaunchedMembership | None = None,
    ) -> None:
        """``events``: the run's event stream (resumed, committed, stop agreed, done, ...); none: not written.
        ``launched``: the worker membership of the etcd-v3 handler's in-process mode (:mod:`elastic_ddp.inprocess`):
        the survivors of a lost peer then go on in their own processes."""
        self.config = config
        self.context = context
        self.launched = launched
        self.device = context.device
        self.loss_fn = built.loss_fn
        self.train_data = built.train_data
        self.log_context = log_context
        self.events = events or EventLog.off()
        self.log0 = main_only(logger, context.rank)
        parts = make_parts(config, built, self.device, context.rank, context.world_size)
        self.model, self.optimizer, self.scheduler, self.scaler = parts.model, parts.optimizer, parts.scheduler, parts.scaler
        self.sampler, self.state = parts.sampler, parts.state
        amp_dtype = getattr(torch, config.amp_dtype)
        self._autocast: Callable[[], Any] = (
            (lambda: torch.autocast(self.device.type, dtype=amp_dtype)) if config.use_amp else nullcontext
        )
        self.report = StepReport(built, config.log, rank=context.rank, world_size=context.world_size, events=self.events)
        self._empty_batch: Any = None
        self._loss_checked = False
        self._graph_checked = False

    def make_runtime(self) -> Runtime:
        """The runtime this trainer steps on, built from the config's sections (enter it with ``with``)."""
        log = self.config.log
        return Runtime(
            self.state, checkpoint=self.config.checkpoint, resilience=self.config.resilience,
            collective_timeout_s=self.config.dist.collective_timeout_s, events=self.events,
            rank_log_file=os.path.join(log.dir, f"rank-{self.context.rank}.log") if log.per_rank_files else "",
            sample_ledger=log.sample_ledger, membership=self.launched,
        )

    # -- the loop ----------------------------------------------------------------

    def done(self, plan: StepPlan) -> bool:
        config = self.config
        return (config.max_steps > 0 and self.state.counters.step >= config.max_steps) or (
            config.max_epochs > 0 and plan.epoch >= config.max_epochs
        )

    def run(self, runtime: Runtime) -> TrainResult:
        """Resume (or start fresh), then train until max_steps / max_epochs, or until a stop request is agreed;
        the last checkpoint is committed through ``runtime``."""
        self.runtime = runtime
        self.watchdog = runtime.watchdog
        try:
            step = runtime.restore()  # a worker that joins a running membership: through runtime.join()
            if self.done(self.sampler.plan()):
                self.log0.info("the run is already complete at step %d: nothing to train (raise --max-steps or "
                               "--max-epochs to go on)", step)
            check_lr_horizon(self.state, self.config, self.events if self.context.is_main else None)
            self.ddp = wrap_model(self.model, self.config, self.device)
            self.forward = compile_model(self.ddp, self.config) if self.config.compile else self.ddp
            return self._run()
        finally:
            self.report.close()

    def _run(self) -> TrainResult:
        counters = self.state.counters
        progress = Progress(self.config.max_steps, Progress.wanted(self.config.log.progress, self.context.is_main))
        timer = StepTimer()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of losses, samples or units)
        batches = self._batches()
        collection = StepCollection(self.config.gc_every).start()  # after the loader forked its workers
        prefetch = ExitStack()
        prefetch.enter_context(start_prefetch(self.train_data, self.sampler))  # likewise
        self.runtime.begin()
        last_loss: float | None = None
        stop_reason: str | None = None
        first = True
        try:
            while not self.done(plan := self.sampler.plan()):
                try:
                    started = time.perf_counter()
                    data_wait = self._step(plan, batches, loss_sum)
                    step_time = time.perf_counter() - started
                    timer.add(plan.size, step_time, data_wait)
                    if first:
                        self.events.emit(Event.FIRST_STEP, step=counters.step, data_wait_s=round(data_wait, 6),
                                         step_time_s=round(step_time, 6))
                        first = False
                    if self.log_context is not None:
                        self.log_context.set_step(counters.step)  # the runtime's agreement sets the events' step
                    decision = self.runtime.agree(step_time)
                    stop_reason = decision.stop
                    if counters.step % self.config.log.every == 0:
                        last_loss = self.report.log_step(counters.step, self.sampler.position.epoch,
                                                         self.optimizer.param_groups[0]["lr"], timer, loss_sum)
                        timer.reset()
                        loss_sum.zero_()
                    progress.update(counters.step, f"loss {last_loss:.4f}" if last_loss is not None else "")
                    if stop_reason is not None:
                        break
                    if decision.leaving:  # their nodes preempted, ranks leave now: no collective of theirs follows
                        batches = iter(())  # the old loader's workers go with its iterator
                        self.runtime.change_membership(decision)
                        batches = self._in_the_new_membership()
                        continue
                    self._periodic_checks()
                    self.runtime.save_if_due(decision.save_due)
                    collection.step(counters.step)
                    if decision.membership and not self.done(self.sampler.plan()):  # a worker joins, at this step
                        batches = iter(())
                        self.runtime.change_membership(decision)
                        batches = self._in_the_new_membership()
                except RuntimeError as exc:
                    batches = iter(())
                    if not self.runtime.recover(exc):  # in-process mode, a peer's loss: re-formed in this process
                        raise
                    batches = self._in_the_new_membership()
                    timer.reset()
                    loss_sum.zero_()
        finally:
            prefetch.close()
            collection.stop()
            progress.close()
            del batches
        self.runtime.finish()
        if stop_reason is not None:
            return TrainResult(step=counters.step, epoch=self.sampler.position.epoch, loss=last_loss, accuracy=None,
                               model_digest="", data_digest=self.sampler.data_digest, reason=stop_reason,
                               stop_source=self.runtime.stop.reason)
        return self._finish(last_loss)

    def _batches(self) -> Iterator[Any]:
        """A loader from the sampler's position, its workers seeded by this rank and the step."""
        return make_loader(self.train_data, self.sampler, self.config.loader, self.device,
                           seed=derive_rng_seed(self.config.seed, self.state.counters.step, self.context.rank))

    def _in_the_new_membership(self) -> Iterator[Any]:
        """After the runtime re-formed in this process (in-process mode): everything of the trainer's that
        depends on the rank or the world size follows the new membership, the model is wrapped again, and the
        loader made again (returned)."""
        rank, world_size = self.runtime.rank, self.runtime.world_size
        self.context = DistContext(env=replace(self.context.env, rank=rank, world_size=world_size), device=self.device,
                                   backend=self.context.backend)
        self.log0 = main_only(logger, rank)
        self.report.follow(rank, world_size)
        self.ddp = wrap_model(self.model, self.config, self.device)
        self.forward = compile_model(self.ddp, self.config) if self.config.compile else self.ddp
        self._graph_checked = False  # a collective of the first step: every member runs it with a joiner's first
        return self._batches()

    def _periodic_checks(self) -> None:
        step = self.state.counters.step
        if self.config.eval_every and step % self.config.eval_every == 0:
            self.watchdog.enter(Phase.EVAL)
            self.report.evaluate(self.model, self.device, step)
        if self.config.resilience.consistency_every and step % self.config.resilience.consistency_every == 0:
            self.watchdog.enter(Phase.COLLECTIVE)
            # not the control group: a background save's commit uses that one from its own thread
            check_consistency(self.model, step, self.runtime.agreement_group)

    def _finish(self, last_loss: float | None) -> TrainResult:
        counters = self.state.counters
        self.watchdog.enter(Phase.EVAL)
        metrics = self.report.final_evaluation(self.model, self.device, counters.step)
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
        self.runtime.report_done(result.loss, result.accuracy, metrics)
        return result

    def _step(self, plan: StepPlan, batches: Iterator[Any], loss_sum: torch.Tensor) -> float:
        """One optimizer step over the plan's samples; returns the seconds spent waiting for data."""
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
                check_delivered(batch, micro_batches[index], self.context.rank, self.state.counters.step + 1, plan)
            else:
                batch = self._empty()
            data_wait += time.perf_counter() - waited
            self.watchdog.enter(Phase.STEP)
            inputs, targets = to_device(batch[0], self.device), to_device(batch[1], self.device)
            with nullcontext() if index == count - 1 else self.ddp.no_sync():
                with self._autocast():
                    outputs = self.forward(inputs)
                    losses = self.loss_fn(outputs, targets)
                if not self._loss_checked and micro_batches:
                    check_losses(losses, len(micro_batches[index]))
                    self._loss_checked = True
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
                if not self._graph_checked:
                    check_all_parameters_used(self.model, self.config.ddp, self.device)
                    self._graph_checked = True
            loss_sum[0] += total.detach()
            loss_sum[1] += numel
        if units is not None:  # the same on every rank: the loss function's kind does not depend on the share
            self._divide_gradients_by_global_weight(units)
        self._optimizer_step()
        self.state.counters.step += 1
        self.sampler.commit(plan)
        return data_wait

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

    def _empty(self) -> Any:
        """A zero-sample batch shaped like the dataset's samples (for a rank whose share of a step is empty)."""
        if self._empty_batch is None:
            self._empty_batch = map_tensors(lambda tensor: tensor[:0], collate([self.train_data[0]]))
        return self._empty_batch

def wrap_model(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> DistributedDataParallel:
    """``model`` in DistributedDataParallel with the ``--ddp-*`` options."""
    ddp = config.ddp
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=ddp.find_unused_parameters, static_graph=ddp.static_graph,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view, bucket_cap_mb=ddp.bucket_cap_mb,
        **({} if ddp.broadcast_buffers else _no_buffer_sync_at_forward()),
    )


def _no_buffer_sync_at_forward() -> dict[str, Any]:
    """DDP's keyword for buffers copied once at wrapping, not at each forward: ``forward_sync_buffers`` where
    this torch has it (``broadcast_buffers`` is deprecated there and warns), else ``broadcast_buffers``."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def compile_model(ddp: DistributedDataParallel, config: TrainConfig) -> Callable[..., Any]:
    """The DDP-wrapped model compiled with ``--compile-mode``. Compiling the wrapper, not the module, lets
    torch split the graph at DDP's buckets so gradients are still all-reduced during the backward pass, and
    leaves the module, and so the checkpoint's keys, as they are."""
    return torch.compile(ddp, mode=None if config.compile_mode == "default" else config.compile_mode)


def check_all_parameters_used(model: torch.nn.Module, ddp: DdpConfig, device: torch.device) -> None:
    """After the run's first backward pass: refuse a model whose loss left parameters without a gradient on
    any rank, unless DDP was told to expect that (``--ddp-find-unused-parameters`` or ``--ddp-static-graph``),
    before DDP fails the next step with a message about arguments the script never passed. One all-reduce of
    a flag per parameter, so every rank refuses alike (a parameter unused on one rank stalls them all)."""
    if ddp.find_unused_parameters or ddp.static_graph:
        return
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    unused_here = torch.tensor([parameter.grad is None for _, parameter in trainable], dtype=torch.uint8, device=device)
    if dist.is_initialized():
        dist.all_reduce(unused_here, op=dist.ReduceOp.MAX)
    unused = [name for (name, _), flag in zip(trainable, unused_here.tolist(), strict=True) if flag]
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise ConfigError(f"the loss did not use {len(unused)} of the model's trainable parameters ({shown}): pass "
                          "--ddp-find-unused-parameters, or freeze them (requires_grad=False) if they are never trained")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _zero_like_outputs(outputs: Any) -> torch.Tensor:
    """A zero loss that still reaches every parameter the forward used (for a rank with no share of a step)."""
    found = list(tensors(outputs))
    return sum((t.float().sum() * 0.0 for t in found), torch.zeros((), device=found[0].device if found else None))
