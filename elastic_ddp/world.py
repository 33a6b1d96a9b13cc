"""One membership of the job: the parts that live as long as one set of ranks (docs/design.md, "The runtime").

A :class:`World` is built when a membership starts (the process group is formed) and closed at its end.
It holds what depends on who the ranks are: this rank and the world size, the runtime's two CPU groups,
the stop agreement, the checkpoint manager and its background saver, node-memory replicas and the sample
ledger. What outlives a membership (signals, spot notices, the watchdog, the group watch, events, the exit
path) stays in :class:`elastic_ddp.runtime.Runtime`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.checkpoint.replica import Replicas, default_root
from elastic_ddp.config import CheckpointConfig, ResilienceConfig, storage_options
from elastic_ddp.data import ElasticSampler
from elastic_ddp.distributed import LaunchEnv, cpu_group
from elastic_ddp.errors import CheckpointError
from elastic_ddp.events import Event, EventLog, SampleLedger
from elastic_ddp.logs import main_only
from elastic_ddp.prefork import agent_identity
from elastic_ddp.resilience.agreement import StopAgreement
from elastic_ddp.resilience.rescue import LiveState, ruled_out, why_not_kept
from elastic_ddp.resilience.stop import StopRequests
from elastic_ddp.resilience.watchdog import Phase, Watchdog
from elastic_ddp.state import TrainState, derive_rng_seed, key_rng_streams, seed_rng_streams

logger = logging.getLogger(__name__)


def membership() -> tuple[int, int]:
    """This process's rank and the world size of the process group now formed; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class World:
    """The parts of one membership, built in one place (here) and closed by :meth:`close` at its end.

    A part that fails to start closes those started before it. ``watchdog`` and ``stop`` belong to the
    process: the world marks phases on the one and agrees on the other, and closes neither.
    """

    def __init__(
        self,
        *,
        checkpoint: CheckpointConfig,
        resilience: ResilienceConfig,
        collective_timeout_s: float,
        events: EventLog,
        watchdog: Watchdog,
        stop: StopRequests,
        sample_ledger: bool,
        node_rank: int | None = None,
    ) -> None:
        self.rank, self.world_size = membership()
        self.env = LaunchEnv.from_env()
        if node_rank is not None:  # a joiner's node, numbered by the in-process mode's handler
            self.env = replace(self.env, group_rank=node_rank)
        self.checkpoint = checkpoint
        self.events = events
        self.watchdog = watchdog
        self.log0 = main_only(logger, self.rank)
        self.background: AsyncCheckpointer | None = None
        self.replicas: Replicas | None = None
        self.ledger: SampleLedger | None = None
        """Rank 0's writer of the sample ledger, when it is asked for."""
        self.keyed: ElasticSampler | None = None
        """The sampler whose plans key the RNG streams to this membership's rank (from the restore on)."""
        self.checkpoints: CheckpointManager | None = None
        self.last_commit_step: int | None = None
        self.last_commit_time = time.monotonic()
        self.control_group = cpu_group(self.world_size, collective_timeout_s, own=True)
        """Checkpoint coordination: a background save's commit (its own thread) never interleaves with the
        step's collectives, and object collectives work whatever the training backend is."""
        self.agreement_group = cpu_group(self.world_size, collective_timeout_s, own=False)
        """The stop agreement, replicas and the consistency check (training thread only), on the CPU."""
        self.agreement = StopAgreement(
            world_size=self.world_size, requests=stop, group=self.agreement_group,
            interval_s=resilience.agreement_interval_s, watchdog=watchdog, events=events,
        )
        try:
            self.checkpoints = self._make_checkpoint_manager()
            if self.checkpoints is not None and checkpoint.async_save:
                self.background = AsyncCheckpointer(self.checkpoints)
            self.replicas = self._make_replicas(self.checkpoints)
            if sample_ledger and self.rank == 0:
                self.ledger = SampleLedger(events.log_dir)
        except BaseException:
            self.close()
            raise

    def _make_checkpoint_manager(self) -> CheckpointManager | None:
        if not self.checkpoint.dir:
            return None
        return CheckpointManager(
            self.checkpoint.dir, rank=self.rank, world_size=self.world_size, run_id=self.env.run_id,
            generation=self.env.restart_count, keep=self.checkpoint.keep, storage_options=storage_options(self.checkpoint),
            group=self.control_group, probe=True, events=self.events,
        )

    def _make_replicas(self, checkpoints: CheckpointManager | None) -> Replicas | None:
        checkpoint, env = self.checkpoint, self.env
        if checkpoints is None or not checkpoint.replica_every:
            return None
        return Replicas(
            checkpoint.replica_dir or default_root(), run_id=env.run_id, checkpoint_uri=checkpoint.dir, rank=self.rank,
            world_size=self.world_size, local_rank=env.local_rank, node_rank=env.group_rank,
            token=checkpoints.token, every=checkpoint.replica_every, budget=checkpoint.replica_budget,
            generation=env.restart_count, agent=agent_identity(), group=self.agreement_group, events=self.events,
        )

    def close(self) -> None:
        """Finish the save in flight (under the watchdog's checkpoint limit) and stop this membership's parts."""
        self.watchdog.enter(Phase.CHECKPOINT)  # a save still in flight is waited for under that phase's limit
        try:
            if self.background is not None:
                self.background.close()
            if self.replicas is not None:
                self.replicas.close()
            if self.checkpoints is not None:
                self.checkpoints.wait_for_retention()
        finally:
            if self.keyed is not None:
                self.keyed.on_plan = None
            if self.ledger is not None:
                self.ledger.close()
            self.background = self.replicas = self.checkpoints = self.ledger = None

    # -- resume --------------------------------------------------------------------

    def restore(self, state: TrainState) -> int:
        """Load the newest valid replica or checkpoint into ``state``, or seed fresh RNG streams; the step. The
        sampler takes this membership's rank and world size first (the group is what decides them)."""
        state.sampler.join(self.rank, self.world_size)
        restored = None
        if self.checkpoints is not None and self.checkpoint.resume:
            restored = self.checkpoints.restore(state, allow_fresh_start=self.checkpoint.allow_fresh_start,
                                                replicas=self.replicas)
        else:
            if self.checkpoints is not None:
                self.checkpoints.refuse_if_committed()
            self.events.emit(Event.STARTED_FRESH, world_size=self.world_size,
                             reason="no-checkpoint-dir" if self.checkpoints is None else "resume-disabled")
        if restored is None:
            seed_rng_streams(derive_rng_seed(state.seed, 0, self.rank))
            self.log0.info("starting fresh at step 0 (world size %d)", self.world_size)
        else:
            position = state.sampler.position
            self.log0.info(
                "resumed from %s%s: step %d, epoch %d, cursor %d (saved at world size %d, now %d%s)",
                "the replica in " if restored.source == "replica" else "", restored.path, restored.step, position.epoch,
                position.cursor, restored.world_size, self.world_size,
                "" if restored.rank_state_reused else "; RNG streams re-derived",
            )
        step = state.counters.step
        self.last_commit_step = step
        self.last_commit_time = time.monotonic()
        self._key_by_step(state)
        self._say_if_rescue_ruled_out(state)
        return step

    def go_on(self, state: TrainState, saved_world_size: int) -> None:
        """Take over ``state``, the live state of the last step of the membership before (world size
        ``saved_world_size``), as this membership's starting point: nothing is loaded."""
        state.sampler.join(self.rank, self.world_size)
        step = state.counters.step
        self.events.emit(Event.RESUMED, step=step, path="", saved_world_size=saved_world_size,
                         world_size=self.world_size, rank_state_reused=False, source="live")
        self.log0.info("went on in a new membership from the live state of step %d (world size %d, was %d)", step,
                       self.world_size, saved_world_size)
        self.last_commit_step = None
        self.last_commit_time = time.monotonic()
        self._key_by_step(state)

    def _key_by_step(self, state: TrainState) -> None:
        state.sampler.on_plan = lambda: key_rng_streams(state.seed, state.counters.step, self.rank)
        self.keyed = state.sampler

    def _say_if_rescue_ruled_out(self, state: TrainState) -> None:
        """Rank 0, before the first step: what rules out every rescue of this run, with the fix, rather than
        only when a peer is lost."""
        if self.replicas is None or self.rank != 0:
            return
        never = ruled_out(sharded_optimizer=state.sharded_optimizer, rank_objects=bool(state.rank_extra))
        if never is not None:
            logger.warning("rank 0: a survivor of a peer's loss cannot keep its state for the restart in this run: %s; "
                           "%s", never.reason, never.fix)
            self.events.emit(Event.RESCUE_RULED_OUT, reason=never.reason, fix=never.fix)

    # -- a lost peer -----------------------------------------------------------------

    def rescue(self, state: TrainState, live: LiveState) -> None:
        """Keep this rank's live state in node memory for the restart, when it is a complete state of its step
        (:mod:`elastic_ddp.resilience.rescue`); never raises (what ended the step is the error)."""
        if self.replicas is None:
            return
        step = state.counters.step
        reason = why_not_kept(live)
        if reason is not None:
            logger.warning("rank %d: the state of step %d is not kept for the restart: %s", self.rank, step, reason)
            return
        self.watchdog.enter(Phase.EMERGENCY_SAVE)
        started = time.perf_counter()
        try:
            path = self.replicas.rescue(state)
        except (OSError, RuntimeError, ValueError) as exc:
            logger.warning("rank %d: keeping the state of step %d for the restart failed: %s", self.rank, step, exc)
            return
        if path is not None:
            logger.info("rank %d: kept the state of step %d in %s for the restart (%.3f s)", self.rank, step, path,
                        time.perf_counter() - started)

    # -- the step boundary -----------------------------------------------------------

    def save_due_by_time(self) -> bool:
        every_s = self.checkpoint.every_seconds
        return bool(every_s) and self.checkpoints is not None and time.monotonic() - self.last_commit_time >= every_s

    def background_failed(self) -> bool:
        return self.background is not None and self.background.failed()

    def record_samples(self, state: TrainState, step: int) -> None:
        """Rank 0: the step's line in the sample ledger, from the sampler's newest commit."""
        sampler = state.sampler
        plan = sampler.last_commit
        if self.ledger is None or plan is None:
            return
        ids = torch.sort(sampler.global_ids(plan)).values.tolist()
        self.ledger.record(step, plan.epoch, plan.start, plan.stop, self.world_size, ids)

    def raise_agreed_save_failure(self) -> None:
        """Every rank, at the same step: raise the failed background save's error (waiting for this rank's
        own outcome if it is still in flight)."""
        assert self.background is not None
        self.watchdog.enter(Phase.CHECKPOINT)
        self.background.wait()  # raises the failure, which every rank's committer learned
        raise CheckpointError(f"rank {self.rank}: a background checkpoint save failed on another rank")

    def save_if_due(self, state: TrainState, save_due: bool) -> None:
        """Commit the checkpoint (every ``checkpoint.every`` steps, or agreed due by time) and the replica due now."""
        step = state.counters.step
        every = self.checkpoint.every
        if self.checkpoints is not None and (save_due or (every and step % every == 0)):
            self.save(state)
        if self.replicas is not None and self.replicas.due(step):
            self.watchdog.enter(Phase.COLLECTIVE)
            self.replicas.save(state)
        self.watchdog.enter(Phase.STEP)

    def save(self, state: TrainState, blocking: bool = False) -> None:
        """Commit a checkpoint of the current step: staged now and committed in the background unless ``blocking``."""
        if self.checkpoints is None or self.last_commit_step == state.counters.step:
            return
        self.watchdog.enter(Phase.CHECKPOINT)
        step = state.counters.step
        if self.background is not None and not blocking:
            blocked = self.background.save(state)
            self.log0.info("checkpoint of step %d captured in %.3f s; parameters and optimizer state are copied during "
                           "the next step, then committed in the background", step, blocked)
        else:
            started = time.perf_counter()
            if self.background is not None:
                self.background.wait()
            self.checkpoints.save(state)
            self.log0.info("checkpoint of step %d committed in %.2f s", step, time.perf_counter() - started)
        self.last_commit_step = step
        self.last_commit_time = time.monotonic()

    # -- the end -----------------------------------------------------------------------

    def save_emergency(self, state: TrainState) -> None:
        """After an agreed stop: commit the current step within the save deadline."""
        if self.checkpoints is None:
            return
        step = state.counters.step
        self.watchdog.enter(Phase.EMERGENCY_SAVE)
        started = time.perf_counter()
        if self.background is not None:
            self.background.wait()
        if self.last_commit_step != step:
            self.checkpoints.save(state)
            self.last_commit_step = step
        self.log0.info("emergency checkpoint of step %d committed in %.2f s", step, time.perf_counter() - started)

    def save_final(self, state: TrainState) -> None:
        """At the run's end: the final checkpoint (``checkpoint.save_final``); then nothing resumes from node memory."""
        if self.checkpoints is None:
            return
        self.watchdog.enter(Phase.CHECKPOINT)
        if self.background is not None:
            self.background.wait()
        if self.checkpoint.save_final:
            self.save(state, blocking=True)
            if self.replicas is not None:
                self.replicas.discard()  # the final state is committed: nothing will resume from node memory
