"""The runtime around a training step: one object, built in one place, behind both doors.

:class:`Runtime` owns everything a worker needs besides the step itself, in two rooms by lifetime. What
lives as long as the process, :class:`ProcessGuards`: stop requests (signals, spot notices), the hang
watchdog and the group watch; the runtime itself keeps the events, the rescue and the one exit path.
What lives as long as one membership, :class:`elastic_ddp.world.World`: rank and world size, the CPU
groups, the stop agreement, checkpoints (manager and background saver), node-memory replicas and the
sample ledger. :class:`Lifecycle` names where the runtime is. The trainer
(:class:`elastic_ddp.trainer.Trainer`) is a step engine on top of it; a hand-written loop uses it directly
(the library path, ``examples/byo_loop/train.py``)::

    with Runtime(state, checkpoint=CheckpointConfig(dir="/ckpt", every=20), events=events) as runtime:
        step = runtime.restore()
        while step < max_steps:
            ...                                   # forward, backward, optimizer.step()
            sampler.commit(plan)
            step += 1
            if runtime.after_step(step).stop:     # every rank stops at the same step
                break
    sys.exit(runtime.exit_status)

Leaving the ``with`` block commits the final checkpoint (or, after an agreed stop, the emergency one),
closes every part on every path, and sets :attr:`Runtime.exit_status` (docs/design.md, "Failure
semantics"). An error that ends the loop is one log line and its status, not a traceback, when the
runtime knows it: its own errors (1; a refused configuration 2), a lost peer (75). The rescue is
attempted whatever ended the step: it keeps only a complete state of one step, so it is safe for any
cause.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, cast

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_ddp.config import CheckpointConfig, ResilienceConfig
from elastic_ddp.data import ElasticSampler
from elastic_ddp.distributed import (
    LaunchEnv,
    Reformed,
    abandon_group,
    form_membership_group,
    shares_agent_store,
    step_spread,
)
from elastic_ddp.errors import ConfigError, ElasticDDPError, UsageError
from elastic_ddp.events import Event, EventLog
from elastic_ddp.logs import main_only
from elastic_ddp.membership import describe
from elastic_ddp.resilience.agreement import Decision, StopAgreement
from elastic_ddp.resilience.consistency import DivergenceError
from elastic_ddp.resilience.exits import ExitReason, leave_job, log_exit, peer_loss, tell_the_agent, write_error_file
from elastic_ddp.resilience.group import GroupWatch
from elastic_ddp.resilience.rescue import LiveState, StepPhase, has_persistent_buffers, why_not_kept
from elastic_ddp.resilience.stop import SpotNoticePoller, StopRequests
from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog
from elastic_ddp.state import Stateful, TrainState, model_digest
from elastic_ddp.world import World, membership

if TYPE_CHECKING:
    from elastic_ddp.inprocess import LaunchedMembership

logger = logging.getLogger(__name__)
P = ParamSpec("P")

ABANDON_GRACE_S = 1.0
"""The least time a step may go without progress once the agent stops the group, before it is abandoned
(:mod:`elastic_ddp.resilience.group`); the runtime allows three typical steps when that is more."""

TOLD_WAIT_S = 2.0
"""How long a rank whose collective raised waits for its agent's word that the group is being stopped
(then it exits ``peer-lost``; without the word, ``error``)."""


def failure_reason(exc: BaseException) -> ExitReason | None:
    """The exit reason of an error the runtime reports in one line; None: not the runtime's (a traceback)."""
    if isinstance(exc, DivergenceError):
        return ExitReason.DIVERGENCE
    if isinstance(exc, ConfigError):
        return ExitReason.CONFIG
    if isinstance(exc, ElasticDDPError):
        return ExitReason.ERROR
    return None


ABANDON_GROUP_S = 1.0
"""How long the group watch's abandon waits for torch to let go of the broken group before the process ends."""


def exit_in_one_line(reason: ExitReason, detail: str, events: EventLog) -> int:
    """Report an error the runtime knows: one log line, torchrun's error file, the exit line and event; the status."""
    logger.error("%s", detail)
    tell_the_agent(reason, detail)
    if reason is ExitReason.PEER_LOST:
        return log_exit(reason, detail, events)
    return log_exit(reason, events=events, error=detail)


def exit_unhandled(events: EventLog, exc: BaseException) -> None:
    """The ``exit`` event of an exception the runtime does not handle: it propagates (``@record`` writes the error
    file, Python exits 1), and this process's last event still says why it ended."""
    events.emit(Event.EXIT, reason=ExitReason.ERROR.value, status=ExitReason.ERROR.status, detail="",
                error=f"{type(exc).__name__}: {exc}")


def entrypoint(main: Callable[P, int | None]) -> Callable[P, int]:
    """Decorate a library-path script's ``main``: an error of the runtime's own that escapes it (a refused
    configuration: 2; others: 1) ends in one log line and its status instead of a traceback. Any other error
    is recorded in torchrun's error file and raised, as torch's ``@record`` does."""

    def run_main(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except ElasticDDPError as exc:
            reason = failure_reason(exc) or ExitReason.ERROR
            logger.error("%s", exc)
            tell_the_agent(reason, str(exc))
            return reason.status

    recorded = cast(Callable[P, int], record(run_main))  # record returns what run_main returns
    return functools.wraps(main)(recorded)


def announce_process_group(events: EventLog, world_size: int, backend: str, env: LaunchEnv) -> None:
    """The ``process_group_formed`` event of this attempt (the trainer path writes it as soon as the group formed,
    before the script builds its model; the library path when its runtime starts)."""
    events.emit(Event.PROCESS_GROUP_FORMED, world_size=world_size, backend=backend,
                store=f"{env.master_addr}:{env.master_port}", agent_store=shares_agent_store(),
                restart_count=env.restart_count)


class Lifecycle(enum.Enum):
    """Where a :class:`Runtime` is in its life; each state admits the calls its docstring names."""

    BUILT = "built"
    """Constructed and checked; nothing started (enter it with ``with``)."""
    OPEN = "open"
    """Entered: the process's guards run and this membership's :class:`~elastic_ddp.world.World` is formed;
    ``restore()`` next."""
    TRAINING = "training"
    """Restored or started fresh: steps are agreed and checkpoints committed."""
    FINISHED = "finished"
    """The last checkpoint is committed (:meth:`Runtime.finish`)."""
    CLOSED = "closed"
    """Every part is stopped; the exit status is set when the ``with`` block ended."""


JOINING = -1
"""The step a joining worker brings to a re-formation's step check (:meth:`Runtime.join`): none."""


class ProcessGuards:
    """What lives as long as the process: stop requests (signal handlers), the spot notice poller, the hang
    watchdog and the group watch. Built in one place (here), started at once, closed by :meth:`close`."""

    def __init__(self, resilience: ResilienceConfig, events: EventLog, rank_log_file: str,
                 grace: Callable[[], float], abandon: Callable[[str], None]) -> None:
        self.stop = StopRequests()
        if resilience.handle_signals:
            self.stop.install_signal_handlers()
        self.spot_poller: SpotNoticePoller | None = None
        self.group_watch: GroupWatch | None = None
        self.watchdog = _make_watchdog(resilience, events, rank_log_file)
        try:
            if resilience.spot_notice_url:
                self.spot_poller = SpotNoticePoller(resilience.spot_notice_url, resilience.spot_poll_interval_s,
                                                    self.stop).start()
            self.watchdog.start()
            if resilience.handle_signals:
                self.group_watch = GroupWatch(self.watchdog, grace, abandon).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for part in (self.group_watch, self.watchdog, self.spot_poller):
            if part is not None:
                part.close()
        self.stop.restore_signal_handlers()


def _make_watchdog(resilience: ResilienceConfig, events: EventLog, log_file: str) -> Watchdog:
    step = PhaseLimit(resilience.watchdog_timeout_s, ExitReason.HANG)
    return Watchdog(
        {
            Phase.DATA: step,
            Phase.STEP: step,
            Phase.COLLECTIVE: step,
            Phase.EVAL: step,
            Phase.CHECKPOINT: PhaseLimit(resilience.watchdog_checkpoint_timeout_s, ExitReason.HANG),
            Phase.EMERGENCY_SAVE: PhaseLimit(resilience.save_deadline_s, ExitReason.SAVE_DEADLINE),
        },
        log_file=log_file,
        events=events,
    )


class Runtime:
    """Checkpoints, replicas, rescue, stop agreement, watchdog and exit status of one worker.

    The composition root: ``with`` builds the process's guards (:class:`ProcessGuards`) and then this
    membership's :class:`~elastic_ddp.world.World`, and closes the world before the guards on every path.
    :attr:`lifecycle` says where it is (:class:`Lifecycle`).

    Args:
        state: what is saved and restored (model, optimizer, sampler, ... :class:`~elastic_ddp.state.TrainState`).
        checkpoint: where and how often to checkpoint; no ``dir``: no checkpoints and no replicas.
        resilience: signals, spot notices, watchdog limits, the agreement interval.
        collective_timeout_s: the timeout of the runtime's own CPU process groups.
        events: where the run's events go (resumed, committed, stop agreed, exit, ...).
        rank_log_file: where the watchdog also writes the stacks of a hang.
        sample_ledger: rank 0 also appends each committed step's sample ids to ``samples.jsonl`` in the events'
            log directory (``--log-sample-ledger``; needs one).
    """

    def __init__(
        self,
        state: TrainState,
        *,
        checkpoint: CheckpointConfig | None = None,
        resilience: ResilienceConfig | None = None,
        collective_timeout_s: float = 600.0,
        events: EventLog | None = None,
        rank_log_file: str = "",
        sample_ledger: bool = False,
        membership: LaunchedMembership | None = None,
    ) -> None:
        self.state = state
        self.checkpoint = checkpoint or CheckpointConfig()
        self.resilience = resilience or ResilienceConfig()
        self.events = events or EventLog.off()
        problems = [f"{section}.{name}: {what}" for section, config in (("checkpoint", self.checkpoint),
                                                                      ("resilience", self.resilience))
                    for name, what in config.problems()]
        if sample_ledger and not self.events.log_dir:
            problems.append("log.sample_ledger: needs a log directory (--log-dir; the library path: open_events(log_dir))")
        if problems:
            raise ConfigError("; ".join(problems))
        self.sample_ledger = sample_ledger
        self.collective_timeout_s = collective_timeout_s
        self.rank_log_file = rank_log_file
        self.lifecycle = Lifecycle.BUILT
        self.guards: ProcessGuards | None = None
        """The process's parts, while the runtime is entered."""
        self.world: World | None = None
        """This membership's parts, while the runtime is entered."""
        self._news: Callable[[], int] | None = None
        """What a loop that follows a membership is told of it (:meth:`follow`)."""
        self.membership = membership
        """The worker membership of the etcd-v3 handler's in-process mode (:mod:`elastic_ddp.inprocess`), or None:
        then the runtime follows it, restores a joiner through :meth:`join`, and re-forms in this process
        (:meth:`change_membership`, :meth:`recover`)."""
        if membership is not None:
            self._news = membership.generations.news
        self.phase = StepPhase.BETWEEN
        """Where the training thread is in its step (a rescue needs a complete state; set by hooks)."""
        self.exit_status: int | None = None
        """The process exit status, once the ``with`` block is left."""
        self.stop_reason: ExitReason | None = None
        """Why the loop stopped early (an agreed stop), if it did."""
        self._leaves_alone = False
        """This rank was asked to stop and leaves a membership that goes on without it (:meth:`_leave_alone`)."""
        self._hooks: list[Any] = []
        self._done_reported = False
        self._group_broken = False
        """A peer was lost mid-collective: :meth:`close` abandons the process group (abort where torch has it)."""
        self._boundary: tuple[int, int] = (0, 0)
        """(step, samples the sampler committed) at the last step boundary: a step that consumed nothing is refused."""
        self._last_boundary = time.perf_counter()
        self._typical_step_s = 0.0
        self._announce = False
        """Write ``process_group_formed`` when starting (the library path; the trainer path's entry writes it)."""

    @classmethod
    def for_loop(
        cls,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        state: Mapping[str, Stateful] | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        seed: int = 0,
        checkpoint: CheckpointConfig | None = None,
        resilience: ResilienceConfig | None = None,
        collective_timeout_s: float = 600.0,
        events: EventLog | None = None,
        sample_ledger: bool = False,
        membership: LaunchedMembership | None = None,
    ) -> Runtime:
        """The runtime of a hand-written loop (the library path): call on every rank after the process group
        is formed, and enter it with ``with``. ``model``: the module itself, not its DDP wrapper.
        ``fingerprint``: values a checkpoint must match to be resumed (model shape, data settings...), JSON.
        ``seed``: every step's RNG streams are keyed by it, the step and the rank (at ``sampler.plan()``).
        ``state``: other ``Stateful`` objects saved with the model (rank 0's copy). ``sample_ledger``: rank 0
        appends each committed step's sample ids to ``samples.jsonl`` in ``events``' log directory (docs/design.md,
        "Data cursor"). ``membership``: under the etcd-v3 handler's in-process mode, the one
        :func:`~elastic_ddp.loop.init_process_group` joined (``context.membership``): the loop then re-forms in its
        process where ``after_step`` says ``reformed`` or :meth:`recover` takes a failed step's error."""
        train_state = TrainState(model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler, scaler=scaler,
                                 extra=state, fingerprint=dict(fingerprint or {}), seed=seed)
        runtime = cls(train_state, checkpoint=checkpoint, resilience=resilience, collective_timeout_s=collective_timeout_s,
                      events=events, sample_ledger=sample_ledger, membership=membership)
        runtime._announce = True
        return runtime

    # -- the parts, while entered ----------------------------------------------------

    def _open_world(self, call: str) -> World:
        if self.world is None:
            raise UsageError(f"runtime.{call}() outside the runtime: enter it first (with runtime: ...)")
        return self.world

    def _open_guards(self) -> ProcessGuards:
        if self.guards is None:
            raise UsageError("the runtime's parts are used outside the runtime: enter it first (with runtime: ...)")
        return self.guards

    @property
    def rank(self) -> int:
        return self._open_world("rank").rank

    @property
    def world_size(self) -> int:
        return self._open_world("world_size").world_size

    @property
    def agreement(self) -> StopAgreement:
        return self._open_world("agreement").agreement

    @property
    def agreement_group(self) -> dist.ProcessGroup | None:
        """The CPU group of the stop agreement, replicas and the consistency check (training thread only)."""
        return self._open_world("agreement_group").agreement_group

    @property
    def watchdog(self) -> Watchdog:
        return self._open_guards().watchdog

    @property
    def stop(self) -> StopRequests:
        return self._open_guards().stop

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Runtime:
        if self.lifecycle is not Lifecycle.BUILT:
            raise UsageError(f"the runtime is entered once (it is {self.lifecycle.value})")
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        if self._announce:
            _, world_size = membership()
            backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
            announce_process_group(self.events, world_size, backend, LaunchEnv.from_env())
        self.guards = ProcessGuards(self.resilience, self.events, self.rank_log_file, self._abandon_grace, self._abandon)
        self.world = self._form_world(self.guards)
        self._track_step_phase()
        self.lifecycle = Lifecycle.OPEN

    def _form_world(self, guards: ProcessGuards) -> World:
        world = World(checkpoint=self.checkpoint, resilience=self.resilience,
                      collective_timeout_s=self.collective_timeout_s, events=self.events,
                      watchdog=guards.watchdog, stop=guards.stop, sample_ledger=self.sample_ledger,
                      node_rank=self.membership.node_rank if self.membership is not None else None)
        world.agreement.news = self._news
        return world

    def _track_step_phase(self) -> None:
        """A training forward begins the step's forward phase, the optimizer's step its update phase; the
        step boundary (:meth:`agree`) ends the step. Hooks, so that a hand-written loop is tracked too."""

        def forward_begins(module: torch.nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled() and self.phase is StepPhase.BETWEEN:
                self.phase = StepPhase.FORWARD

        def update_begins(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.phase = StepPhase.UPDATE

        self._hooks = [self.state.model.register_forward_pre_hook(forward_begins),
                       self.state.optimizer.register_step_pre_hook(update_begins)]

    def _trained(self) -> bool:
        return self.lifecycle in (Lifecycle.TRAINING, Lifecycle.FINISHED)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        try:
            if exc is None:
                self.finish()
                if self.stop_reason is None and self._trained() and not self._done_reported:
                    self.report_done()
                stop = self._open_guards().stop
                self.exit_status = log_exit(self.stop_reason or ExitReason.DONE, stop.reason or "", self.events)
                if self.membership is not None and self.stop_reason is None and self._trained():
                    self.membership.generations.finish()  # the end of training, not a loss, to the rendezvous
                leave_job(stop.reason)
                return False
            if not isinstance(exc, Exception):
                return False
            return self._ended_by(exc)
        finally:
            self.close()

    def _ended_by(self, exc: Exception) -> bool:
        """Handle an error that left the ``with`` block: keep the live state when it is complete, log one line
        and set the exit status; False for an error that is not the runtime's (it propagates)."""
        guards = self._open_guards()
        guards.watchdog.enter(Phase.IDLE)
        reason = failure_reason(exc)
        if reason is ExitReason.DIVERGENCE:
            self._forget_node_memory()
        elif self._trained():
            self.rescue()
        detail = str(exc)
        if reason is None and isinstance(exc, RuntimeError):
            # gloo's text, when it says so, spares the wait for the agent's word (a fast path only: the rescue
            # above does not depend on it, and NCCL says nothing of the kind)
            fast = peer_loss(exc)
            watch = guards.group_watch
            if fast or (watch is not None and watch.told(TOLD_WAIT_S)):
                reason = ExitReason.PEER_LOST
                detail = fast or f"a collective failed and {watch.why if watch else ''}"
        if reason is None:
            exit_unhandled(self.events, exc)
            return False
        logger.debug("the error that ended the loop", exc_info=exc)
        self._group_broken = reason is ExitReason.PEER_LOST
        self.exit_status = exit_in_one_line(reason, detail, self.events)
        return True

    def close(self) -> None:
        """Close this membership's world, then the process's guards; safe on every path (also after a failed start)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            if self.world is not None:
                self.world.close()
        finally:
            if self.guards is not None:
                self.guards.close()
            self.world = self.guards = None
            self.lifecycle = Lifecycle.CLOSED
            if self._group_broken:  # last: the parts above may still speak on their own groups
                abandon_group()

    # -- resume ------------------------------------------------------------------

    def restore(self) -> int:
        """Resume from the newest valid replica or checkpoint, or start fresh; the step to continue from.

        Runs under the checkpoint phase's watchdog limit. Writes ``resumed`` or ``started_fresh``.

        Raises:
            NoValidCheckpointError: checkpoints exist but none verifies (and fresh starts are not allowed).
            IncompatibleCheckpointError: the fingerprint or the model's parameters differ.

        A worker that joined a running membership (``membership.joined``) restores through :meth:`join`.
        """
        if self.membership is not None and self.membership.joined:
            return self.join()
        world = self._open_world("restore")
        self.watchdog.enter(Phase.CHECKPOINT)
        step = world.restore(self.state)
        self.lifecycle = Lifecycle.TRAINING
        self._train_from(step)
        return step

    def _train_from(self, step: int) -> None:
        """The runtime's own marks once the state is that of ``step`` (restored, or kept in a new membership)."""
        self._boundary = (step, self.state.sampler.samples_seen)
        self.events.set_step(step)
        self.begin()

    def reform(self, store: dist.Store, *, rank: int, world_size: int, generation: int, backend: str,
               device: torch.device, timeout_s: float, joined: bool = False) -> Reformed:
        """Go on in a new membership in this process, after a peer's loss or a join (docs/design.md, "Failure
        semantics", In-process recovery): the broken group is given up and this membership's world closed, the
        next membership's group formed (:func:`elastic_ddp.distributed.form_membership_group`; every member calls this
        with the same ``generation`` and the ranks agreed beforehand) and its world built around it. The model,
        optimizer and device state are kept when they are a complete state of the last step (the rescue's rule);
        otherwise every member loads the newest replica or checkpoint. The sampler joins the new membership at
        its committed position. Wrap the model in a new ``DistributedDataParallel`` and make a new loader
        iterator afterwards; the step to go on from is ``state.counters.step``.

        ``joined``: the change is a worker joining (``Decision.membership``), whose :meth:`join` is the other
        side: the live state is first kept in node memory as a replica of this membership, and every member
        loads it so that the newcomer receives it over the group.

        Raises:
            DistributedInitError: the new group was not formed within ``timeout_s``.
        """
        world, guards = self._require_restored("reform"), self._open_guards()
        live = self._live_state()
        kept = why_not_kept(live)
        before = world.world_size
        if joined and kept is None:  # in the membership it belongs to, with that world size
            world.rescue(self.state, live)
        started = time.perf_counter()
        abandoned = abandon_group()  # first: a save in flight on the old groups then fails at once, not waits
        self.world = None
        world.close()
        abandon_s = time.perf_counter() - started
        self.events.rank = rank  # the records' rank is this membership's
        form_s = form_membership_group(store, rank=rank, world_size=world_size, generation=generation,
                                       backend=backend, device=device, timeout_s=timeout_s, abandoned=abandoned)
        announce_process_group(self.events, world_size, backend, LaunchEnv.from_env())  # in this process
        self.world = self._form_world(guards)
        self.phase = StepPhase.BETWEEN
        lowest, highest = step_spread(self.state.counters.step, self.world.agreement.group)
        if kept is None and lowest == highest:
            self.world.go_on(self.state, before)
        else:
            if kept is None and lowest == JOINING:  # a joiner gets this state through the replicas
                if not joined:  # it joined as a peer was lost
                    self.world.rescue(self.state, self._live_state())
                logger.info("rank %d: a worker joins at step %d: every member loads that step's state from node "
                            "memory, which the joiner receives", rank, highest)
            elif kept is None:  # one member's step ended, another's failed: no live state is common
                kept = f"the members ended the last membership on steps {lowest} to {highest}"
            if kept is not None:
                logger.warning("rank %d: the live state is not kept in the new membership (%s): loading the newest "
                               "replica or checkpoint", rank, kept)
            self.watchdog.enter(Phase.CHECKPOINT)
            self.world.restore(self.state)
        self._train_from(self.state.counters.step)
        return Reformed(abandoned=abandoned, abandon_s=abandon_s, form_s=form_s)

    def follow(self, news: Callable[[], int]) -> None:
        """Agree on membership changes at step boundaries: ``news`` answers the generation of a newer membership
        this worker was told of, 0 if none (:meth:`elastic_ddp.membership.Generations.news`); every rank's answer
        goes into the stop agreement, and :attr:`Decision.membership <elastic_ddp.resilience.agreement.Decision>`
        then names it on every rank at one step, where the loop calls :meth:`reform`. Without it a member would
        leave its group while a peer is still in a collective of it."""
        self._news = news
        if self.world is not None:
            self.world.agreement.news = news

    def change_membership(self, decision: Decision) -> bool:
        """In-process mode, at a step boundary: where ``decision`` names ranks that leave (``leaving``) or a
        newer membership a worker joins (``membership``), agree on the next membership and re-form in this
        process (:meth:`reform`). Whether it did: then wrap the model in a new ``DistributedDataParallel`` and
        make a new loader iterator (:meth:`after_step` calls it and says ``reformed``; the trainer calls it
        before its saves of the step)."""
        if self.membership is None or decision.stop or not (decision.leaving or decision.membership):
            return False
        if decision.leaving:
            self._next_membership(f"rank(s) {', '.join(map(str, decision.leaving))} left", leaving=decision.leaving)
        else:
            self._next_membership("a worker joined", joined=True)
        return True

    def recover(self, exc: BaseException) -> bool:
        """In-process mode, after a step failed with ``exc``: when it is a peer's loss (the backend's words say a
        connection closed or a remote process exited mid-collective, or, for an error whose words name no cause,
        the membership's control plane knows a member gone: :meth:`Generations.lost_member`), agree on the next
        membership with the other survivors and re-form in this process, from the live state when it is complete
        (:meth:`reform`). Whether it did: then wrap the model again and make a new loader iterator; otherwise
        re-raise ``exc``."""
        if self.membership is None or not isinstance(exc, RuntimeError):
            return False
        # the backend's words (gloo's closed connection, NCCL's remote error), else the control plane's
        why = peer_loss(exc) or self.membership.generations.lost_member()
        if why is None:
            return False
        self.state.optimizer.zero_grad(set_to_none=True)
        self._next_membership(f"a peer was lost ({why})")
        return True

    def _next_membership(self, why: str, *, joined: bool = False, leaving: tuple[int, ...] = ()) -> None:
        membership = self.membership
        assert membership is not None
        before = membership.generations.current
        agreed = membership.generations.next(why, leaving=leaving, planned=joined or bool(leaving))
        self.reform(membership.group_store(agreed), rank=agreed.rank, world_size=agreed.world_size,
                    generation=agreed.generation, backend=membership.backend, device=membership.device,
                    timeout_s=self.collective_timeout_s, joined=joined)
        logger.warning("rank %d: %s; went on in this process: %s", agreed.rank, why, describe(agreed, before))

    def join(self) -> int:
        """Restore as a worker that joins a running membership, instead of :meth:`restore`: the membership was
        agreed (:meth:`elastic_ddp.membership.Generations.join`) and this process's group formed
        (:func:`elastic_ddp.distributed.form_membership_group`) before the runtime was entered. The members
        are in :meth:`reform` meanwhile: they keep their live state in node memory, and every member, this one
        included, loads the newest replica, which reaches this worker over the group. The step to train from.

        Raises what :meth:`restore` raises."""
        world = self._open_world("join")
        self.watchdog.enter(Phase.CHECKPOINT)
        step_spread(JOINING, world.agreement.group)
        step = world.restore(self.state)
        self.lifecycle = Lifecycle.TRAINING
        self._train_from(step)
        return step

    def begin(self) -> None:
        """Mark the start of training (the trainer, after its loader forked its workers): the first step's time
        counts from here."""
        self._last_boundary = time.perf_counter()
        self.watchdog.enter(Phase.STEP)

    # -- the step boundary ---------------------------------------------------------

    def after_step(self, step: int) -> Decision:
        """Call at the end of every step, on every rank, with the number of steps done. Agrees on stops,
        commits the checkpoint or replica that is due; ``Decision.stop`` set: leave the loop now."""
        now = time.perf_counter()
        self.state.counters.step = step
        decision = self.agree(now - self._last_boundary)
        if not decision.stop and not decision.leaving:  # ranks that leave take part in no save
            self.save_if_due(decision.save_due)
        if self.change_membership(decision):
            decision = replace(decision, reformed=True)
        self._last_boundary = time.perf_counter()
        return decision

    def agree(self, step_time: float) -> Decision:
        """The decision every rank shares at this step boundary (the step counter already moved on).

        Raises:
            CheckpointError: a background save failed on some rank (every rank raises at this step).
        """
        world = self._require_restored("after_step")
        self.phase = StepPhase.BETWEEN
        step = self.state.counters.step
        if self._check_data_moved(step):
            world.record_samples(self.state, step)
        self.events.set_step(step)
        self._typical_step_s = step_time if not self._typical_step_s else 0.9 * self._typical_step_s + 0.1 * step_time
        decision = world.agreement.after_step(step, step_time, world.save_due_by_time(), world.background_failed())
        if decision.save_failed:
            world.raise_agreed_save_failure()
        if decision.stop and decision.staying and self._news is not None:
            decision = self._join_first(decision, world) if decision.membership else self._leave_alone(decision, world)
        if decision.stop:
            self.stop_reason = decision.stop
        return decision

    def _join_first(self, decision: Decision, world: World) -> Decision:
        """A worker joins at the step where some ranks are asked to leave: the join's generation may hold them
        (their watchers arrived at it), so every rank, those asked included, goes on in it first; the asked
        ranks' requests stand, and they leave at the next agreement, a step or so later."""
        logger.info("rank %d: a worker joins at step %d as rank(s) are asked to stop (%s): the join first, the "
                    "departure at the next agreement", world.rank, self.state.counters.step,
                    world.agreement.reason or "requested by a peer")
        return replace(decision, stop=None, staying=False)

    def _leave_alone(self, decision: Decision, world: World) -> Decision:
        """A loop that follows a membership, at a stop that some ranks were not asked for (their nodes were not
        preempted): the asked ranks leave alone, without the emergency save, as the members go on from this
        step's live state, and the others go on in the next membership without them (``Decision.leaving``,
        where the loop re-forms). One all-gather of who was asked, on every rank at this step."""
        asked = torch.tensor([int(world.agreement.requests.requested)], dtype=torch.int32)
        gathered = [torch.zeros(1, dtype=torch.int32) for _ in range(world.world_size)]
        dist.all_gather(gathered, asked, group=world.agreement.group)
        leaving = tuple(rank for rank, flag in enumerate(gathered) if int(flag.item()))
        if asked.item():
            self._leaves_alone = True
            logger.info("rank %d leaves the membership at step %d (%s); the other %d rank(s) go on without it",
                        world.rank, self.state.counters.step, world.agreement.reason,
                        world.world_size - len(leaving))
            return decision
        return replace(decision, stop=None, save_due=False, leaving=leaving)

    def _require_restored(self, call: str) -> World:
        world = self._open_world(call)
        if not self._trained():
            raise UsageError(f"runtime.{call}() before runtime.restore(): restore (or start fresh) first, then train")
        return world

    def _check_data_moved(self, step: int) -> bool:
        """Refuse a step that consumed no data: its checkpoint would record a position that a resume replays.
        True when steps were done since the last boundary."""
        last_step, last_samples = self._boundary
        samples = self.state.sampler.samples_seen
        if step > last_step and samples == last_samples:
            raise UsageError(f"step {step}: the sampler's position has not moved since step {last_step}: call "
                             "sampler.commit(plan) after each optimizer step, or a resume would replay data already "
                             "trained on")
        self._boundary = (step, samples)
        return step > last_step

    def save_if_due(self, save_due: bool = False) -> None:
        """Commit the checkpoint (every ``checkpoint.every`` steps, or agreed due by time) and the replica due now."""
        self._open_world("save_if_due").save_if_due(self.state, save_due)

    def save(self, blocking: bool = False) -> None:
        """Commit a checkpoint of the current step: staged now and committed in the background unless ``blocking``."""
        self._require_restored("save").save(self.state, blocking)

    # -- the end -------------------------------------------------------------------

    def finish(self) -> None:
        """Commit the last checkpoint: after an agreed stop within the save deadline, else the final one
        (``checkpoint.save_final``); then nothing resumes from node memory. Once; the ``with`` block's end calls it."""
        if self.lifecycle is not Lifecycle.TRAINING:  # nothing trained, or finished already: nothing to commit
            return
        world = self._open_world("finish")
        self.lifecycle = Lifecycle.FINISHED
        world.agreement.settle()
        if self.stop_reason is not None and self._leaves_alone:
            logger.warning("stop agreed at step %d (%s): this rank leaves the membership, which goes on with the "
                           "live state (no emergency save)", self.state.counters.step, self.stop.reason)
        elif self.stop_reason is not None:
            main_only(logger, world.rank).warning(
                "stop agreed at step %d (%s%s)", self.state.counters.step, self.stop_reason.value,
                f": {self.stop.reason}" if self.stop.reason else ": requested by a peer")
            world.save_emergency(self.state)
        else:
            world.save_final(self.state)
        self.watchdog.enter(Phase.IDLE)

    def report_done(self, loss: float | None = None, accuracy: float | None = None,
                    metrics: Mapping[str, float] | None = None) -> None:
        """Write the ``done`` event: the run reached its end, with the digests a verifier compares."""
        self._done_reported = True
        self.events.emit(Event.DONE, step=self.state.counters.step, epoch=self.state.sampler.position.epoch,
                         model_digest=model_digest(self.state.model.state_dict()), data_digest=self.state.sampler.data_digest,
                         loss=loss, accuracy=accuracy, metrics=dict(metrics or {}))

    # -- a lost peer ---------------------------------------------------------------

    def rescue(self) -> None:
        """Keep this rank's live state in node memory for the restart, when it is a complete state of its step
        (:mod:`elastic_ddp.resilience.rescue`); never raises (what ended the step is the error)."""
        if self.world is not None:
            self.world.rescue(self.state, self._live_state())

    def _forget_node_memory(self) -> None:
        """After a divergence: the live state and the replicas since the last consistency check that passed may
        hold the corrupted parameters (or gradients computed from them), so this node keeps none of them and the
        restart resumes from the newest committed checkpoint."""
        if self.world is not None and self.world.replicas is not None:
            self.world.replicas.discard()
            logger.warning("rank %d: parameters diverged; this node's replicas are dropped, the restart resumes from "
                           "the newest committed checkpoint", self.world.rank)

    def _live_state(self) -> LiveState:
        """What decides whether this rank's live state is a complete state of its step (the rescue's rule)."""
        device = next((p.device for p in self.state.model.parameters()), torch.device("cpu"))
        return LiveState(
            phase=self.phase,
            forward_changes_state=has_persistent_buffers(self.state.model) or bool(self.state.extra),
            sharded_optimizer=self.state.sharded_optimizer, rank_objects=bool(self.state.rank_extra),
            device_busy=device.type == "cuda" and not torch.cuda.current_stream(device).query(),
        )

    def _abandon_grace(self) -> float:
        return max(ABANDON_GRACE_S, 3 * self._typical_step_s)

    def _abandon(self, why: str) -> None:
        """The group watch's verdict: the step cannot finish. Rescue, then end the process as ``peer-lost``
        (on the watch's thread: the training thread waits in a collective that will not return)."""
        self.rescue()
        message = f"a peer is gone: {why}"
        write_error_file(ExitReason.PEER_LOST.value, message)
        log_exit(ExitReason.PEER_LOST, message, self.events)
        self.events.close()
        for handler in logging.getLogger().handlers:
            handler.flush()
        # after the exit line: end the group's communicators (abort where torch has it) rather than leave them
        # to the process's exit; bounded, since the training thread still waits in one of its collectives
        abandon_group(timeout_s=ABANDON_GROUP_S)
        os._exit(ExitReason.PEER_LOST.status)
