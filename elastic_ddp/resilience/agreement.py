"""The stop agreement: every rank stops at the same step boundary (docs/design.md, "Stop agreement").

A stop request (SIGTERM, a spot notice) reaches one rank, or some, at any moment. If each rank
acted on its own, one would leave the next gradient all-reduce while the others wait in it. So
the ranks agree: at the end of a step every rank contributes (was I asked to stop, is my save
clock due, has my background save failed, how many steps until the next agreement would I like)
to one tiny MAX all-reduce, and
all of them act on the result at the same step. The all-reduce is started at the end of one step
and read at the end of the next, so it overlaps that step's compute instead of adding a
synchronisation point; with steps shorter than the interval it runs every few steps, at steps
every rank derives from the agreed interval. A request is acted on within the interval plus two
steps, on every rank alike.

A hand-written loop asks once per step::

    agreement = StopAgreement(world_size=dist.get_world_size())   # installs SIGTERM/SIGINT handlers
    for step in ...:
        train_one_step()
        decision = agreement.after_step(step, step_time)
        if decision.stop:
            save_checkpoint(); break
    agreement.close()
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from elastic_ddp.events import Event, EventLog
from elastic_ddp.resilience.exits import ExitReason
from elastic_ddp.resilience.stop import StopRequests
from elastic_ddp.resilience.watchdog import Phase


def agreement_interval(step_time: float, min_interval_s: float, most: int = 1000) -> int:
    """Steps from one stop agreement to the next: 1, or as many as span ``min_interval_s`` at this step time."""
    if min_interval_s <= 0 or step_time <= 0:
        return 1
    return min(most, max(1, math.ceil(min_interval_s / step_time)))


@dataclass(frozen=True)
class Decision:
    """What every rank decided together at the end of a step."""

    stop: ExitReason | None = None
    """None: go on. PREEMPTED: this rank was asked to stop; PEER_LOST: another rank was."""
    save_due: bool = False
    """Some rank's time-based save clock ran out: every rank saves at this step."""
    save_failed: bool = False
    """Some rank's background save failed: every rank reports it and stops at this step."""
    membership: int = 0
    """The generation of a newer membership some rank was told of (a worker joined, see
    :mod:`elastic_ddp.membership`): every rank goes on in it from this step boundary. 0: none."""
    staying: bool = False
    """With a stop: some rank was not asked to stop (an in-process membership then lets the asked ones leave
    alone, :meth:`elastic_ddp.runtime.Runtime.agree`)."""
    leaving: tuple[int, ...] = ()
    """The ranks that leave the membership at this step while this one goes on in the next (in-process mode;
    set by the runtime, not the agreement): the runtime re-forms without them."""
    reformed: bool = False
    """The runtime re-formed in this process at this step (in-process mode, ``Runtime.after_step``): wrap the
    model in a new ``DistributedDataParallel`` and make a new loader iterator; ``runtime.rank`` and
    ``runtime.world_size`` are the new membership's."""


def decide(stop_any: bool, save_any: bool, asked_here: bool, failed_any: bool = False, membership: int = 0,
           staying: bool = False) -> Decision:
    """The decision from the agreed flags (pure)."""
    if not stop_any:
        return Decision(None, save_any, failed_any, membership)
    return Decision(ExitReason.PREEMPTED if asked_here else ExitReason.PEER_LOST, save_any, failed_any, membership,
                    staying)


class PhaseMarker(Protocol):
    def enter(self, phase: Phase) -> None: ...


class StopAgreement:
    """Agrees on stop requests and time-based saves across all ranks, once per step (or every few)."""

    def __init__(
        self,
        *,
        world_size: int,
        requests: StopRequests | None = None,
        group: dist.ProcessGroup | None = None,
        interval_s: float = 0.25,
        watchdog: PhaseMarker | None = None,
        events: EventLog | None = None,
    ) -> None:
        """``requests``: where stop requests arrive; None makes one that handles SIGTERM and SIGINT
        (restored by :meth:`close`). ``group``: a CPU (gloo) group, or None for the default group when
        that is gloo; with NCCL training pass a gloo group, so reading the flags never waits for the
        device. ``interval_s``: agree every few steps when steps are shorter than this (0: every step).
        ``events``: where ``stop_requested`` (this rank was asked) and ``stop_agreed`` go."""
        self.world_size = world_size
        self._owns_requests = requests is None
        self.requests = requests or StopRequests()
        if self._owns_requests:
            self.requests.install_signal_handlers()
        self.group = group
        self.interval_s = interval_s
        self.watchdog = watchdog
        self._pending: tuple[torch.Tensor, dist.Work] | None = None
        """The all-reduce started at the end of the previous agreeing step."""
        self._next = 0
        """The step at whose end the next agreement starts (the same on every rank)."""
        self.events = events or EventLog.off()
        self._reported: set[Event] = set()
        """The stop events already written (each once: a loop that goes on asking adds nothing)."""
        self.news: Callable[[], int] | None = None
        """The generation of a newer membership this rank was told of, 0 if none (the runtime sets it when a
        loop follows a membership); agreed like a stop, so every rank changes membership at one step."""

    @property
    def reason(self) -> str | None:
        """What asked this rank to stop (signal:SIGTERM, spot-notice), if anything did."""
        return self.requests.reason

    def after_step(self, step: int, step_time: float, save_due: bool = False, save_failed: bool = False) -> Decision:
        """Call at the end of every step on every rank, with the same ``step``; act on the decision at once.
        ``save_failed``: this rank's background save has failed (the decision then says so on every rank)."""
        decision = self._decide(step, step_time, save_due, save_failed)
        if self.requests.requested:  # read after the decision, so a request it carries is reported before it
            self._report_once(Event.STOP_REQUESTED, reason=self.requests.reason)
        if decision.stop is not None:
            self._report_once(Event.STOP_AGREED, step=step, reason=decision.stop, source=self.requests.reason or "peer")
        return decision

    def _report_once(self, kind: Event, **fields: object) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            self.events.emit(kind, **fields)

    def _decide(self, step: int, step_time: float, save_due: bool, save_failed: bool) -> Decision:
        news = self.news() if self.news is not None else 0
        if self.world_size == 1:
            return decide(self.requests.requested, save_due, self.requests.requested, save_failed, news)
        decision = Decision()
        pending, self._pending = self._pending, None
        if pending is not None:  # started one step ago on every rank, so read at the same step everywhere
            flags = self._wait_for(pending)
            decision = decide(bool(flags[0]), bool(flags[1]), self.requests.requested, bool(flags[2]), int(flags[4]),
                              bool(flags[5]))
            self._next = step - int(flags[3]) - 1
        if step >= self._next:
            steps = agreement_interval(step_time, self.interval_s)
            flags = torch.tensor([self.requests.requested, save_due, save_failed, -steps, news,
                                  not self.requests.requested], dtype=torch.int32)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._pending = (flags, work)
        return decision

    def settle(self) -> None:
        """Complete the all-reduce still in flight when the loop ends (every rank started it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._wait_for(pending)

    def close(self) -> None:
        """Settle, and restore the signal handlers this agreement installed."""
        self.settle()
        if self._owns_requests:
            self.requests.restore_signal_handlers()

    def _wait_for(self, pending: tuple[torch.Tensor, dist.Work]) -> torch.Tensor:
        flags, work = pending
        if self.watchdog is not None:
            self.watchdog.enter(Phase.COLLECTIVE)
        work.wait()
        if self.watchdog is not None:
            self.watchdog.enter(Phase.STEP)
        return flags
