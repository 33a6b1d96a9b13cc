"""What a trainer-path run tells its reader: the loss line every ``--log-every`` steps (also to
``metrics.jsonl`` and TensorBoard) and the script's evaluation, on rank 0."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from elastic_ddp.build import Built, EvalFn, accuracy_on
from elastic_ddp.config import LogConfig
from elastic_ddp.events import EventLog
from elastic_ddp.logs import main_only
from elastic_ddp.metrics import MetricsWriter, StepTimer

logger = logging.getLogger(__name__)


class StepReport:
    """The loss line, the metrics and the evaluations of one launch (``rank``'s view; rank 0 writes and evaluates)."""

    def __init__(self, built: Built, log: LogConfig, *, rank: int, world_size: int, events: EventLog) -> None:
        self.rank, self.world_size = rank, world_size
        self.log0 = main_only(logger, rank)
        self.evaluate_fn: EvalFn | None = built.evaluate or (
            accuracy_on(built.eval_data) if built.eval_data is not None and len(built.eval_data) else None  # type: ignore[arg-type]
        )
        self.tokens_per_sample = built.tokens_per_sample
        self._log, self._events = log, events
        self.metrics = MetricsWriter(log.dir, enabled=rank == 0, tensorboard=log.tensorboard, events=events)
        """Opened before the runtime restores: its ``resumed`` or ``started_fresh`` event is a TensorBoard marker."""
        self.last_eval: tuple[int, dict[str, float]] | None = None
        """The step and metrics of the last evaluation (the final one is not repeated at the same step)."""

    def follow(self, rank: int, world_size: int) -> None:
        """The membership changed in this process (in-process mode): this rank's view becomes ``rank`` of
        ``world_size``; a rank that becomes rank 0 takes over the metrics file (appending to it), one that stops
        being rank 0 leaves it."""
        if (rank == 0) != (self.rank == 0):
            self.metrics.close()
            self.metrics = MetricsWriter(self._log.dir, enabled=rank == 0, tensorboard=self._log.tensorboard,
                                         events=self._events)
        self.rank, self.world_size = rank, world_size
        self.log0 = main_only(logger, rank)

    def log_step(self, step: int, epoch: int, lr: float, timer: StepTimer, loss_sum: torch.Tensor) -> float:
        """Log the mean loss since the last line (one all-reduce of ``(sum, samples or units)``) and the step's
        throughput; every rank calls it at the same step. Returns the mean loss."""
        totals = loss_sum.clone()
        if self.world_size > 1:
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        summary = timer.summary()
        if self.tokens_per_sample:
            summary["tokens_per_s"] = summary["samples_per_s"] * self.tokens_per_sample
        self.log0.info(
            "loss %.4f | lr %.2e | %.0f samples/s | step %.1f ms | data wait %.1f ms | epoch %d | world %d",
            loss, lr, summary["samples_per_s"], 1e3 * summary["step_time_s"], 1e3 * summary["data_wait_s"],
            epoch, self.world_size,
        )
        self.metrics.write({"step": step, "epoch": epoch, "loss": loss, "lr": lr, "world_size": self.world_size,
                            "time": time.time(), **summary})
        return loss

    def evaluate(self, model: torch.nn.Module, device: torch.device, step: int) -> dict[str, float]:
        """The script's evaluation of the current model (rank 0 computes and logs it); {} when there is none."""
        if self.evaluate_fn is None or self.rank != 0:
            return {}
        model.eval()
        try:
            with torch.no_grad():
                metrics = {name: float(value) for name, value in self.evaluate_fn(model, device).items()}
        finally:
            model.train()
        self.last_eval = (step, metrics)
        logger.info("eval %s", " ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        self.metrics.write({"step": step, **{f"eval_{name}": value for name, value in metrics.items()}, "time": time.time()})
        return metrics

    def final_evaluation(self, model: torch.nn.Module, device: torch.device, step: int) -> dict[str, float]:
        """The evaluation at the end: the one of this step when it already ran."""
        if self.last_eval is not None and self.last_eval[0] == step:
            return self.last_eval[1]
        return self.evaluate(model, device, step)

    def close(self) -> None:
        self.metrics.close()
