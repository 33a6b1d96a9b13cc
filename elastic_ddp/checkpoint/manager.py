"""Saving, discovering and restoring checkpoints under one root (docs/design.md, "Commit protocol").

Layout::

    <root>/step-00000040/replicated-<token>.eddp   rank 0: model, optimizer, scheduler, scaler
    <root>/step-00000040/rank-00000-<token>.eddp   every rank: its RNG streams, sharded and per-rank state
    <root>/step-00000040/manifest.json           written last, create-only: the commit
    <root>/latest                                a hint, updated after the commit

``<token>`` is drawn by rank 0 once per launch and shared with every rank, so two
incarnations of a job writing the same step never write the same file: the loser of the
manifest race leaves only its own, unreferenced files behind, and a committed checkpoint's
files are never overwritten.

Collective protocol of a save: every rank writes its files and reports ``(name, size,
digest)`` or its error to rank 0; rank 0 writes the manifest only if every file is
durable, then tells every rank the outcome, so a failed save raises on all ranks alike.
Restore: rank 0 picks the newest checkpoint whose manifest parses and whose files match
their checksums (falling back and saying why), every rank loads from that one. Newer
checkpoints that failed verification are un-committed (their manifest is set aside as
``manifest.rejected.json``) so the resumed run can commit those steps again.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.format import Flat, decode, encode_chunks, flatten
from elastic_ddp.checkpoint.manifest import (
    MANIFEST_NAME,
    REJECTED_MANIFEST_NAME,
    Manifest,
    parse_step_dir,
    rank_file_name,
    replicated_file_name,
    step_dir_name,
)
from elastic_ddp.checkpoint.storage import STORED_HASHES, FileRecord, Storage, open_storage
from elastic_ddp.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    ElasticDDPError,
    IncompatibleCheckpointError,
    NoValidCheckpointError,
)
from elastic_ddp.events import Event, EventLog

logger = logging.getLogger(__name__)

LATEST_HINT = "latest"
VERIFY_THREADS = 2
"""Files of other ranks that rank 0 verifies at once while it reads its own (each is held in memory while it is hashed)."""
LEFTOVER_GRACE_S = 600.0
"""A step directory without a manifest is removed only when it is older than the newest commit
and has not been touched for this long: a live writer (another incarnation) may still be filling it."""


class CheckpointState(Protocol):
    """What the manager saves and restores (the trainer's :class:`~elastic_ddp.state.TrainState` is one).

    ``meta()`` is a small JSON object with an integer ``step``; it goes into the manifest, and
    ``load_state_dict`` receives it back as ``{"meta", "replicated", "rank_local"}`` (``rank_local``
    is None when the checkpoint was saved at another world size).
    """

    def replicated_state_dict(self) -> dict[str, Any]: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def meta(self) -> dict[str, Any]: ...

    def optimizer_owned(self) -> frozenset[int]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory as found in storage."""

    step: int
    path: str
    manifest: Manifest | None
    problem: str = ""
    manifest_present: bool = True
    """Whether the directory holds a manifest file at all (committed, or one that does not verify)."""

    @property
    def committed(self) -> bool:
        return self.manifest is not None


@dataclass(frozen=True)
class Restored:
    """A checkpoint chosen and loaded by :meth:`CheckpointManager.restore`."""

    step: int
    path: str
    world_size: int
    rank_state_reused: bool
    source: str = "storage"
    """``storage`` (a committed checkpoint under the manager's URI) or ``replica`` (a node's copy in memory)."""


class NodeCopies(Protocol):
    """Copies of the state kept in node memory, tried before storage (:class:`elastic_ddp.checkpoint.replica.Replicas`)."""

    def restore(self, state: CheckpointState, newest_committed: Callable[[], int | None]) -> Restored | None:
        """Load the newest copy at least as new as ``newest_committed()`` into ``state``; None: none to load."""
        ...


@dataclass
class Staged:
    """A checkpoint's content captured at one step: file payloads (flattened) plus the meta."""

    step: int
    meta: dict[str, Any]
    files: dict[str, Flat]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """``(staging buffer, live tensor)`` pairs not copied yet: state that only the optimizer's next
    step changes, copied by :meth:`finish_staging` while that step's forward and backward run."""
    after: torch.cuda.Event | None = None
    """For CUDA tensors among ``pending``: recorded on the training stream when the state was captured."""
    failure: str | None = None
    """Why :meth:`finish_staging` failed; reported to the committer like a failed write."""

    def finish_staging(self) -> None:
        """Copy the pending tensors into their buffers (a CUDA copy on its own stream, after ``after``)."""
        pending, self.pending = self.pending, []
        if self.after is None:
            for buffer, tensor in pending:
                buffer.copy_(tensor)
            return
        stream = torch.cuda.Stream(device=pending[0][1].device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.after)
            for buffer, tensor in pending:
                buffer.copy_(tensor, non_blocking=True)
        stream.synchronize()


class Stager:
    """Copies state into CPU buffers that are reused from one save to the next.

    The blocking part of an asynchronous save is only this copy; serialising, hashing and
    writing happen afterwards from the staged buffers while training goes on. Buffers are
    reallocated only when a tensor's shape or dtype changes, so memory stays bounded at one
    copy of the state (at most one save is in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def stage(
        self, name: str, flat: Flat, defer: frozenset[int] = frozenset()
    ) -> tuple[Flat, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The staged payload, and the ``(buffer, tensor)`` pairs left to copy: those whose data pointer is in ``defer``."""
        buffers = self._buffers.get(name, [])
        if len(buffers) != len(flat.tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, flat.tensors)
        ):
            buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in flat.tensors]
            self._buffers[name] = buffers
        pending = []
        for buffer, tensor in zip(buffers, flat.tensors):
            if tensor.numel() and tensor.data_ptr() in defer:
                pending.append((buffer, tensor.detach()))
            else:
                buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        if any(t.is_cuda for t in flat.tensors):
            torch.cuda.synchronize()
        return Flat(flat.tree, buffers, flat.names), pending


class CheckpointManager:
    """Save and restore :class:`CheckpointState` under ``uri`` as one member of a process group.

    ``group`` is the process group used to coordinate saves and restores (a gloo group, so
    object collectives work whatever the training backend, and so a background save never
    interleaves with the training step's collectives); None means the default group.
    """

    def __init__(
        self,
        uri: str,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        generation: int = 0,
        keep: int = 3,
        storage: Storage | None = None,
        storage_options: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
        probe: bool = False,
        events: EventLog | None = None,
    ) -> None:
        """``probe``: before anything else, rank 0 writes and removes a small file under ``uri``, and
        every rank raises :class:`CheckpointStorageError` naming the URI if that failed (a path that is
        a file, a read-only directory, a bucket that does not exist), instead of at the first save.
        ``events``: where what a save or restore decided goes (committed, save_failed, resumed, ...)."""
        if keep < 2:
            raise CheckpointError(f"keep={keep}: at least 2 checkpoints must be kept so a corrupt one has a fallback")
        self.uri = uri
        self.storage = storage or open_storage(uri, storage_options)
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.generation = generation
        self.keep = keep
        self.group = group
        self.events = events or EventLog.off()
        self.stager = Stager()
        self.token = self._shared_token(probe)
        self._retention: threading.Thread | None = None
        self._verified: set[bytes] = set()
        """Manifests (their JSON) whose checkpoint counts as verified for retention: committed by this
        manager (checksums taken over the bytes it wrote), or read back and verified once."""

    def _shared_token(self, probe: bool) -> str:
        """Rank 0's writer token for this launch, and the outcome of its write probe, on every rank."""
        shared: list[Any] = [secrets.token_hex(6), None]
        if probe and self.rank == 0:
            shared[1] = self._probe_failure(shared[0])
        self._broadcast_from_main(shared)
        token, failure = shared
        if failure is not None:
            raise CheckpointStorageError(f"checkpoint location {self.uri} is not usable: {failure}")
        return token

    def _probe_failure(self, token: str) -> str | None:
        """Why a small file cannot be written and removed under the root, or None when it can."""
        path = self.storage.join(f".probe-{token}")
        try:
            self.storage.write(path, [b"elastic_ddp write probe\n"])
            self.storage.remove(path)
        except CheckpointError as exc:
            return str(exc)
        return None

    # -- save --------------------------------------------------------------------

    def save(self, state: CheckpointState) -> Manifest:
        """Save synchronously: write straight from the live state (CPU tensors are not copied)."""
        return self.write_and_commit(self.capture(state, copy=False))

    def capture(self, state: CheckpointState, copy: bool, defer: bool = False) -> Staged:
        """This rank's files of the checkpoint of the current step; ``copy`` stages tensors into reused buffers.

        ``defer`` leaves the copies of what only the optimizer's step changes to
        :meth:`Staged.finish_staging`, which must run before that step.
        """
        files = {rank_file_name(self.rank, self.token): flatten(state.rank_state_dict())}
        if self.rank == 0:
            files[replicated_file_name(self.token)] = flatten(state.replicated_state_dict())
        meta = state.meta()
        staged = Staged(step=int(meta["step"]), meta=meta, files=files)
        if copy or any(t.device.type != "cpu" or not t.is_contiguous() for f in files.values() for t in f.tensors):
            deferred = state.optimizer_owned() if defer else frozenset()
            staged.files = {}
            for name, flat in files.items():
                staged.files[name], pending = self.stager.stage(name, flat, deferred)
                staged.pending += pending
            if any(tensor.is_cuda for _, tensor in staged.pending):
                staged.after = torch.cuda.Event()
                staged.after.record()
        return staged

    def write_and_commit(self, staged: Staged) -> Manifest:
        """Write this rank's files, then (rank 0) commit the manifest; raises on every rank if any part failed
        (each rank's ``save_failed`` event says why)."""
        try:
            return self._write_and_commit(staged)
        except Exception as exc:
            self.events.emit(Event.SAVE_FAILED, step=staged.step, error=_describe(exc))
            raise

    def _write_and_commit(self, staged: Staged) -> Manifest:
        directory = self.storage.join(step_dir_name(staged.step))
        records: dict[str, FileRecord]
        error: str | None
        if staged.failure is not None:
            records, error = {}, f"rank {self.rank} could not stage its state: {staged.failure}"
        else:
            records, error = self._write_own_files(staged, directory)
        reports = self._gather_to_main((records, error))
        outcome: list[Any] = [None, None, False]  # manifest, failure, lost the create-only race
        cause: BaseException | None = None  # rank 0's own exception, kept as the cause of what it raises
        if self.rank == 0:
            try:
                outcome[0] = self._commit(staged, directory, reports)
            except CheckpointConflictError as exc:
                outcome[1:], cause = [str(exc), True], exc
            except CheckpointError as exc:
                outcome[1], cause = str(exc), exc
            except Exception as exc:  # every rank waits for this outcome; a bug must reach them too
                logger.exception("committing the checkpoint of step %d failed unexpectedly", staged.step)
                outcome[1], cause = f"{type(exc).__name__}: {exc}", exc
        self._broadcast_from_main(outcome)
        manifest, failure, conflict = outcome
        if failure is not None:
            error_class: type[CheckpointError] = CheckpointConflictError if conflict else CheckpointError
            raise error_class(f"checkpoint of step {staged.step} under {self.uri} was not committed: {failure}") from cause
        return manifest

    def _write_own_files(self, staged: Staged, directory: str) -> tuple[dict[str, FileRecord], str | None]:
        records: dict[str, FileRecord] = {}
        for name, flat in staged.files.items():
            try:
                records[name] = self.storage.write(self.storage.join(directory, name), encode_chunks(flat))
            except Exception as exc:  # noqa: BLE001 - reported to the committer, which fails the save on every rank
                return records, f"rank {self.rank} could not write {name}: {exc}"
        return records, None

    def _commit(self, staged: Staged, directory: str, reports: list[Any]) -> Manifest:
        failures = [error for _, error in reports if error]
        if failures:
            raise CheckpointError("; ".join(failures))
        files: dict[str, FileRecord] = {}
        for records, _ in reports:
            files.update(records)
        manifest = Manifest(
            step=staged.step,
            world_size=self.world_size,
            run_id=self.run_id,
            generation=self.generation,
            files=files,
            token=self.token,
            meta=staged.meta,
        )
        body = manifest.to_json()
        self.storage.create(self.storage.join(directory, MANIFEST_NAME), body)
        self._verified.add(body)
        logger.info("committed checkpoint %s (%d files, %.1f MB)", directory, len(files), manifest.total_bytes / 1e6)
        self.events.emit(Event.COMMITTED, step=staged.step, path=directory, world_size=self.world_size, files=len(files),
                         bytes=manifest.total_bytes)
        self._after_commit(manifest)
        return manifest

    def _after_commit(self, manifest: Manifest) -> None:
        """Update the ``latest`` hint, and start retention behind the save. The checkpoint is
        committed already, so a failure of either is logged, not raised: neither is needed for a
        correct restore.

        Retention runs on a thread so that the save returns (and every rank learns the outcome)
        without waiting for deletions, which take time of their own on a large checkpoint (a synchronous
        save that also deleted one took twice as long). One retention runs at a time; a process that
        exits meanwhile leaves at worst a step directory without its manifest, which the next retention
        removes (manifest first is what makes an interrupted removal safe)."""
        try:
            self.storage.replace(self.storage.join(LATEST_HINT), step_dir_name(manifest.step).encode())
        except CheckpointError as exc:
            logger.warning("checkpoint of step %d is committed, but updating 'latest' failed: %s", manifest.step, exc)
        self.wait_for_retention()
        self._retention = threading.Thread(target=self._retain, args=(manifest.step,), name="elastic-ddp-retention",
                                           daemon=True)
        self._retention.start()

    def _retain(self, step: int) -> None:
        try:
            self.apply_retention()
        except CheckpointError as exc:
            logger.warning("checkpoint of step %d is committed, but retention failed: %s", step, exc)
        except Exception:  # a bug here must be seen, and must not end the training
            logger.exception("checkpoint of step %d is committed, but retention failed", step)

    def wait_for_retention(self) -> None:
        """Return once the retention started by the last commit has finished."""
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    # -- discovery ---------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every step directory, newest first, with its manifest when one parses."""
        found = []
        for name in self.storage.list_dir(self.storage.root):
            step = parse_step_dir(name)
            if step is not None:
                found.append(self.describe(step))
        return sorted(found, key=lambda info: info.step, reverse=True)

    def describe(self, step: int) -> CheckpointInfo:
        path = self.storage.join(step_dir_name(step))
        manifest_path = self._manifest_path(step)
        if not self.storage.exists(manifest_path):
            return CheckpointInfo(step, path, None, "no manifest (not committed)", manifest_present=False)
        try:
            manifest = Manifest.from_json(self.storage.read(manifest_path), manifest_path)
        except CheckpointError as exc:
            return CheckpointInfo(step, path, None, str(exc))
        if manifest.step != step:
            return CheckpointInfo(step, path, None, f"manifest says step {manifest.step}, directory says {step}")
        if manifest.hash not in STORED_HASHES:
            return CheckpointInfo(step, path, None, f"files checksummed with {manifest.hash}: a stored checkpoint needs "
                                                    f"{' or '.join(STORED_HASHES)}")
        return CheckpointInfo(step, path, manifest)

    def verify(self, info: CheckpointInfo) -> dict[str, bytes | memoryview]:
        """Read every file of a committed checkpoint and check its size and checksum; return the bytes."""
        if info.manifest is None:
            raise CheckpointCorruptError(f"{info.path}: {info.problem}")
        return {name: self.read_verified(info, name) for name in info.manifest.files}

    def read_verified(self, info: CheckpointInfo, name: str) -> bytes | memoryview:
        assert info.manifest is not None
        record = info.manifest.files.get(name)
        path = self.storage.join(step_dir_name(info.step), name)
        if record is None:
            raise CheckpointCorruptError(f"{path}: not listed in the manifest")
        try:
            data, found = self.storage.read_hashed(path, hash_name=info.manifest.hash)
        except CheckpointError as exc:
            if self.storage.exists(path):
                raise  # there but unreadable now (storage trouble): not evidence of damage
            raise CheckpointCorruptError(f"{path}: missing ({exc})") from exc
        if found.size != record.size:
            raise CheckpointCorruptError(f"{path}: size {found.size} bytes, manifest says {record.size}")
        if found.digest != record.digest:
            raise CheckpointCorruptError(
                f"{path}: {info.manifest.hash} {found.digest[:12]}… does not match the manifest's {record.digest[:12]}…")
        return data

    # -- restore -----------------------------------------------------------------

    def restore(self, state: CheckpointState, allow_fresh_start: bool = False,
                replicas: NodeCopies | None = None) -> Restored | None:
        """Load the newest valid checkpoint into ``state`` on every rank; None when there is none to load.
        With ``replicas``, a node's replica at least as new as the newest committed checkpoint comes first
        (:mod:`elastic_ddp.checkpoint.replica`), and storage is the fallback.
        Each rank writes what happened: ``resumed``, ``started_fresh`` or ``restore_failed``."""
        try:
            restored = replicas.restore(state, self._newest_committed_here) if replicas is not None else None
            if restored is None:
                restored = self._restore(state, allow_fresh_start)
        except CheckpointError as exc:
            self.events.emit(Event.RESTORE_FAILED, error=str(exc))
            raise
        if restored is not None:
            self.events.emit(Event.RESUMED, step=restored.step, path=restored.path, saved_world_size=restored.world_size,
                             world_size=self.world_size, rank_state_reused=restored.rank_state_reused,
                             source=restored.source)
        return restored

    def newest_committed(self) -> int | None:
        """The newest committed step under the root (its files not read), the same on every rank."""
        newest: builtins.list[Any] = [self._newest_committed_here() if self.rank == 0 else None]
        self._broadcast_from_main(newest)
        return newest[0]

    def _newest_committed_here(self) -> int | None:
        """:meth:`newest_committed`, read by this rank alone (manifests only)."""
        return next((info.step for info in self.list() if info.committed), None)

    def _restore(self, state: CheckpointState, allow_fresh_start: bool) -> Restored | None:
        choice: builtins.list[Any] = [None, None]
        preloaded: dict[str, Any] = {}
        if self.rank == 0:
            choice, preloaded = self._choose_on_main(allow_fresh_start)
        self._broadcast_from_main(choice)
        step, problem = choice
        if step is None:
            if problem and not allow_fresh_start:
                raise NoValidCheckpointError(
                    f"no valid checkpoint under {self.uri}: {problem}. Fix or move them, or pass "
                    "--checkpoint-allow-fresh-start to start from step 0"
                )
            if problem:
                logger.warning("no valid checkpoint under %s (%s); starting fresh as allowed", self.uri, problem)
            self.events.emit(Event.STARTED_FRESH, world_size=self.world_size,
                             reason="no-valid-checkpoint" if problem else "no-checkpoint")
            return None
        info = self.describe(step)
        manifest = info.manifest
        if manifest is None:
            raise CheckpointCorruptError(f"{info.path}: {info.problem}")
        name = manifest.replicated_file
        replicated = preloaded[name] if name in preloaded else deserialize(self.read_verified(info, name), info.path)
        reuse_rank_state = manifest.resumes_rank_state_at(self.world_size)
        rank_local = None
        if reuse_rank_state:
            name = manifest.rank_file(self.rank)
            rank_local = preloaded[name] if name in preloaded else deserialize(self.read_verified(info, name), info.path)
        try:
            state.load_state_dict({"meta": manifest.meta, "replicated": replicated, "rank_local": rank_local})
        except IncompatibleCheckpointError:  # a refusal that names what differs (some are ValueErrors too)
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            # the files verified, so they are what was written: written by something else than this state
            raise CheckpointCorruptError(
                f"{info.path}: its files verify but do not hold a state this run can load ({type(exc).__name__}: {exc})"
            ) from exc
        return Restored(step=step, path=info.path, world_size=manifest.world_size, rank_state_reused=reuse_rank_state)

    def _choose_on_main(self, allow_fresh_start: bool) -> tuple[builtins.list[Any], dict[str, Any]]:
        """Rank 0: the newest checkpoint that verifies, and its own files already decoded (read once).

        Checkpoints newer than the chosen one that do not verify are un-committed, and so are all of
        them when none verifies and a fresh start is allowed: a fresh run commits steps 1, 2, ...
        again, and committed but damaged higher steps would make retention delete each new commit."""
        rejected: builtins.list[tuple[CheckpointInfo, str]] = []
        for info in self.list():
            if not info.manifest_present:
                continue  # an unfinished write: never a candidate, not a defect
            try:
                decoded = self._verify_reading_own(info)
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", info.path, exc)
                self.events.emit(Event.CHECKPOINT_SKIPPED, step=info.step, path=info.path, reason=str(exc))
                rejected.append((info, str(exc)))
                continue
            if rejected:
                logger.warning("falling back to checkpoint %s after %d invalid newer one(s)", info.path, len(rejected))
                for bad, reason in rejected:
                    self._uncommit(bad, reason)
            return [info.step, None], decoded
        if rejected and allow_fresh_start:
            for bad, reason in rejected:
                self._uncommit(bad, reason)
        return [None, "; ".join(reason for _, reason in rejected) or None], {}

    def _verify_reading_own(self, info: CheckpointInfo) -> dict[str, Any]:
        """Verify every file of a checkpoint; rank 0's own files (replicated, rank 0) are read once, verified
        and decoded, while the other ranks' files are verified on threads (hashed, not kept)."""
        if info.manifest is None:
            raise CheckpointCorruptError(f"{info.path}: {info.problem}")
        files = info.manifest.files
        mine = [name for name in (info.manifest.replicated_file, info.manifest.rank_file(0)) if name in files]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=VERIFY_THREADS, thread_name_prefix="elastic-ddp-verify")
        try:
            others = [pool.submit(self._check, info, name) for name in files if name not in mine]
            decoded = {name: deserialize(self.read_verified(info, name), info.path) for name in mine}
            for future in others:
                future.result()
        finally:
            pool.shutdown(cancel_futures=True)
        return decoded

    def _check(self, info: CheckpointInfo, name: str) -> None:
        self.read_verified(info, name)

    def refuse_if_committed(self) -> None:
        """Raise on every rank when the root already holds a committed checkpoint (for a run told not to
        resume: its own commits would collide with those steps, and retention would count them)."""
        newest = self.newest_committed()
        if newest is not None:
            raise CheckpointError(
                f"--no-checkpoint-resume: {self.uri} already holds committed checkpoints (newest: step {newest}); "
                "a run that does not resume needs an empty --checkpoint-dir: move them or choose another directory"
            )

    def _manifest_path(self, step: int) -> str:
        return self.storage.join(step_dir_name(step), MANIFEST_NAME)

    def _uncommit(self, info: CheckpointInfo, reason: str) -> None:
        """Set aside the manifest of a checkpoint that failed verification, keeping it for inspection."""
        manifest_path = self._manifest_path(info.step)
        rejected_path = self.storage.join(step_dir_name(info.step), REJECTED_MANIFEST_NAME)
        self.storage.replace(rejected_path, self.storage.read(manifest_path))
        self.storage.remove(manifest_path)
        logger.warning("un-committed %s (%s); its step will be saved again", info.path, reason)
        self.events.emit(Event.UNCOMMITTED, step=info.step, path=info.path, reason=reason)

    # -- retention ---------------------------------------------------------------

    def retention_plan(self, keep: int | None = None, now: float | None = None) -> builtins.list[str]:
        """Paths retention would remove: committed checkpoints beyond the newest ``keep`` (default: the
        manager's) that verify, and unfinished writes older than the newest commit and idle for
        LEFTOVER_GRACE_S. Only checkpoints that verify are counted (each is read back once per
        manager, unless this manager committed it): a damaged checkpoint never pushes out a good one."""
        return self._retention_scan(keep, now)[0]

    def apply_retention(self, keep: int | None = None, now: float | None = None) -> builtins.list[str]:
        """Un-commit the damaged checkpoints among the newest, and remove what :meth:`retention_plan`
        lists; returns the removed paths."""
        doomed, damaged = self._retention_scan(keep, now)
        for info, reason in damaged:
            self._uncommit(info, reason)
        for path in doomed:
            self._remove_dir(path)
            logger.info("retention removed %s", path)
        return doomed

    def _retention_scan(
        self, keep: int | None, now: float | None
    ) -> tuple[builtins.list[str], builtins.list[tuple[CheckpointInfo, str]]]:
        """(paths to remove, damaged checkpoints met while counting the newest ``keep`` that verify).
        A checkpoint that cannot be read now (storage trouble) is neither counted nor removed."""
        keep = self.keep if keep is None else keep
        now = time.time() if now is None else now
        infos = self.list()
        committed = [info for info in infos if info.committed]
        doomed: builtins.list[str] = []
        damaged: builtins.list[tuple[CheckpointInfo, str]] = []
        counted = 0
        for info in committed:
            if counted >= keep:
                doomed.append(info.path)
                continue
            try:
                self._verify_once(info)
            except CheckpointCorruptError as exc:
                damaged.append((info, str(exc)))
            except CheckpointError as exc:
                logger.warning("retention: could not read %s to verify it, keeping it uncounted: %s", info.path, exc)
            else:
                counted += 1
        if committed:
            newest = committed[0].step
            doomed += [
                info.path
                for info in infos
                if not info.committed and info.step < newest and now - self.storage.mtime(info.path) > LEFTOVER_GRACE_S
            ]
        return doomed, damaged

    def _verify_once(self, info: CheckpointInfo) -> None:
        assert info.manifest is not None
        body = info.manifest.to_json()
        if body not in self._verified:
            self.verify(info)
            self._verified.add(body)

    def existing_step_path(self, step: int) -> str:
        """The path of step ``step``'s directory; CheckpointError when there is none."""
        path = self.storage.join(step_dir_name(step))
        if not self.storage.exists(path) and not self.storage.list_dir(path):
            raise CheckpointError(f"{path} does not exist")
        return path

    def remove_step(self, step: int) -> str:
        """Delete one step directory (committed or not)."""
        path = self.existing_step_path(step)
        self._remove_dir(path)
        return path

    def _remove_dir(self, path: str) -> None:
        """Remove a step directory manifest first: interrupted half-way, it is an unfinished write,
        never a committed checkpoint with files missing."""
        manifest = self.storage.join(path, MANIFEST_NAME)
        if self.storage.exists(manifest):
            self.storage.remove(manifest)
        self.storage.remove_tree(path)

    # -- collectives -------------------------------------------------------------

    def _gather_to_main(self, item: Any) -> builtins.list[Any]:
        return gather_to_main(item, self.rank, self.world_size, self.group)

    def _broadcast_from_main(self, items: builtins.list[Any]) -> None:
        broadcast_from_main(items, self.world_size, self.group)


def gather_to_main(item: Any, rank: int, world_size: int, group: dist.ProcessGroup | None) -> builtins.list[Any]:
    """Every rank's ``item`` on rank 0 (in rank order); other ranks get an empty list."""
    if world_size == 1 or not dist.is_initialized():
        return [item]
    gathered: builtins.list[Any] = [None] * world_size if rank == 0 else []
    dist.gather_object(item, gathered if rank == 0 else None, dst=0, group=group)
    return gathered


def broadcast_from_main(items: builtins.list[Any], world_size: int, group: dist.ProcessGroup | None) -> None:
    """Replace ``items`` on every rank with rank 0's, in place."""
    if world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(items, src=0, group=group)


def _describe(exc: BaseException) -> str:
    """An error as an event states it: the runtime's own messages as they are, others with their type."""
    return str(exc) if isinstance(exc, ElasticDDPError) else f"{type(exc).__name__}: {exc}"


def deserialize(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Load a checkpoint file: tensors and plain containers only, no pickle (see format.py)."""
    return decode(data, where)
