"""Python's cyclic garbage collector, run at agreed steps instead of whenever it decides to.

Left automatic, a full collection pauses a rank for a few hundred milliseconds at a moment chosen
by its allocation counters: a different step on every rank. In DDP the others then wait for that
rank at the next gradient all-reduce, so each rank's pauses cost every rank, and with more ranks
some rank is collecting more often. :class:`StepCollection` disables the automatic collector for
the step loop and collects on every rank at the same steps instead. Objects that exist when the
loop starts (the model, the data, everything imported) are frozen out of collections, so a
collection walks only what the loop itself created since and takes a few milliseconds; cyclic
garbage already old at that moment is freed when the loop ends.

Start it after the ``DataLoader``'s workers are forked: a forked worker inherits the collector's
state, and workers have no step at which to collect.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class StepCollection:
    """Collects garbage every ``every`` steps between :meth:`start` and :meth:`stop`; 0 leaves Python's
    automatic collection on."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"gc every must be >= 0 steps, got {every}")
        self.every = every
        self._was_enabled: bool | None = None

    def start(self) -> StepCollection:
        if self.every and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect(1)  # the young generations only: a full collection here would cost what one automatic pause does
            gc.freeze()
        return self

    def step(self, step: int) -> None:
        """Collect if ``step`` is one of the schedule's steps (the same steps on every rank)."""
        if self._was_enabled is None or step % self.every:
            return
        started = time.perf_counter()
        found = gc.collect()
        logger.debug("garbage collection at step %d: %d objects freed in %.1f ms", step, found,
                     1e3 * (time.perf_counter() - started))

    def stop(self) -> None:
        """Give the objects frozen at :meth:`start` back to the collector and restore its previous state."""
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
