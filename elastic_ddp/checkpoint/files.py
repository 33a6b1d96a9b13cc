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
from dataclasses import dataclass

import torch

HASH_NAME = "sha256"

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


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says about one data file: its size and its digest under the manifest's ``hash``
    (SHA-256 for stored checkpoints; node-memory replicas use XXH3-128)."""

    size: int
    digest: str


class Checksum:
    """Size and SHA-256 of bytes as they stream past, for :meth:`Storage.write`.

    Large chunks are hashed on a helper thread while the caller writes the next one: hashlib
    and file/socket writes both release the GIL, so a save costs about the slower of hashing
    and writing instead of their sum. Chunks are not copied; the caller keeps them unchanged
    until :meth:`record` (staged or paused state, so they are). Use as a context manager so
    the thread ends on every path.

    The helper thread runs at the priority of the thread that feeds it (Linux threads inherit
    their creator's niceness): an asynchronous save's writer runs at BACKGROUND_NICE, so its
    hashing does too, while a restore or a synchronous save, which the training loop waits for,
    hashes at the loop's own priority instead of yielding the CPU to every other process.
    """

    PARALLEL_MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        self.size = 0
        self._hasher = hashlib.sha256()
        self._queue: queue.Queue[memoryview | None] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Checksum:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._finish()

    def update(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        self.size += view.nbytes
        if self._queue is None and view.nbytes < self.PARALLEL_MIN_BYTES:
            self._hasher.update(view)
            return
        if self._queue is None:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._hash_queued, name="elastic-ddp-sha256", daemon=True)
            self._thread.start()
        self._queue.put(view)  # keeps order: once the thread runs, every chunk goes through it

    def record(self) -> FileRecord:
        self._finish()
        return FileRecord(size=self.size, digest=self._hasher.hexdigest())

    def _hash_queued(self) -> None:
        assert self._queue is not None
        while (view := self._queue.get()) is not None:
            self._hasher.update(view)

    def _finish(self) -> None:
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


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
