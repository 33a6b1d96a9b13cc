"""The hang watchdog (docs/design.md, "Failure semantics"): a thread that knows the current phase and the time of
the last progress.

The trainer marks phases (``data``, ``step``, ``collective``, ``checkpoint``, ...). When a phase
with a timeout lasts longer than it, the watchdog writes the phase and every thread's stack
(``faulthandler``) to stderr and the rank's log file, records the failure for torchrun's agent,
and ends the process with a distinct status, so the agent restarts the group from the last
checkpoint. It ends the worker, not the agent (unlike torch's FileTimerServer, whose expiry
kills the agent and with it the job).

Marking a phase is two attribute stores; the thread wakes about once a second.
"""

from __future__ import annotations

import enum
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elastic_ddp.events import Event, EventLog
from elastic_ddp.resilience.exits import ExitReason, log_exit, write_error_file

logger = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    """What a worker is doing. A name that is not a member is an error, not a phase without a limit."""

    IDLE = "idle"
    DATA = "data"
    STEP = "step"
    COLLECTIVE = "collective"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    EMERGENCY_SAVE = "emergency-save"


@dataclass(frozen=True)
class PhaseLimit:
    """How long a phase may last, and the exit reason when it lasts longer."""

    timeout_s: float
    reason: ExitReason

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", ExitReason(self.reason))  # "hang" is accepted for ExitReason.HANG


class Watchdog:
    """Watches the phase the trainer is in; ends the process when one lasts past its limit."""

    def __init__(
        self,
        limits: Mapping[Phase | str, PhaseLimit],
        log_file: str = "",
        poll_s: float = 1.0,
        exit: Callable[[int], None] = os._exit,
        events: EventLog | None = None,
    ) -> None:
        """``exit``: what ends the process on expiry, with the reason's status (``os._exit``: no cleanup
        that could hang too); a test passes a recorder to watch an expiry in-process. ``events``: where
        the ``watchdog_fired`` and ``exit`` events of an expiry go."""
        self.limits = {Phase(phase): limit for phase, limit in limits.items() if limit.timeout_s > 0}
        self.log_file = log_file
        self.exit = exit
        self.events = events or EventLog.off()
        shortest = min((limit.timeout_s for limit in self.limits.values()), default=poll_s * 4)
        self.poll_s = min(poll_s, shortest / 4)
        self.phase = Phase.IDLE
        self.since = time.monotonic()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-ddp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.limits:
            self._thread.start()
        return self

    def enter(self, phase: Phase | str) -> None:
        """Mark the start of a phase (also counts as progress); ValueError for a name that is not a phase."""
        self.since = time.monotonic()
        self.phase = Phase(phase)

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
                return

    def _expire(self, phase: Phase, limit: PhaseLimit, stuck_s: float) -> None:
        where = phase.value if limit.reason is ExitReason.HANG else ""
        label = limit.reason.label(where)
        message = f"no progress in phase {phase.value!r} for {stuck_s:.1f} s (limit {limit.timeout_s:g} s)"
        logger.error("watchdog: %s; dumping all thread stacks", message)
        self.events.emit(Event.WATCHDOG_FIRED, phase=phase.value, reason=label, stuck_s=round(stuck_s, 3),
                         limit_s=limit.timeout_s)
        self._dump_stacks(label, message)
        write_error_file(label, message)
        log_exit(limit.reason, message, self.events, phase=where)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.exit(limit.reason.status)

    def _dump_stacks(self, reason: str, message: str) -> None:
        sys.stderr.write(f"watchdog {reason}: {message}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.log_file:
            with open(self.log_file, "a", encoding="utf-8") as handle:
                handle.write(f"watchdog {reason}: {message}\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
