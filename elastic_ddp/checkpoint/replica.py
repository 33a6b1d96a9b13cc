"""Replicas: the newest step's state kept in node memory, so a restart redoes no step (docs/design.md, "Replicas").

A committed checkpoint is the only state that survives a failure when training restarts: every
worker of the job is a new process after torchrun restarts the group, so a ``kill -9`` of one
worker cost every step since the last commit. Replicas close that gap.

**Saving.** Every ``every`` steps, on every rank at the same step, each rank encodes its own
state (the rank part of a checkpoint: RNG streams, a sharded optimizer's shard, per-rank
objects) and all ranks exchange it in one all-gather (a few kilobytes per rank under DDP).
Then the first worker of each node copies the replicated state (model, optimizer, ...) into
one of its two slots in the node's replica directory and, in a background thread, finishes a
complete checkpoint of that step there: the file's header, every rank's state, and a manifest
written last, in the layout of a stored checkpoint but with XXH3-128 digests. A slot's
replicated file is laid out once and mapped into memory, so the copy is the write: one pass
over the state, no staging buffer. The two slots are written in turn and a slot's manifest is
removed before its file is overwritten, so the newest replica is never the one being written.
The directory is node memory (``/dev/shm``) by default: it outlives the workers, not the node.
So every node holds the whole state of the step, and a step can be resumed while any node
that wrote it survives. A node whose previous write has not finished skips the step (training
never waits for a replica); it holds the previous one until the next due step.

**Restoring.** Every rank reports the replicas its node holds. Rank 0 takes the newest one
that is at least as new as the newest committed checkpoint in storage. Each rank reads its
pieces from its own node's copy when that holds the same save (same step and writer token);
otherwise a rank whose node holds it sends them over the process group. Every rank checks the
bytes against the manifest and decodes them before anything is loaded; only when every rank
succeeded does any rank load them, so a damaged or missing replica means the storage restore,
never a partial load. A world-size change loads only the replicated state and the data
position, exactly like a storage restore (RNG streams re-derived).

**Rescue.** When a peer dies mid-run, the survivors still hold the newest state in memory: under
DDP every rank's model and optimizer are the same. A survivor whose live state is a complete
state of its step (the trainer decides: no optimizer step half done, nothing a forward changes)
copies its replicated state into the node's ``rescue`` directory before it exits, one survivor
per node (a lock file), committed by a manifest with ``rank_state`` false: the lost ranks' own
state (RNG streams) is gone, so a resume from a rescue re-derives every rank's streams, as at a
world-size change. It costs training nothing, and the restart redoes at most the step that was
interrupted. Two nodes' copies count as one replica only if their bytes are the same.

Replicas are fenced by the launch's writer token, shared by all ranks: a node that missed a
restore cannot mix its files into another save's replica. Any replica chosen is a complete
state of one step of this run, with the data position it was saved with, so resuming from it
keeps the exactly-once data contract of a storage resume.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from elastic_ddp.checkpoint.files import FileRecord, lower_thread_priority, uninitialised, unlink_quietly
from elastic_ddp.checkpoint.format import ALIGN, Flat, Plan, encode_chunks, flatten, plan, signature
from elastic_ddp.checkpoint.manager import (
    CheckpointState,
    Restored,
    broadcast_from_main,
    deserialize,
    gather_to_main,
)
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME, Manifest, rank_file_name, replicated_file_name
from elastic_ddp.errors import CheckpointCorruptError, CheckpointError
from elastic_ddp.events import Event, EventLog

logger = logging.getLogger(__name__)

REPLICA_DIR_ENV = "ELASTIC_DDP_REPLICA_DIR"
"""The node's replica root when ``--checkpoint-replica-dir`` is not given."""
SLOTS = 2
"""Replica directories per node, written in turn: the newest replica is never the one being overwritten."""
HASH = "xxh3-128"
"""The replicas' file digest: they guard against torn and mixed-up writes in node memory, not against an
attacker (who could rewrite the manifest as well), and XXH3 runs at memory speed, several times SHA-256's."""
_HEAD = struct.Struct("<qq")
"""What each rank puts before its state in the all-gather: the state's length (negative: it did not fit)
and the interval it proposes."""
MAX_INTERVAL = 10_000
_SMOOTHING = 0.2
RESCUE_DIR = "rescue"
"""A node's directory for the state a survivor keeps after a peer's loss (:meth:`Replicas.rescue`)."""
_NODE_DIR = re.compile(r"^node-\d+$")
_HELD_DIR = re.compile(rf"^(slot-\d|{RESCUE_DIR})$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_root() -> str:
    """``$ELASTIC_DDP_REPLICA_DIR``, else a per-user directory in node memory (``/dev/shm``)."""
    configured = os.environ.get(REPLICA_DIR_ENV, "")
    if configured:
        return configured
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"elastic_ddp-replicas-{os.getuid()}")


@dataclass
class ReplicaStats:
    """What this rank's replicas cost (benchmarks/replica.py reads them)."""

    saves: int = 0
    """Due replicas this rank took part in."""
    written: int = 0
    """Replicas this rank's node wrote (its first worker only)."""
    skipped: int = 0
    """Due replicas the node did not write because its previous write was still running."""
    blocking_s: float = 0.0
    """Seconds the training thread spent in :meth:`Replicas.save`."""
    blocking_cpu_s: float = 0.0
    """CPU seconds of the training thread in :meth:`Replicas.save` (waiting for peers not counted)."""
    write_s: float = 0.0
    """Seconds of background writing."""
    write_cpu_s: float = 0.0
    """CPU seconds of the background writing."""


class _Slot:
    """One of a node's replica directories. Its replicated file is laid out once for the state's tensors and
    mapped into the writer's memory, so a replica is one copy of the state into node memory plus a digest:
    no staging buffer, no file written from scratch. The file is reserved in full when laid out
    (``posix_fallocate``), so a full node-memory file system fails that call instead of a later copy."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.step: int | None = None
        """The step its manifest commits; None while it has none."""
        self._plan: Plan | None = None
        self._token = ""
        self._header_bytes = 0
        self._mapped: torch.Tensor | None = None
        self._targets: list[torch.Tensor] = []

    def uncommit(self) -> None:
        """Remove the manifest first: from here on a crash leaves a slot without one, never a torn replica."""
        self.step = None
        try:
            os.unlink(os.path.join(self.path, MANIFEST_NAME))
        except FileNotFoundError:
            pass

    def prepare(self, flat: Flat, token: str) -> None:
        """Lay the file out for ``flat``'s tensors, unless it already is (same names, dtypes, shapes, token)."""
        if self._mapped is not None and self._token == token and self._plan is not None and \
                self._plan.signature == signature(flat):
            return
        planned = plan(flat)
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        # room for the header to grow (the tree holds step counts, learning rates, ...) without a new layout
        header_bytes = -(-(2 * len(planned.header(flat.tree)) + 4096) // ALIGN) * ALIGN
        size = header_bytes + planned.data_bytes
        path = os.path.join(self.path, replicated_file_name(token))
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, size)
        finally:
            os.close(descriptor)
        mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        # each tensor's bytes in the file, typed and shaped as the tensor: the copy is one copy_ per tensor
        self._targets = [mapped[header_bytes + offset : header_bytes + offset + tensor.numel() * tensor.element_size()]
                         .view(tensor.dtype).view(tensor.shape) for tensor, offset in zip(flat.tensors, planned.offsets)]
        self._plan, self._token, self._header_bytes, self._mapped = planned, token, header_bytes, mapped

    def copy(self, flat: Flat) -> None:
        """The training thread's part: the tensors' bytes into the mapped file."""
        for target, tensor in zip(self._targets, flat.tensors):
            if tensor.numel():
                target.copy_(tensor.detach())

    def finish(self, tree: Any) -> FileRecord:
        """The writer thread's part: the header (with ``tree``, the state's skeleton at the copy) and the digest."""
        assert self._plan is not None and self._mapped is not None
        try:
            header = self._plan.header(tree, size=self._header_bytes)
        except ValueError:
            self._plan = None  # the tree outgrew the room: the next replica lays the file out again
            raise
        self._mapped[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return FileRecord(size=self._mapped.numel(), digest=_digest(self._mapped.numpy().data))

    def release(self) -> None:
        self._plan, self._mapped, self._targets = None, None, []


@dataclass(frozen=True)
class Held:
    """One replica a node holds: where, and its manifest."""

    path: str
    manifest: Manifest


class Replicas:
    """This rank's part of the replicas of a run (see the module docstring).

    ``generation``: torchrun's restart count of this rank's agent; ``agent``: that agent's identity (a pid and
    a start time, the same for every worker group it starts). When storage holds no committed checkpoint,
    replicas are used only if this launch wrote them: some agent restarted its workers after a failure, or
    started workers before (a re-formation after a membership change, which torchrun does not count as a
    restart). A new launch of the same run id over an emptied checkpoint location starts fresh.

    ``group``: a CPU (gloo) group used from the training thread only. ``node_rank`` and
    ``local_rank`` name this rank's node and its place on it (torchrun's ``GROUP_RANK`` and
    ``LOCAL_RANK``); the node's first worker writes. ``token``: the launch's writer token, the
    same on every rank (the checkpoint manager's).
    """

    def __init__(
        self,
        root: str,
        *,
        run_id: str,
        checkpoint_uri: str,
        rank: int,
        world_size: int,
        local_rank: int,
        node_rank: int,
        token: str,
        every: int,
        budget: float = 0.0,
        generation: int = 0,
        agent: str = "",
        group: dist.ProcessGroup | None = None,
        events: EventLog | None = None,
    ) -> None:
        if every < 0:
            raise ValueError(f"every={every} must be >= 0")
        if not 0.0 <= budget < 1.0:
            raise ValueError(f"budget={budget} must be in [0, 1)")
        # one directory per run id and checkpoint location: another job's replicas are never candidates
        where = hashlib.sha256(checkpoint_uri.encode()).hexdigest()[:12]
        self.root = os.path.join(os.path.abspath(root), f"{_UNSAFE.sub('_', run_id)}-{where}")
        self.own = os.path.join(self.root, f"node-{node_rank}")
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.writer = local_rank == 0
        self.token = token
        self.every = every
        self.budget = budget
        self.interval = every
        """Steps between replicas, agreed by all ranks at each replica (see :meth:`_proposal`)."""
        self._next_due: int | None = None
        self._cost: float | None = None
        """This rank's seconds per replica, smoothed: its training thread's time outside the all-gather (the copy
        of the state, a device-to-host copy's wait included) plus, on a node's writer, the background write's CPU
        time (what it takes from training when the node has no idle core)."""
        self._step_time: float | None = None
        """Seconds per training step between replicas, without the replicas, smoothed."""
        self._previous: tuple[int, float, float, float] | None = None
        """Step, time and training-thread seconds of this rank's previous replica, and those seconds without the
        all-gather (whose wait for the slowest rank is that rank's cost, not this one's)."""
        self._gather_s = 0.0
        self._write_failed = False
        self._last_write_cpu_s = 0.0
        self.generation = generation
        self._agent_marker = os.path.join(self.root, f"agent-{_UNSAFE.sub('_', agent)}") if agent else ""
        self.agent_started_before = bool(self._agent_marker) and os.path.exists(self._agent_marker)
        """This rank's agent started a worker group of this run before (its marker was in node memory)."""
        if self._agent_marker:
            try:
                os.makedirs(self.root, exist_ok=True)
                open(self._agent_marker, "a").close()
            except OSError:
                pass  # node memory unusable: the writer warns when it lays out its slots
        self.group = group
        self.events = events or EventLog.off()
        self._capacity = 0
        """Bytes per rank of the all-gather of the ranks' own state (agreed at the first save)."""
        self._slots: list[_Slot] | None = None
        # the writer yields the CPU to training (a late write only means a skipped replica, never a wait)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replica-writer", initializer=lower_thread_priority) \
            if self.writer else None
        self._inflight: Future[None] | None = None
        self._warned = False
        self._superseded: str | None = None
        """The replica this launch resumed from when it is not in one of this writer's slots (another node
        number's, or a rescue): removed once this node commits a newer one."""
        self.stats = ReplicaStats()

    # -- saving ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` takes a replica: every ``every`` steps at first, then at the interval the ranks agreed at
        the previous one (the same on every rank: all ranks run the same steps and agree on the interval)."""
        if self.every <= 0 or step <= 0:
            return False
        return step % self.every == 0 if self._next_due is None else step >= self._next_due

    def save(self, state: CheckpointState) -> None:
        """Every rank, at the same step: exchange the ranks' own state; the node's writer copies the
        replicated state into a slot and finishes the replica in the background. Never raises for a
        failed write (logged once; the node keeps its other replica)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        step = int(state.meta()["step"])
        self._measure(step, started)
        self._gather_s = 0.0
        try:
            self._save(state, step)
        finally:
            blocking, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
            self._previous = step, started, blocking, blocking - self._gather_s
            self.stats.saves += 1
            self.stats.blocking_s += blocking
            self.stats.blocking_cpu_s += cpu

    def _measure(self, step: int, now: float) -> None:
        """Fold the previous replica's cost and the steps since it into the smoothed figures."""
        if self._previous is None:
            return
        previous_step, previous_at, blocking, own = self._previous
        if step <= previous_step:
            return
        cost = own + self._last_write_cpu_s
        training = max(now - previous_at - blocking, 0.0) / (step - previous_step)
        if self.stats.saves <= SLOTS:  # the first replicas lay the slots out: not what the next ones cost
            self._cost, self._step_time = None, training
            return
        self._cost = cost if self._cost is None else self._cost + _SMOOTHING * (cost - self._cost)
        self._step_time = training if self._step_time is None else \
            self._step_time + _SMOOTHING * (training - self._step_time)

    def _proposal(self) -> int:
        """The interval this rank asks for: ``every``, or more when a replica at that interval would take more
        than ``budget`` of the training time. The ranks take the largest proposal."""
        if not self.budget or self._cost is None or not self._step_time:
            return self.every
        needed = math.ceil(self._cost / (self.budget * self._step_time * self.every)) * self.every
        return min(max(self.every, needed), MAX_INTERVAL)

    def _save(self, state: CheckpointState, step: int) -> None:
        meta = state.meta()
        mine = b"".join(bytes(chunk) for chunk in encode_chunks(flatten(state.rank_state_dict())))
        gather_started = time.perf_counter()
        everyone, interval = self._all_gather(mine, self._proposal())
        self._gather_s = time.perf_counter() - gather_started
        self.interval = interval
        self._next_due = step + interval
        if self._pool is None or everyone is None or self._write_failed:
            return
        if self._inflight is not None and not self._inflight.done():
            self.stats.skipped += 1
            return  # the previous write still runs: this node keeps that replica (training never waits)
        self._collect()
        slot = self._free_slot()
        flat = flatten(state.replicated_state_dict())
        try:
            slot.uncommit()
            slot.prepare(flat, self.token)
            slot.copy(flat)
        except (OSError, RuntimeError, ValueError) as exc:  # a full or unwritable replica directory
            slot.release()
            self._warn(exc)
            # this node stops writing replicas (it keeps taking part in the exchange, which every rank needs)
            self._write_failed = True
            return
        self._inflight = self._pool.submit(self._write, slot, step, meta, flat.tree, everyone, interval)

    def _all_gather(self, data: bytes, proposal: int) -> tuple[list[bytes] | None, int]:
        """Every rank's ``data`` and the largest ``proposal``, in one all-gather of a buffer whose size the ranks
        agreed on earlier. The data is None (on every rank) when some rank's outgrew the buffer, which the next
        call's is then large enough for."""
        if self.world_size == 1 or not dist.is_initialized():
            return [data], proposal
        if not self._capacity:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
            self._capacity = _room(max(int(size) for size in sizes))
        capacity = self._capacity
        fits = len(data) <= capacity - _HEAD.size
        buffer = torch.zeros(capacity, dtype=torch.uint8)
        head = _HEAD.pack(len(data) if fits else -len(data), proposal)
        buffer[: _HEAD.size] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        if fits and data:
            buffer[_HEAD.size : _HEAD.size + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(capacity, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, buffer, group=self.group)
        raw = [tensor.numpy().tobytes() for tensor in gathered]
        heads = [_HEAD.unpack_from(item) for item in raw]
        interval = max(1, min(max(asked for _, asked in heads), MAX_INTERVAL))
        if any(length < 0 for length, _ in heads):
            self._capacity = _room(max(abs(length) for length, _ in heads))
            return None, interval
        return [item[_HEAD.size : _HEAD.size + length] for item, (length, _) in zip(raw, heads)], interval

    def _slot_paths(self) -> list[str]:
        """This writer's slot directories (its periodic replicas; a rescue is written beside them)."""
        return [os.path.join(self.own, f"slot-{index}") for index in range(SLOTS)]

    def _free_slot(self) -> _Slot:
        """The slot to write: the one not holding this node's newest replica."""
        if self._slots is None:
            self._slots = [_Slot(path) for path in self._slot_paths()]
            for slot in self._slots:
                slot.step = _committed_step(slot.path, self.run_id)
        return min(self._slots, key=lambda slot: -1 if slot.step is None else slot.step)

    def _write(self, slot: _Slot, step: int, meta: dict[str, Any], tree: Any, ranks: list[bytes], interval: int) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        files = {replicated_file_name(self.token): slot.finish(tree)}
        for rank, data in enumerate(ranks):
            name = rank_file_name(rank, self.token)
            with open(os.path.join(slot.path, name), "wb") as handle:
                handle.write(data)
            files[name] = FileRecord(size=len(data), digest=_digest(data))
        _commit(slot.path, Manifest(step=step, world_size=len(ranks), run_id=self.run_id, generation=self.generation,
                                    files=files, token=self.token, meta=meta, hash=HASH))
        slot.step = step
        self.events.emit(Event.REPLICA_SAVED, step=step, path=slot.path, token=self.token, interval=interval, reason="due")
        if self._superseded is not None:  # the replica this launch resumed from is older now: free its memory
            shutil.rmtree(self._superseded, ignore_errors=True)
            self._superseded = None
        self._last_write_cpu_s = time.thread_time() - cpu_started
        self.stats.written += 1
        self.stats.write_s += time.perf_counter() - started
        self.stats.write_cpu_s += self._last_write_cpu_s

    def _collect(self) -> None:
        """Log (once) why the previous write failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight.exception() is not None:
            self._warn(inflight.exception())

    def _warn(self, error: BaseException | None) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("rank %d: writing a replica under %s failed (%s); training goes on without it, and a "
                           "restart falls back to another node's replica or to storage", self.rank, self.own, error)

    # -- rescue ------------------------------------------------------------------

    def rescue(self, state: CheckpointState) -> str | None:
        """Keep ``state``, the live state of a rank that survived a peer's loss, in the node's rescue directory,
        so that the restart resumes from its step instead of the last replica or commit.

        The caller vouches that the state is a complete state of its step (:mod:`elastic_ddp.resilience.rescue`
        decides). Only the replicated state is kept: the lost ranks' own state (RNG streams) is gone, so a
        resume from a rescue re-derives every rank's streams, as after a world-size change. One survivor per
        node writes it: another that finds the node's lock taken, or the step already held, writes nothing.
        Returns the directory written, else None; raises what writing to node memory raises."""
        step = int(state.meta()["step"])
        self.wait()  # a replica of this very step may be in flight: it holds more (every rank's streams)
        os.makedirs(self.own, exist_ok=True)
        with _node_lock(os.path.join(self.own, f"{RESCUE_DIR}.lock")) as locked:
            if not locked or any(held.manifest.token == self.token and held.manifest.step >= step
                                 for held in self.held()):
                return None
            slot = _Slot(os.path.join(self.own, RESCUE_DIR))
            flat = flatten(state.replicated_state_dict())
            try:
                slot.uncommit()
                slot.prepare(flat, self.token)
                slot.copy(flat)
                files = {replicated_file_name(self.token): slot.finish(flat.tree)}
            finally:
                slot.release()
            _commit(slot.path, Manifest(step=step, world_size=self.world_size, run_id=self.run_id,
                                        generation=self.generation, files=files, token=self.token, meta=state.meta(),
                                        hash=HASH, rank_state=False))
        self.events.emit(Event.REPLICA_SAVED, step=step, path=slot.path, token=self.token, interval=0, reason="rescue")
        return slot.path

    def wait(self) -> None:
        """Return once the write in flight is done (tests, and the end of a run)."""
        if self._inflight is not None:
            self._inflight.exception()
        self._collect()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for slot in self._slots or []:
            slot.release()

    def discard(self) -> None:
        """Remove this node's replicas (the run finished: nothing will resume from them)."""
        self.close()
        if self.writer:
            shutil.rmtree(self.own, ignore_errors=True)
            if self._agent_marker:
                unlink_quietly(self._agent_marker)
            try:
                os.rmdir(self.root)  # only once every node's directory is gone
            except OSError:
                pass

    # -- restoring ---------------------------------------------------------------

    def held(self) -> list[Held]:
        """The replicas this node holds that have a manifest (any of its writers' directories), newest first;
        a manifest that does not parse is skipped (its replica cannot be trusted)."""
        found: list[Held] = []
        try:
            nodes = [name for name in os.listdir(self.root) if _NODE_DIR.match(name)]
        except OSError:
            return []
        for node in nodes:
            base = os.path.join(self.root, node)
            for name in _list(base):
                if not _HELD_DIR.match(name):
                    continue
                path = os.path.join(base, name)
                manifest = _read_manifest(path)
                if manifest is not None and manifest.run_id == self.run_id:
                    found.append(Held(path, manifest))
        return sorted(found, key=lambda held: held.manifest.step, reverse=True)

    def restore(self, state: CheckpointState, newest_committed: Callable[[], int | None]) -> Restored | None:
        """Every rank: load the newest replica at least as new as storage's newest committed step (which
        ``newest_committed`` reads, on rank 0 and only when some node holds a replica; None: storage holds
        none); None when no node holds one or any rank could not verify it."""
        mine = {_identity(held.manifest): held for held in self.held()}
        reports = self._gather_to_main((sorted(mine), self.generation > 0 or self.agent_started_before))
        choice: list[Any] = [None]
        if self.rank == 0 and any(held for held, _ in reports):
            restarted = any(again for _, again in reports)
            committed = newest_committed()
            if committed is None and not restarted:
                # A new launch (no agent has started workers before) over storage without a checkpoint: replicas
                # left by an earlier launch of this run id must not resurrect a run whose checkpoints were removed.
                logger.warning("ignoring replicas left by an earlier launch under %s: storage holds no checkpoint",
                               self.root)
            else:
                choice[0] = _choose([held for held, _ in reports], committed)
        self._broadcast_from_main(choice)
        if choice[0] is None:
            return None
        identity, holders = choice[0]
        identity, step = tuple(identity), identity[0]
        source = holders[0]
        manifest_json = self._send_bytes(mine[identity].manifest.to_json() if self.rank == source else b"", source)
        manifest = Manifest.from_json(manifest_json, f"replica of step {step}")
        local = mine.get(identity)
        reuse_rank_state = manifest.resumes_rank_state_at(self.world_size)
        problem, decoded = self._fetch(manifest, local, holders, reuse_rank_state)
        problems = self._gather_to_main(problem)
        verdict: list[Any] = [None]
        if self.rank == 0:
            verdict[0] = next((p for p in problems if p), None)
        self._broadcast_from_main(verdict)
        where = local.path if local is not None else f"replica of step {step} on the node of rank {source}"
        if verdict[0] is not None:
            logger.warning("rank %d: not resuming from the replica of step %d (%s); restoring from storage",
                           self.rank, step, verdict[0])
            self.events.emit(Event.CHECKPOINT_SKIPPED, step=step, path=where, reason=f"replica: {verdict[0]}")
            return None
        replicated, rank_local = decoded
        state.load_state_dict({"meta": manifest.meta, "replicated": replicated, "rank_local": rank_local})
        if self.writer:
            self._drop_all_but(identity)
        return Restored(step=step, path=where, world_size=manifest.world_size, rank_state_reused=reuse_rank_state,
                        source="replica")

    def _fetch(self, manifest: Manifest, local: Held | None, holders: list[int],
               reuse_rank_state: bool) -> tuple[str | None, tuple[Any, Any]]:
        """This rank's pieces, verified and decoded; every rank takes part in every transfer."""
        wanted = [manifest.replicated_file]
        if reuse_rank_state:
            wanted += [manifest.rank_file(rank) for rank in range(self.world_size)]
        source = holders[0]
        remote = len(holders) < self.world_size  # some rank's node does not hold it: it is sent to all
        pieces: dict[str, bytes | memoryview] = {}
        problem: str | None = None
        for name in wanted:
            mine_needed = name == manifest.replicated_file or name == manifest.rank_file(self.rank)
            data: bytes | memoryview | None = None
            if local is not None and (mine_needed or self.rank == source):
                try:
                    data = _read_verified(local.path, name, manifest)
                except CheckpointError as exc:
                    problem = problem or str(exc)
            if remote:
                payload = bytes(data) if self.rank == source and data is not None else b""
                sent = self._send_bytes(payload, source)
                if local is None and mine_needed:
                    data = sent
                    problem = problem or _checksum_problem(name, sent, manifest)
            if mine_needed and data is not None:
                pieces[name] = data
        if problem is not None:
            return problem, (None, None)
        try:
            replicated = deserialize(pieces[manifest.replicated_file], manifest.replicated_file)
            rank_local = deserialize(pieces[manifest.rank_file(self.rank)], "rank file") if reuse_rank_state else None
        except (CheckpointError, KeyError) as exc:
            return f"rank {self.rank}: {exc}", (None, None)
        return None, (replicated, rank_local)

    def _drop_all_but(self, identity: tuple[Any, ...]) -> None:
        """After a resume: remove this node's other replicas (older, or of another launch)."""
        for held in self.held():
            if _identity(held.manifest) != identity:
                shutil.rmtree(held.path, ignore_errors=True)
            elif held.path not in self._slot_paths():
                self._superseded = held.path
        self._slots = None  # which slot holds what is read again at the next save

    # -- collectives -------------------------------------------------------------

    def _gather_to_main(self, item: Any) -> list[Any]:
        return gather_to_main(item, self.rank, self.world_size, self.group)

    def _broadcast_from_main(self, items: list[Any]) -> None:
        broadcast_from_main(items, self.world_size, self.group)

    def _send_bytes(self, data: bytes, source: int) -> bytes:
        """``source``'s bytes on every rank (a length, then the bytes, as tensors: no pickle)."""
        if self.world_size == 1 or not dist.is_initialized():
            return data
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=_global(source, self.group), group=self.group)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == source and data else \
            torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(buffer, src=_global(source, self.group), group=self.group)
        return buffer.numpy().tobytes()


def _identity(manifest: Manifest) -> tuple[int, str, str]:
    """What makes two nodes' replicas the same one: step, writer token and the replicated file's digest (two
    survivors' rescues of one step are alike only if their bytes are)."""
    return manifest.step, manifest.token, manifest.files[manifest.replicated_file].digest


def _choose(reports: list[list[tuple[Any, ...]]], newest_committed: int | None) -> tuple[tuple[Any, ...], list[int]] | None:
    """Rank 0: the newest replica some node holds (by :func:`_identity`), not older than storage's newest commit,
    with the ranks whose node holds it (lowest first)."""
    holders: dict[tuple[Any, ...], list[int]] = {}
    for rank, held in enumerate(reports):
        for key in held:
            holders.setdefault(tuple(key), []).append(rank)
    candidates = [key for key in holders if newest_committed is None or key[0] >= newest_committed]
    if not candidates:
        return None
    chosen = max(candidates)
    return chosen, sorted(holders[chosen])


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _commit(directory: str, manifest: Manifest) -> None:
    """Write a replica's manifest, last: it commits the replica."""
    temp = os.path.join(directory, f"{MANIFEST_NAME}.tmp")
    with open(temp, "wb") as handle:
        handle.write(manifest.to_json())
    os.replace(temp, os.path.join(directory, MANIFEST_NAME))


@contextmanager
def _node_lock(path: str) -> Iterator[bool]:
    """Hold the lock file ``path`` while the block runs, if no other process on the node holds it (yields whether
    it was taken; the kernel releases it when a holder dies)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(descriptor)


def _room(size: int) -> int:
    """All-gather buffer bytes for rank states of ``size`` bytes: the length field, twice the size, whole KiB."""
    return -(-(_HEAD.size + 2 * size) // 1024) * 1024


def _read_manifest(directory: str) -> Manifest | None:
    """A slot's manifest, or None when it has none that parses with this layer's digest (nothing to trust)."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as handle:
            manifest = Manifest.from_json(handle.read(), directory)
    except (OSError, CheckpointError):
        return None
    return manifest if manifest.hash == HASH else None


def _committed_step(directory: str, run_id: str) -> int | None:
    manifest = _read_manifest(directory)
    return manifest.step if manifest is not None and manifest.run_id == run_id else None


def _read_verified(directory: str, name: str, manifest: Manifest) -> memoryview:
    """A replica file's bytes (a private copy: the slot may be rewritten later), checked against the manifest."""
    if name not in manifest.files:
        raise CheckpointCorruptError(f"{directory}: {name} is not listed in the replica's manifest")
    path = os.path.join(directory, name)
    try:
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            data = uninitialised(size)
            got = 0
            while got < size and (count := handle.readinto(data[got:])):
                got += count
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: cannot be read ({exc})") from exc
    record = manifest.files[name]
    if (got, _digest(data[:got])) != (record.size, record.digest):
        raise CheckpointCorruptError(f"{path}: does not match the replica's manifest (size or {HASH})")
    return data[:got]


def _checksum_problem(name: str, data: bytes, manifest: Manifest) -> str | None:
    record = manifest.files.get(name)
    if record is None:
        return f"{name} is not listed in the replica's manifest"
    if (len(data), _digest(data)) != (record.size, record.digest):
        return f"{name} received from a peer does not match the replica's manifest"
    return None


def _list(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
