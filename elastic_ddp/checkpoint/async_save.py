"""Asynchronous checkpointing: the training step only stages state; a background thread commits it.

Rules:
* At most one save is in flight. A save that is still running when the next one is due makes
  the trainer wait, and the wait is logged — memory never grows with a queue of snapshots.
* The blocking part is :meth:`CheckpointManager.capture` with ``copy=True``: a copy into
  staging buffers reused from save to save.
* Errors of the background save are never swallowed: the commit outcome is shared by all ranks
  (over the manager's own process group), so every rank raises it at its next step boundary.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from elastic_ddp.checkpoint.manager import CheckpointManager
from elastic_ddp.checkpoint.manifest import Manifest
from elastic_ddp.errors import CheckpointError
from elastic_ddp.state import TrainState

logger = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Runs :meth:`CheckpointManager.write_and_commit` of one staged checkpoint at a time in the background."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-ddp-ckpt")
        self._in_flight: Future[Manifest] | None = None
        self._in_flight_step: int | None = None
        self.last_committed: Manifest | None = None

    def save(self, state: TrainState) -> float:
        """Stage the current state and start committing it; returns the seconds the caller was blocked."""
        started = time.perf_counter()
        waited = self.wait()
        if waited > 0.001:
            logger.info("waited %.2f s for the previous checkpoint save before staging step %d", waited, state.counters.step)
        staged = self.manager.capture(state, copy=True)
        self._in_flight = self._executor.submit(self.manager.write_and_commit, staged)
        self._in_flight_step = staged.step
        return time.perf_counter() - started

    def poll(self) -> None:
        """Raise, on this rank, the error of a background save that has finished with one."""
        if self._in_flight is not None and self._in_flight.done():
            self._collect()

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
