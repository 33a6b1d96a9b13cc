"""Elastic components for a training loop you keep: the library path (docs/design.md, "Bring your own model").

Three pieces turn a hand-written DDP loop into an elastic one (``examples/byo_loop/train.py``
shows them in the seed pipeline's own loop):

* :class:`~elastic_ddp.data.ElasticSampler` — the global cursor. Use it as the DataLoader's
  ``batch_sampler``; each step ``plan()`` says which samples form it (the same at any world
  size), ``local_micro_batches(plan)`` which of them are this rank's, ``loss_scale(plan)`` how
  to weight this rank's *summed* per-sample loss so DDP's gradient is the global-batch mean,
  and ``commit(plan)`` records the step.
* :class:`Checkpointer` — atomic checkpoints of your model, optimizer, scheduler, scaler, the
  sampler and any other ``Stateful`` objects, to local disk or S3: saved in the background,
  committed by a manifest written last, verified on restore with fallback to the previous one,
  resumed at any world size. The same machinery the trainer uses.
* :class:`StepGuard` — asked once per step: SIGTERM/SIGINT and spot notices become a stop that
  every rank agrees on at the same step, and a step that makes no progress for the hang
  timeout ends the worker (stacks dumped) so torchrun restarts the group.

Run the script under ``torchrun`` (any rendezvous backend, ``etcd-v3`` included) and exit with
:func:`exit_status` so the elastic agent tells a preemption from a failure. Give both pieces the
same :func:`open_events` log to have the run's events (resumed, committed, stop agreed, exit...)
in ``<log_dir>/events.jsonl``, as the trainer writes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.data import ElasticSampler
from elastic_ddp.distributed import LaunchEnv, cpu_group
from elastic_ddp.events import EventLog
from elastic_ddp.resilience.agreement import Decision, StopAgreement
from elastic_ddp.resilience.exits import leave_job, log_exit
from elastic_ddp.resilience.stop import SpotNoticePoller, StopRequests
from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog
from elastic_ddp.state import Stateful, TrainState, model_digest

__all__ = ["Checkpointer", "Decision", "ElasticSampler", "EventLog", "StepGuard", "exit_status", "model_digest", "open_events"]

logger = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def open_events(log_dir: str) -> EventLog:
    """This rank's writer of ``<log_dir>/events.jsonl`` (after the process group is formed; "" writes nothing).
    Pass it to :class:`Checkpointer` and :class:`StepGuard`; close it at the end."""
    rank, _ = _world()
    return EventLog(log_dir, run_id=LaunchEnv.from_env().run_id, rank=rank)


class Checkpointer:
    """Atomic, verified, asynchronous checkpoints of a hand-written loop's state.

    Call it on every rank, after the process group is formed. ``restore()`` once before the loop
    returns the step to continue from; ``save(step)`` at a step boundary (every rank, the same
    step); ``close()`` at the end. Rank 0 writes the replicated state (model, optimizer,
    scheduler, scaler, ``state``); every rank writes its own RNG streams; the sampler's position
    and data digest go into the manifest, which commits the checkpoint.
    """

    def __init__(
        self,
        uri: str,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        state: Mapping[str, Stateful] | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        seed: int = 0,
        keep: int = 3,
        async_save: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
        events: EventLog | None = None,
    ) -> None:
        """``model``: the module itself, not its DDP wrapper. ``fingerprint``: values a checkpoint must
        match to be resumed (model shape, data settings...): a mismatch is refused naming the key.
        ``seed``: RNG streams are derived from it when a resume changes the world size. ``events``: where
        resumed, committed, save_failed... go (:func:`open_events`)."""
        rank, world_size = _world()
        env = LaunchEnv.from_env()
        self.state = TrainState(
            model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler, scaler=scaler,
            extra=state, fingerprint=dict(fingerprint or {}), seed=seed,
        )
        self.manager = CheckpointManager(
            uri, rank=rank, world_size=world_size, run_id=env.run_id, generation=env.restart_count, keep=keep,
            storage_options=dict(storage_options or {}), group=cpu_group(world_size, timeout_s, own=True), probe=True,
            events=events,
        )
        self.background = AsyncCheckpointer(self.manager) if async_save else None
        self.last_saved_step: int | None = None

    def restore(self, allow_fresh_start: bool = False) -> int:
        """Load the newest checkpoint that verifies into every object; the step to continue from (0: none).

        Raises :class:`~elastic_ddp.errors.NoValidCheckpointError` when checkpoints exist but none
        verifies (unless ``allow_fresh_start``), and :class:`~elastic_ddp.errors.IncompatibleCheckpointError`
        when the fingerprint or the model's parameters differ.
        """
        restored = self.manager.restore(self.state, allow_fresh_start=allow_fresh_start)
        if restored is None:
            return 0
        self.last_saved_step = restored.step
        position = self.state.sampler.position
        if self.manager.rank == 0:
            logger.info("resumed from %s: step %d, epoch %d, cursor %d (saved at world size %d, now %d)", restored.path,
                        restored.step, position.epoch, position.cursor, restored.world_size, self.manager.world_size)
        return restored.step

    def save(self, step: int, blocking: bool = False) -> None:
        """Checkpoint the state after ``step`` optimizer steps. In the background unless ``blocking``
        (or ``async_save=False``): the call copies the state and returns; parameters and optimizer state
        are copied during the next forward/backward, and the next ``optimizer.step()`` waits for that copy.
        A failed background save raises at the next ``save()`` or ``wait()``, on every rank alike.
        Saving the step saved last again only waits for that save (a step is committed once)."""
        if step == self.last_saved_step:
            if blocking:
                self.wait()
            return
        self.state.counters.step = step
        self.last_saved_step = step
        if self.background is not None and not blocking:
            self.background.save(self.state)
            return
        if self.background is not None:
            self.background.wait()
        self.manager.save(self.state)

    def wait(self) -> None:
        """Return once the save in flight is committed (raises if it failed)."""
        if self.background is not None:
            self.background.wait()

    def close(self) -> None:
        """Finish the save in flight and the retention behind it."""
        if self.background is not None:
            self.background.close()
        self.manager.wait_for_retention()


class StepGuard:
    """Stop requests, spot notices and hangs, decided at step boundaries on all ranks alike."""

    def __init__(
        self,
        *,
        hang_timeout_s: float = 300.0,
        agreement_interval_s: float = 0.25,
        spot_notice_url: str = "",
        spot_poll_interval_s: float = 5.0,
        handle_signals: bool = True,
        timeout_s: float = 600.0,
        events: EventLog | None = None,
    ) -> None:
        """``hang_timeout_s``: a step (or the wait for the agreement) that takes longer ends this worker
        with its stacks dumped; 0 disables. ``spot_notice_url``: 'aws', 'gcp' or an http(s) URL to poll.
        ``events``: where stop_requested, stop_agreed, watchdog_fired and the exit go (:func:`open_events`)."""
        _, world_size = _world()
        self.events = events or EventLog.off()
        self.requests = StopRequests()
        if handle_signals:
            self.requests.install_signal_handlers()
        self._handle_signals = handle_signals
        self.spot_poller = (
            SpotNoticePoller(spot_notice_url, spot_poll_interval_s, self.requests).start() if spot_notice_url else None
        )
        limit = PhaseLimit(hang_timeout_s, "hang")
        self.watchdog = Watchdog({Phase.STEP: limit, Phase.COLLECTIVE: limit}, events=self.events).start()
        self.agreement = StopAgreement(
            world_size=world_size, requests=self.requests, group=cpu_group(world_size, timeout_s, own=False),
            interval_s=agreement_interval_s, watchdog=self.watchdog, events=self.events,
        )
        self._step_started = time.perf_counter()
        self.watchdog.enter(Phase.STEP)

    def after_step(self, step: int, save_due: bool = False) -> Decision:
        """Call at the end of every step, on every rank, with the same step count. ``Decision.stop`` set:
        save and leave the loop now (every rank got the same decision at this step)."""
        now = time.perf_counter()
        self.events.set_step(step)
        decision = self.agreement.after_step(step, now - self._step_started, save_due)
        self._step_started = time.perf_counter()
        self.watchdog.enter(Phase.STEP)
        return decision

    @property
    def stop_source(self) -> str | None:
        """What asked this rank to stop (signal:SIGTERM, spot-notice), if anything did."""
        return self.requests.reason

    def close(self) -> None:
        self.agreement.settle()
        self.watchdog.close()
        if self.spot_poller is not None:
            self.spot_poller.close()
        if self._handle_signals:
            self.requests.restore_signal_handlers()


def exit_status(decision: Decision | None, guard: StepGuard | None = None) -> int:
    """The process exit status for torchrun's agent after the loop ends (0 when it ran to the end).

    A stop the guard agreed on exits so that the agent re-forms the job without a node that is
    leaving (preempted) and keeps the others (peer-lost), as the trainer's exits do.
    """
    reason = decision.stop if decision is not None and decision.stop else "done"
    source = guard.stop_source if guard is not None else None
    code = log_exit(reason, source or "", guard.events if guard is not None else None)
    leave_job(source)
    return code

