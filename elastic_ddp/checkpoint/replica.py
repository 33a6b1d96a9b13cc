"""Replicas: the newest step's state kept in node memory, so a restart redoes no step (docs/design.md, "Replicas").

A committed checkpoint is the only state that survives a failure when training restarts: every
worker of the job is a new process after torchrun restarts the group, so a ``kill -9`` of one
worker cost every step since the last commit. Replicas close that gap.

**Saving.** Every ``every`` steps, on every rank at the same step, each rank encodes its own
state (the rank part of a checkpoint: RNG streams, a sharded optimizer's shard, per-rank
objects) and all ranks exchange it in one all-gather (a few kilobytes per rank under DDP).
Then the first worker of each node writes, in a background thread, a complete checkpoint of
that step into the node's replica directory: the replicated state (model, optimizer, ...) from
its own memory, every rank's state, and a manifest written last, in the layout and with the
SHA-256 checksums of a stored checkpoint. The directory is node memory (``/dev/shm``) by
default: it outlives the workers, not the node. So every node holds the whole state of the
step, and a step can be resumed while any node that wrote it survives. A node whose previous
write has not finished skips the step (training never waits for a replica); it holds the
previous one until the next due step. Each node keeps its two newest replicas.

**Restoring.** Every rank reports the replicas its node holds. Rank 0 takes the newest one
that is at least as new as the newest committed checkpoint in storage. Each rank reads its
pieces from its own node's copy when that holds the same save (same step and writer token);
otherwise a rank whose node holds it sends them over the process group. Every rank checks the
bytes against the manifest and decodes them before anything is loaded; only when every rank
succeeded does any rank load them, so a damaged or missing replica means the storage restore,
never a partial load. A world-size change loads only the replicated state and the data
position, exactly like a storage restore (RNG streams re-derived).

Replicas are fenced by the launch's writer token, shared by all ranks: a node that missed a
restore cannot mix its files into another save's replica. Any replica chosen is a complete
state of one step of this run, with the data position it was saved with, so resuming from it
keeps the exactly-once data contract of a storage resume.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.format import Flat, encode_chunks, flatten
from elastic_ddp.checkpoint.manager import (
    CheckpointState,
    Restored,
    Stager,
    broadcast_from_main,
    deserialize,
    gather_to_main,
)
from elastic_ddp.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    parse_step_dir,
    rank_file_name,
    replicated_file_name,
    step_dir_name,
)
from elastic_ddp.checkpoint.storage import Checksum, FileRecord, LocalStorage
from elastic_ddp.errors import CheckpointCorruptError, CheckpointError
from elastic_ddp.events import Event, EventLog

logger = logging.getLogger(__name__)

REPLICA_DIR_ENV = "ELASTIC_DDP_REPLICA_DIR"
"""The node's replica root when ``--checkpoint-replica-dir`` is not given."""
KEEP = 2
_NODE_DIR = re.compile(r"^node-\d+$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_root() -> str:
    """``$ELASTIC_DDP_REPLICA_DIR``, else a per-user directory in node memory (``/dev/shm``)."""
    configured = os.environ.get(REPLICA_DIR_ENV, "")
    if configured:
        return configured
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"elastic_ddp-replicas-{os.getuid()}")


@dataclass(frozen=True)
class Held:
    """One replica a node holds: where, and its manifest."""

    path: str
    manifest: Manifest


class Replicas:
    """This rank's part of the replicas of a run (see the module docstring).

    ``generation``: torchrun's restart count of this rank's agent. When storage holds no committed
    checkpoint, replicas are used only if some agent has restarted (this launch wrote them): a new
    launch of the same run id over an emptied checkpoint location starts fresh.

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
        generation: int = 0,
        group: dist.ProcessGroup | None = None,
        events: EventLog | None = None,
    ) -> None:
        if every < 0:
            raise ValueError(f"every={every} must be >= 0")
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
        self.generation = generation
        self.group = group
        self.events = events or EventLog.off()
        self._stager = Stager()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replica-writer") if self.writer else None
        self._inflight: Future[None] | None = None
        self._warned = False

    # -- saving ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, state: CheckpointState) -> None:
        """Every rank, at the same step: exchange the ranks' own state; the node's writer stages the
        replicated state and writes the replica in the background. Never raises for a failed write
        (logged once; the node keeps its older replicas)."""
        meta = state.meta()
        mine = b"".join(bytes(chunk) for chunk in encode_chunks(flatten(state.rank_state_dict())))
        everyone = self._all_gather(mine)
        if self._pool is None:
            return
        if self._inflight is not None and not self._inflight.done():
            return  # the previous write still runs: this node keeps that replica (training never waits)
        self._collect()
        replicated, _ = self._stager.stage("replicated", flatten(state.replicated_state_dict()))
        self._inflight = self._pool.submit(self._write, int(meta["step"]), meta, replicated, everyone)

    def _all_gather(self, data: bytes) -> list[bytes]:
        if self.world_size == 1 or not dist.is_initialized():
            return [data]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        return [tensor[: int(size)].numpy().tobytes() for tensor, size in zip(gathered, sizes)]

    def _write(self, step: int, meta: dict[str, Any], replicated: Flat, ranks: list[bytes]) -> None:
        directory = os.path.join(self.own, step_dir_name(step))
        shutil.rmtree(directory, ignore_errors=True)  # another launch's replica of this step
        os.makedirs(directory)
        files = {replicated_file_name(self.token): _write_file(os.path.join(directory, replicated_file_name(self.token)),
                                                               encode_chunks(replicated))}
        for rank, data in enumerate(ranks):
            name = rank_file_name(rank, self.token)
            files[name] = _write_file(os.path.join(directory, name), [data])
        manifest = Manifest(step=step, world_size=len(ranks), run_id=self.run_id, generation=self.generation,
                            files=files, token=self.token, meta=meta)
        _write_file(os.path.join(directory, MANIFEST_NAME), [manifest.to_json()])  # last: it commits the replica
        self.events.emit(Event.REPLICA_SAVED, step=step, path=directory, token=self.token)
        for old in sorted(self._own_steps(), reverse=True)[KEEP:]:
            shutil.rmtree(os.path.join(self.own, step_dir_name(old)), ignore_errors=True)

    def _own_steps(self) -> list[int]:
        return [step for step in map(parse_step_dir, _list(self.own)) if step is not None]

    def _collect(self) -> None:
        """Log (once) why the previous write failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        error = inflight.exception()
        if error is not None and not self._warned:
            self._warned = True
            logger.warning("rank %d: writing a replica under %s failed (%s); training goes on without it, and a "
                           "restart falls back to the older replica or to storage", self.rank, self.own, error)

    def wait(self) -> None:
        """Return once the write in flight is done (tests, and the end of a run)."""
        if self._inflight is not None:
            self._inflight.exception()
        self._collect()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def discard(self) -> None:
        """Remove this node's replicas (the run finished: nothing will resume from them)."""
        self.close()
        if self.writer:
            shutil.rmtree(self.own, ignore_errors=True)
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
                if parse_step_dir(name) is None:
                    continue
                path = os.path.join(base, name)
                try:
                    with open(os.path.join(path, MANIFEST_NAME), "rb") as handle:
                        manifest = Manifest.from_json(handle.read(), path)
                except (OSError, CheckpointError):
                    continue
                if manifest.run_id == self.run_id:
                    found.append(Held(path, manifest))
        return sorted(found, key=lambda held: held.manifest.step, reverse=True)

    def restore(self, state: CheckpointState, newest_committed: Callable[[], int | None]) -> Restored | None:
        """Every rank: load the newest replica at least as new as storage's newest committed step (which
        ``newest_committed`` reads, on rank 0 and only when some node holds a replica; None: storage holds
        none); None when no node holds one or any rank could not verify it."""
        mine = {(held.manifest.step, held.manifest.token): held for held in self.held()}
        reports = self._gather_to_main((sorted(mine), self.generation))
        choice: list[Any] = [None]
        if self.rank == 0 and any(held for held, _ in reports):
            restarted = any(generation > 0 for _, generation in reports)
            committed = newest_committed()
            if committed is None and not restarted:
                # A new launch (no agent has restarted) over storage without a checkpoint: replicas left by an
                # earlier launch of this run id must not resurrect a run whose checkpoints were removed.
                logger.warning("ignoring replicas left by an earlier launch under %s: storage holds no checkpoint",
                               self.root)
            else:
                choice[0] = _choose([held for held, _ in reports], committed)
        self._broadcast_from_main(choice)
        if choice[0] is None:
            return None
        step, token, holders = choice[0]
        source = holders[0]
        manifest_json = self._send_bytes(mine[(step, token)].manifest.to_json() if self.rank == source else b"", source)
        manifest = Manifest.from_json(manifest_json, f"replica of step {step}")
        local = mine.get((step, token))
        reuse_rank_state = manifest.world_size == self.world_size
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
            self._drop_all_but(step, token)
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

    def _drop_all_but(self, step: int, token: str) -> None:
        """After a resume: remove this node's other replicas (older, or of another launch)."""
        for held in self.held():
            if (held.manifest.step, held.manifest.token) != (step, token):
                shutil.rmtree(held.path, ignore_errors=True)

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


def _choose(reports: list[list[tuple[int, str]]], newest_committed: int | None) -> tuple[int, str, list[int]] | None:
    """Rank 0: the newest (step, token) some node holds, not older than storage's newest commit, with the
    ranks whose node holds it (lowest first)."""
    holders: dict[tuple[int, str], list[int]] = {}
    for rank, held in enumerate(reports):
        for key in held:
            holders.setdefault(tuple(key), []).append(rank)  # type: ignore[arg-type]
    candidates = [key for key in holders if newest_committed is None or key[0] >= newest_committed]
    if not candidates:
        return None
    step, token = max(candidates)
    return step, token, sorted(holders[(step, token)])


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _write_file(path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
    """Write a replica file through a temporary name (no fsync: node memory does not outlive the node)."""
    temp = f"{path}.tmp"
    with Checksum() as checksum, open(temp, "wb") as handle:
        for chunk in chunks:
            checksum.update(chunk)
            handle.write(chunk)
        record = checksum.record()
    os.replace(temp, path)
    return record


def _read_verified(directory: str, name: str, manifest: Manifest) -> memoryview:
    if name not in manifest.files:
        raise CheckpointCorruptError(f"{directory}: {name} is not listed in the replica's manifest")
    path = os.path.join(directory, name)
    data, found = LocalStorage(directory).read_hashed(path)
    record = manifest.files[name]
    if (found.size, found.sha256) != (record.size, record.sha256):
        raise CheckpointCorruptError(f"{path}: does not match the replica's manifest (size or sha256)")
    return data


def _checksum_problem(name: str, data: bytes, manifest: Manifest) -> str | None:
    record = manifest.files.get(name)
    if record is None:
        return f"{name} is not listed in the replica's manifest"
    with Checksum() as checksum:
        checksum.update(data)
        found = checksum.record()
    if (found.size, found.sha256) != (record.size, record.sha256):
        return f"{name} received from a peer does not match the replica's manifest"
    return None


def _list(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
