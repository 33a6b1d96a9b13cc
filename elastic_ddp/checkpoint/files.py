"""What every checkpoint store shares: a data file's record (size and digest), the checksum that streams
beside a write, the priority of background threads, uninitialised read buffers, and the atomic-write
helpers of local files. It imports no store, so each store and the exporter build on it."""

from __future__ import annotations

import ctypes
import hashlib
import os
import posixpath
import queue
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LEGACY_HASH_NAME = "sha256"
"""SHA-256 of the whole file: the digest of checkpoints written before the tree hash; still verified."""
TREE_HASH_NAME = "sha256-tree-4m"
"""SHA-256 of every 4 MiB piece of the file, then SHA-256 over the size and those digests (:class:`Checksum`)."""
HASH_NAME = TREE_HASH_NAME
"""The digest of the files of every checkpoint written now."""
STORED_HASHES = (TREE_HASH_NAME, LEGACY_HASH_NAME)
"""The digests a stored checkpoint's manifest may name (node-memory replicas use XXH3-128 instead)."""

PIECE_BYTES = 4 << 20
"""The tree hash's piece: part of its definition (its name says it), never to be changed under that name."""
_TREE_DOMAIN = b"elastic_ddp sha256-tree-4m\x00"
MAX_HASH_THREADS = 4

READ_CHUNK_BYTES = 16 << 20
"""Reads of large files go in chunks this size, each hashed while the next is read."""


BACKGROUND_NICE = 10
"""Scheduling niceness of the threads that hash and write checkpoints behind the training loop."""


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Make the calling thread yield the CPU to the training loop's threads (Linux; elsewhere a no-op).

    Hashing and writing a checkpoint in the background use a core each; on a node whose cores all
    train, they would slow every step they overlap. At niceness 10 they run in the time the
    training threads leave idle (a thread's niceness can be raised, never lowered back, so only
    threads that do nothing else call this). Threads they start inherit it.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:  # a sandbox that forbids it: run at the inherited priority
        pass


def hash_threads() -> int:
    """Helper threads that hash a file's pieces: one per core this process may run on but the one the feeding
    thread writes or reads on (at least one, at most MAX_HASH_THREADS). The feeding thread hashes too once
    its stream has ended (:meth:`Checksum.record`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_HASH_THREADS, cores - 1))


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says about one data file: its size and its digest under the manifest's ``hash``
    (HASH_NAME for checkpoints written now, LEGACY_HASH_NAME for older ones; node-memory replicas use
    XXH3-128)."""

    size: int
    digest: str


class Checksum:
    """Size and digest of bytes as they stream past, for :meth:`Storage.write` and the reads that verify.

    ``hash_name`` is one of STORED_HASHES. Under the tree hash (TREE_HASH_NAME, what HASH_NAME
    names) the stream is cut into pieces of PIECE_BYTES at fixed offsets from its start, however
    the chunks fall (the last piece is shorter; an empty stream has none), and the digest is
    ``SHA-256(_TREE_DOMAIN || size as 8 bytes little endian || SHA-256 of each piece, in order)``.
    Each whole piece is queued for :func:`hash_threads` helper threads as soon as it is complete;
    :meth:`record` hashes the last one and then, on the feeding thread, whatever no helper has taken
    yet. hashlib releases the GIL, so the pieces hash on the other cores while the caller writes or
    reads the next chunk, and on all of them once it waits: a save costs about its write instead of
    one core's SHA-256 of the whole file. A changed, lost, added or moved byte changes a piece's
    digest or the size, and with it the file's digest: two files with one digest would be a SHA-256
    collision, as for SHA-256 of the whole file. Under LEGACY_HASH_NAME (SHA-256 of the whole
    stream, what checkpoints written before the tree hash name) chunks from PARALLEL_MIN_BYTES on
    are hashed in order on one helper thread.

    Chunks are not copied: the caller keeps them unchanged until :meth:`record` (staged or paused
    state, or the buffer a read fills, so they are). Use as a context manager so that the threads
    end on every path; leaving it without :meth:`record` drops the pieces not hashed yet.

    The helper threads run at the priority of the thread that feeds them (Linux threads inherit
    their creator's niceness): an asynchronous save's writer runs at BACKGROUND_NICE, so its
    hashing does too, while a restore or a synchronous save, which the training loop waits for,
    hashes at the loop's own priority instead of yielding the CPU to every other process.
    """

    PARALLEL_MIN_BYTES = 1 << 20
    """Under LEGACY_HASH_NAME, the chunk size from which hashing moves to the helper thread (smaller
    chunks hash inline until then)."""

    def __init__(self, hash_name: str = HASH_NAME) -> None:
        if hash_name not in STORED_HASHES:
            raise ValueError(f"hash {hash_name!r} is not one of {', '.join(STORED_HASHES)}")
        self.hash_name = hash_name
        self.size = 0
        self._tree = hash_name == TREE_HASH_NAME
        self._hasher = hashlib.sha256()  # LEGACY_HASH_NAME: the whole stream
        self._piece: list[memoryview] = []  # TREE_HASH_NAME: the piece being filled, as views of the chunks
        self._piece_bytes = 0
        # What each job handed to the helpers returned, by its index (a piece's SHA-256; None for a legacy
        # update): the feeding thread appends a job's slot before queueing it, the helper that runs it
        # only fills that slot, and the feeding thread reads them after the helpers have ended.
        self._results: list[Any] = []
        self._queue: queue.SimpleQueue[tuple[int, Callable[[Any], Any], Any] | None] | None = None
        self._threads: list[threading.Thread] = []
        self._failure: BaseException | None = None
        self._dropped = False

    def __enter__(self) -> Checksum:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._dropped = True  # without record(): nothing waits for the digest, so the helpers skip what is left
        self._finish()

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        view = memoryview(chunk)
        if not view.nbytes:  # (a view with a 0 in its shape cannot be cast)
            return
        view = view.cast("B")  # any C-contiguous buffer, counted and cut in bytes
        self.size += view.nbytes
        if not self._tree:
            if self._queue is None and view.nbytes < self.PARALLEL_MIN_BYTES:
                self._hasher.update(view)
            else:  # one helper keeps the order: once it runs, every chunk goes through it
                self._submit(self._hasher.update, view)
            return
        while view.nbytes:
            take = min(PIECE_BYTES - self._piece_bytes, view.nbytes)
            self._piece.append(view[:take])
            self._piece_bytes += take
            view = view[take:]
            if self._piece_bytes == PIECE_BYTES:
                self._submit(_sha256_of, self._piece)
                self._piece, self._piece_bytes = [], 0

    def record(self) -> FileRecord:
        """The size and digest of every byte passed to :meth:`update`; raises what hashing raised."""
        last = _sha256_of(self._piece) if self._piece else b""  # the last, shorter piece, while the helpers finish
        if self._tree and self._queue is not None:  # then the pieces no helper has taken yet: the order is free
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._run(*job)
        self._finish()
        if self._failure is not None:
            raise self._failure
        if any(result is _PENDING for result in self._results):  # never a digest that leaves bytes out
            raise RuntimeError(f"{self.hash_name}: a part of the stream was never hashed")
        if not self._tree:
            return FileRecord(size=self.size, digest=self._hasher.hexdigest())
        top = hashlib.sha256(_TREE_DOMAIN)
        top.update(self.size.to_bytes(8, "little"))
        for digest in self._results:
            top.update(digest)
        top.update(last)
        return FileRecord(size=self.size, digest=top.hexdigest())

    def _submit(self, work: Callable[[Any], Any], job: Any) -> None:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._start_helpers(hash_threads() if self._tree else 1)
        self._results.append(_PENDING)
        if self._threads:
            self._queue.put((len(self._results) - 1, work, job))
        else:  # no helper thread could start: hash here
            self._run(len(self._results) - 1, work, job)

    def _start_helpers(self, count: int) -> None:
        """Start up to ``count`` helpers from the feeding thread (so they get its priority)."""
        for _ in range(count):
            thread = threading.Thread(target=self._help, name=f"elastic-ddp-{self.hash_name}", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # out of threads: the ones started do the work, or the feeding thread does
                break
            self._threads.append(thread)

    def _help(self) -> None:
        assert self._queue is not None
        while (job := self._queue.get()) is not None:
            if not self._dropped:
                self._run(*job)

    def _run(self, index: int, work: Callable[[Any], Any], job: Any) -> None:
        try:
            self._results[index] = work(job)
        except BaseException as exc:  # noqa: BLE001 - raised by record(), on the feeding thread
            self._failure = exc

    def _finish(self) -> None:
        if self._queue is not None:
            for _ in self._threads:
                self._queue.put(None)
            for thread in self._threads:
                thread.join()
            self._threads.clear()


_PENDING = object()
"""A job's result until a helper has run it."""


def _sha256_of(views: list[memoryview]) -> bytes:
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)
    return hasher.digest()


def file_record(data: bytes | bytearray | memoryview, hash_name: str = HASH_NAME) -> FileRecord:
    """Size and digest of bytes held whole (under the tree hash, their pieces hash on every core)."""
    with Checksum(hash_name) as checksum:
        checksum.update(data)
        return checksum.record()


def uninitialised(size: int) -> memoryview:
    """Writable, uninitialised memory for ``size`` bytes of a file (only the bytes read are ever exposed).

    It comes from torch's CPU allocator, which hands out memory that is neither zeroed first (as a
    ``bytearray`` is) nor faulted in page by page as it is read into (as anonymous ``mmap`` memory is);
    docs/performance.md has the measurement.
    """
    tensor = torch.empty(max(size, 1), dtype=torch.uint8)
    array = (ctypes.c_char * size).from_address(tensor.data_ptr())
    array._owner = tensor  # type: ignore[attr-defined]  # the memory lives as long as any view of it
    return memoryview(array).cast("B")


def temp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))
