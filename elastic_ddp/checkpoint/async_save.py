"""Asynchronous checkpointing: the training step only stages state; a background thread commits it.

Rules:
* At most one save is in flight. A save that is still running when the next one is due makes
  the trainer wait, and the wait is logged — memory never grows with a queue of snapshots.
* The blocking part is small. :meth:`CheckpointManager.capture` copies into staging buffers
  reused from save to save, in two parts: what a forward pass or anything else may change
  (buffers, scaler, RNG streams, counters) before :meth:`save` returns; what only the
  optimizer's ``step()`` changes (parameters and optimizer state: nearly all the bytes) on the
  background thread, while the next forward and backward run. The optimizer's next ``step()``
  waits for that copy (a step pre-hook), so the checkpoint holds exactly the state of the step
  it is named after. On CUDA the copy runs on its own stream, ordered after the work that
  produced the state. Contract for callers: between :meth:`save` and the optimizer's next
  ``step()``, nothing else writes to the parameters or the optimizer state in place.
* Hashing, writing and the commit run on a second thread at a lower scheduling priority
  (:func:`~elastic_ddp.checkpoint.storage.lower_thread_priority`), in the CPU time that the
  training threads leave idle, so that they slow the steps they overlap as little as possible.
* Errors of the background save are never swallowed: the commit outcome is shared by all ranks
  (over the manager's own process group), so every rank raises it at its next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from elastic_ddp.checkpoint.files import lower_thread_priority
from elastic_ddp.checkpoint.manager import CheckpointManager, Staged
from elastic_ddp.checkpoint.manifest import Manifest
from elastic_ddp.errors import CheckpointError
from elastic_ddp.state import TrainState

logger = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Runs :meth:`CheckpointManager.write_and_commit` of one staged checkpoint at a time in the background."""

    def __init__(self, manager: CheckpointManager, overlap: bool = True) -> None:
        """``overlap=False`` copies everything before :meth:`save` returns (no step pre-hook)."""
        self.manager = manager
        self.overlap = overlap
        # Two threads: the copy runs at the training loop's priority (the optimizer's next step waits
        # for it); hashing, writing and the commit run at a lower one, in the CPU time training leaves.
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-ddp-stage")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-ddp-ckpt",
                                            initializer=lower_thread_priority)
        self._in_flight: Future[Manifest] | None = None
        self._in_flight_step: int | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._hook: tuple[torch.optim.Optimizer, RemovableHandle] | None = None
        self.last_committed: Manifest | None = None
        self.last_step_wait = 0.0
        """Seconds the optimizer's step after the last save waited for the background copy."""

    def save(self, state: TrainState) -> float:
        """Stage the current state and start committing it; returns the seconds the caller was blocked."""
        started = time.perf_counter()
        waited = self.wait()
        if waited > 0.001:
            logger.info("waited %.2f s for the previous checkpoint save before staging step %d", waited, state.counters.step)
        if self.overlap:
            self._hook_step_of(state.optimizer)
        staged = self.manager.capture(state, copy=True, defer=self.overlap)
        self._staged.clear()
        self.last_step_wait = 0.0
        staging = self._stager.submit(self._stage, staged)
        self._in_flight = self._executor.submit(self._commit_when_staged, staging, staged)
        self._in_flight_step = staged.step
        return time.perf_counter() - started

    def _stage(self, staged: Staged) -> None:
        try:
            staged.finish_staging()
        except Exception as exc:  # noqa: BLE001 - reported to the committer: the save fails on every rank
            staged.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self._staged.set()

    def _commit_when_staged(self, staging: Future[None], staged: Staged) -> Manifest:
        staging.result()
        return self.manager.write_and_commit(staged)

    def _hook_step_of(self, optimizer: torch.optim.Optimizer) -> None:
        if self._hook is not None and self._hook[0] is optimizer:
            return
        self._unhook()
        self._hook = (optimizer, optimizer.register_step_pre_hook(self._before_optimizer_step))

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook[1].remove()
            self._hook = None

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Hold the optimizer's step until the parameters and its state are copied (a step pre-hook)."""
        if self._staged.is_set():
            return
        started = time.perf_counter()
        self._staged.wait()
        self.last_step_wait = time.perf_counter() - started
        logger.debug("optimizer step waited %.3f s for the checkpoint copy of step %s", self.last_step_wait, self._in_flight_step)

    def poll(self) -> None:
        """Raise, on this rank, the error of a background save that has finished with one."""
        if self._in_flight is not None and self._in_flight.done():
            self._collect()

    def failed(self) -> bool:
        """Whether the save in flight has finished with an error (without raising it: the trainer first
        agrees on it with the other ranks, so that all of them stop at the same step)."""
        return self._in_flight is not None and self._in_flight.done() and self._in_flight.exception() is not None

    def wait(self) -> float:
        """Block until the save in flight (if any) is committed; returns the seconds waited; raises its error."""
        if self._in_flight is None:
            return 0.0
        started = time.perf_counter()
        self._in_flight.exception()  # waits without raising, so the timing below is the wait alone
        waited = time.perf_counter() - started
        self._collect()
        return waited

    def _collect(self) -> None:
        future, step = self._in_flight, self._in_flight_step
        self._in_flight = self._in_flight_step = None
        assert future is not None
        try:
            self.last_committed = future.result()
        except CheckpointError:
            raise
        except Exception as exc:  # a failure of this rank's own thread (not agreed with the others)
            raise CheckpointError(f"background save of step {step} failed on rank {self.manager.rank}: {exc}") from exc

    @property
    def busy(self) -> bool:
        return self._in_flight is not None

    def close(self) -> None:
        """Stop the background thread once the save in flight (if any) has finished; does not raise."""
        try:
            self.wait()
        except CheckpointError as exc:
            logger.error("checkpoint save in flight at shutdown failed: %s", exc)
        finally:
            self._executor.shutdown(wait=True)
            self._stager.shutdown(wait=True)
            self._unhook()
