"""The hang watchdog (docs/design.md, "Failure semantics"): a thread that knows the current phase and the time of the last progress.

The trainer marks phases (``data``, ``step``, ``collective``, ``checkpoint``, ...). When a phase
with a timeout lasts longer than it, the watchdog writes the phase and every thread's stack
(``faulthandler``) to stderr and the rank's log file, records the failure for torchrun's agent,
and ends the process with a distinct status, so the agent restarts the group from the last
checkpoint. It ends the worker, not the agent (unlike torch's FileTimerServer, whose expiry
kills the agent and with it the job).

Marking a phase is two attribute stores; the thread wakes about once a second.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

from elastic_ddp.resilience.exits import exit_code, log_exit, write_error_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PhaseLimit:
    """How long a phase may last, and the exit reason when it lasts longer."""

    timeout_s: float
    reason: str


class Watchdog:
    """Watches the phase the trainer is in; ends the process when one lasts past its limit."""

    def __init__(self, limits: dict[str, PhaseLimit], log_file: str = "", poll_s: float = 1.0) -> None:
        self.limits = {phase: limit for phase, limit in limits.items() if limit.timeout_s > 0}
        self.log_file = log_file
        shortest = min((limit.timeout_s for limit in self.limits.values()), default=poll_s * 4)
        self.poll_s = min(poll_s, shortest / 4)
        self.phase = "idle"
        self.since = time.monotonic()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ddp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.limits:
            self._thread.start()
        return self

    def enter(self, phase: str) -> None:
        """Mark the start of a phase (also counts as progress)."""
        self.since = time.monotonic()
        self.phase = phase

    def close(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 1)

    def _run(self) -> None:
        while not self._halt.wait(self.poll_s):
            phase, since = self.phase, self.since
            limit = self.limits.get(phase)
            if limit is not None and time.monotonic() - since > limit.timeout_s:
                self._expire(phase, limit, time.monotonic() - since)

    def _expire(self, phase: str, limit: PhaseLimit, stuck_s: float) -> None:
        reason = limit.reason if limit.reason != "hang" else f"hang:{phase}"
        message = f"no progress in phase {phase!r} for {stuck_s:.1f} s (limit {limit.timeout_s:g} s)"
        logger.error("watchdog: %s; dumping all thread stacks", message)
        self._dump_stacks(reason, message)
        write_error_file(reason, message)
        log_exit(reason, message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(exit_code(reason))

    def _dump_stacks(self, reason: str, message: str) -> None:
        sys.stderr.write(f"watchdog {reason}: {message}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.log_file:
            with open(self.log_file, "a", encoding="utf-8") as handle:
                handle.write(f"watchdog {reason}: {message}\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
