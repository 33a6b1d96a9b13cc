"""What a worker knows of its group from its agent, not from a backend's error text (docs/design.md,
"Failure semantics").

torchrun's agent stops a worker group by sending SIGTERM to each of its workers: when one of them died,
when another node waits for a new round (a node left or joins), or when the agent itself is stopped. A
worker whose collective will never complete learns it that way. gloo raises when the other end of a
connection closes, but NCCL blocks in the collective until its timeout, and so does gloo when the dead
peer's connection is never closed (a partition, a host that vanished). The Python signal handler cannot
run while the training thread waits inside such a collective, so :class:`GroupWatch` reads the signal
through :func:`signal.set_wakeup_fd` on a thread of its own.

Once the agent has asked, a training thread that has made no progress (a phase change: it finished the
step, or reached the stop agreement) for ``grace`` seconds, counted from its last progress, is stuck: a
healthy group makes progress within a few step times, and stops at the next step boundary as every stop
does. A step stuck in a step or a collective phase is abandoned at once: :class:`GroupWatch` calls
``abandon``, which keeps the live state when it is complete and ends the process as ``peer-lost``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from elastic_ddp.resilience.watchdog import Phase, Watchdog

logger = logging.getLogger(__name__)

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""What the agent sends when it stops the group (SIGTERM; SIGINT from a terminal)."""

STUCK_PHASES = frozenset({Phase.STEP, Phase.COLLECTIVE})
"""Phases in which the training thread waits on its peers; the others (data, eval, a save) end on their own
or under a watchdog limit of their own."""


class GroupWatch:
    """Learns from the agent that the group is being stopped, and abandons a step that cannot finish.

    Args:
        watchdog: where the training thread marks its phases; a phase change counts as progress.
        grace: seconds the training thread may go without progress once the agent asked (called each time:
            the runtime scales it with the step time).
        abandon: called on this class's thread when the step is abandoned; ends the process.
        poll_s: how often the signal and the training thread's progress are checked.
    """

    def __init__(self, watchdog: Watchdog, grace: Callable[[], float], abandon: Callable[[str], None],
                 poll_s: float = 0.05) -> None:
        self._watchdog = watchdog
        self._grace = grace
        self._abandon = abandon
        self._poll_s = poll_s
        self._read_fd = self._write_fd = -1
        self._previous_fd: int | None = None
        self._halt = threading.Event()
        self.stopping = threading.Event()
        """Set once the agent asked this worker to stop."""
        self.why = ""
        """What told this worker, for the exit line."""
        self._thread = threading.Thread(target=self._run, name="elastic-ddp-group-watch", daemon=True)

    def start(self) -> GroupWatch:
        """Start watching (the signal wake-up needs the main thread: elsewhere this watches nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def told(self, timeout: float) -> bool:
        """Whether the agent asks this worker to stop within ``timeout`` seconds (at once if it already has)."""
        return self.stopping.wait(timeout)

    def close(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._poll_s + 1)
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1

    def _run(self) -> None:
        while not self._halt.wait(self._poll_s):
            if not self.stopping.is_set():
                self._notice()
                continue
            stuck_s = time.monotonic() - self._watchdog.since  # since the last progress, before the word too
            if self._watchdog.phase in STUCK_PHASES and stuck_s > self._grace():
                logger.warning("the agent stops the group (%s) and this rank made no progress in phase %r for %.1f s: "
                               "a peer is gone; abandoning the step", self.why, self._watchdog.phase.value, stuck_s)
                self._abandon(f"{self.why}, while this rank waited {stuck_s:.1f} s in phase {self._watchdog.phase.value}")
                return

    def _notice(self) -> None:
        why = self._signal_received()
        if why:
            self.why = why
            self.stopping.set()

    def _signal_received(self) -> str:
        if self._read_fd < 0:
            return ""
        try:
            data = os.read(self._read_fd, 64)
        except BlockingIOError:
            return ""
        names = [signal.Signals(number).name for number in data if number in STOP_SIGNALS]
        return f"the agent sent {names[0]}" if names else ""
