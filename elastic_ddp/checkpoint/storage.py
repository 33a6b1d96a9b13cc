"""Checkpoint storage: a small protocol over a directory tree addressed by ``str`` URIs.

Paths stay strings (a ``pathlib.Path`` would mangle ``s3://``). Every write is atomic: a
reader sees a whole file or no file. :meth:`Storage.create` is create-only, which is what
makes a manifest a commit: of two writers racing for the same step, one gets
:class:`CheckpointConflictError`.

Two implementations: :class:`LocalStorage` for paths and ``file://`` URIs, and
:class:`elastic_ddp.checkpoint.remote.FsspecStorage` for every other URI (``s3://`` first);
:func:`open_storage` picks one and imports fsspec only for a remote URI. Both raise only
:class:`~elastic_ddp.errors.CheckpointError` and its subclasses: a missing file is a
``CheckpointError``, a lost create-only race a ``CheckpointConflictError``, an I/O failure
(disk, network, endpoint, permissions) a :class:`CheckpointStorageError`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from elastic_ddp.checkpoint.files import (
    HASH_NAME,
    READ_CHUNK_BYTES,
    STORED_HASHES,
    Checksum,
    FileRecord,
    basename,
    fsync_dir,
    lower_thread_priority,
    temp_name,
    uninitialised,
    unlink_quietly,
)
from elastic_ddp.errors import CheckpointConflictError, CheckpointError, CheckpointStorageError

__all__ = ["HASH_NAME", "READ_CHUNK_BYTES", "STORED_HASHES", "Checksum", "CheckpointStorageError", "FileRecord", "LocalStorage",
           "Storage", "basename", "is_local", "lower_thread_priority", "open_storage", "uninitialised"]

class Storage(Protocol):
    """Where checkpoints live: :class:`LocalStorage`, or ``remote.FsspecStorage`` for fsspec URIs."""

    root: str

    def join(self, *parts: str) -> str: ...

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        """Write a file atomically (whole or not at all) and return its size and its HASH_NAME digest."""

    def create(self, path: str, data: bytes) -> None:
        """Write a small file only if it does not exist yet.

        Raise CheckpointConflictError if it exists with other content. Finding exactly
        ``data`` there is success: it is this writer's own earlier attempt (a retried
        request whose first response was lost), never another writer's manifest, which
        differs at least in its token.
        """

    def replace(self, path: str, data: bytes) -> None:
        """Write a small file atomically, replacing any previous content."""

    def read(self, path: str) -> bytes:
        """The whole file; CheckpointError when it does not exist."""

    def read_hashed(self, path: str, hash_name: str = HASH_NAME) -> tuple[bytes | memoryview, FileRecord]:
        """The whole file and the size and digest (``hash_name``, one of STORED_HASHES: the manifest's)
        of what was read."""

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``; empty when it does not exist."""

    def exists(self, path: str) -> bool: ...

    def mtime(self, path: str) -> float:
        """Modification time (seconds since the epoch) of a file, or of the newest file in a directory."""

    def remove(self, path: str) -> None:
        """Delete one file."""

    def remove_tree(self, path: str) -> None: ...


class LocalStorage:
    """A local directory: temp file + fsync + ``os.replace`` for data, ``os.link`` for create-only."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root.removeprefix("file://"))

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        with _local_errors("write", path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temp = temp_name(path)
            try:
                record = _write_synced(temp, chunks)
                os.replace(temp, path)
            except BaseException:
                unlink_quietly(temp)
                raise
            fsync_dir(os.path.dirname(path))
        return record

    def create(self, path: str, data: bytes) -> None:
        with _local_errors("create", path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temp = temp_name(path)
            try:
                _write_synced(temp, [data])
                _link_exclusive(temp, path, data)
            finally:
                unlink_quietly(temp)
            fsync_dir(os.path.dirname(path))

    def replace(self, path: str, data: bytes) -> None:
        self.write(path, [data])

    def read(self, path: str) -> bytes:
        with _local_errors("read", path):
            with open(path, "rb") as handle:
                return handle.read()

    def read_hashed(self, path: str, hash_name: str = HASH_NAME) -> tuple[memoryview, FileRecord]:
        """The whole file, writable, with its size and ``hash_name`` digest; each chunk is hashed on
        helper threads while the next is read (:class:`Checksum`)."""
        with _local_errors("read", path):
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                view = uninitialised(size)
                got = 0
                with Checksum(hash_name) as checksum:
                    while got < size:
                        count = handle.readinto(view[got : got + READ_CHUNK_BYTES])
                        if not count:  # cut short meanwhile: return what is there; sizes will differ
                            break
                        checksum.update(view[got : got + count])
                        got += count
                    return view[:got], checksum.record()

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise CheckpointStorageError(f"cannot list {path}: {exc}") from exc

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mtime(self, path: str) -> float:
        with _local_errors("stat", path):
            return os.stat(path).st_mtime

    def remove(self, path: str) -> None:
        with _local_errors("remove", path):
            os.unlink(path)
            fsync_dir(os.path.dirname(path))

    def remove_tree(self, path: str) -> None:
        with _local_errors("remove", path):
            shutil.rmtree(path)


@contextmanager
def _local_errors(action: str, path: str) -> Iterator[None]:
    """Raise OSErrors as the storage errors of the protocol, naming the path."""
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} does not exist") from exc
    except OSError as exc:
        raise CheckpointStorageError(f"cannot {action} {path}: {exc}") from exc


def _write_synced(path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
    with Checksum() as checksum, open(path, "wb") as handle:
        behind = WriteBehind(handle.fileno())
        for chunk in chunks:
            checksum.update(chunk)  # hashed on the side while this chunk is written
            handle.write(chunk)
            behind.wrote(memoryview(chunk).nbytes)
        handle.flush()
        os.fsync(handle.fileno())
        return checksum.record()


class WriteBehind:
    """Starts the disk writes of a file while it is still being written (Linux ``sync_file_range``).

    Without it every byte waits in the page cache until the final ``fsync``, which then
    writes it all while nothing else happens. Here each 16 MiB window is handed to the disk
    as soon as it is complete, and the writer waits for the window BEHIND windows back, so the
    disk and the writer work at once and the file's dirty memory stays under about 256 MiB.
    The disk keeps that many writes in flight: waiting for the window two back (32 MiB) kept
    this project's virtio disk's queue so short that a save took up to 4x as long as a
    plain buffered write (docs/performance.md, "Checkpoints"). Elsewhere a no-op.
    """

    WINDOW_BYTES = 16 << 20
    BEHIND = 16
    _START, _WAIT = 2, 1 | 2 | 4  # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self.started = 0  # bytes handed to the disk so far, in whole windows

    def wrote(self, count: int) -> None:
        self.written += count
        if _sync_file_range is None:
            return
        while self.written - self.started >= self.WINDOW_BYTES:
            _sync_file_range(self.fd, self.started, self.WINDOW_BYTES, self._START)
            behind = self.started - self.BEHIND * self.WINDOW_BYTES
            if behind >= 0:
                _sync_file_range(self.fd, behind, self.WINDOW_BYTES, self._WAIT)
            self.started += self.WINDOW_BYTES


def _load_sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none; errors are ignored (a hint)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def _link_exclusive(temp: str, path: str, data: bytes) -> None:
    """Give ``temp`` the name ``path`` only if ``path`` does not exist (atomic, create-only)."""
    try:
        os.link(temp, path)
    except FileExistsError as exc:
        if _holds(path, data):
            return
        raise CheckpointConflictError(f"{path} already exists: another writer committed first") from exc


def _holds(path: str, data: bytes) -> bool:
    with open(path, "rb") as handle:
        return handle.read() == data


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def open_storage(uri: str, options: Mapping[str, Any] | None = None) -> Storage:
    """The storage for a checkpoint root URI: a local path, ``file://`` or any fsspec URI (``s3://...``).

    ``options`` are fsspec storage options for remote URIs (never logged); see
    :mod:`elastic_ddp.checkpoint.remote` for what they may hold and for the defaults.
    """
    if not uri:
        raise CheckpointError("no checkpoint directory configured (--checkpoint-dir)")
    if is_local(uri):
        if options:
            raise CheckpointError(f"--checkpoint-storage-options apply to remote URIs only, not to {uri!r}")
        return LocalStorage(uri)
    from elastic_ddp.checkpoint.remote import FsspecStorage  # imports fsspec: only for remote URIs

    return FsspecStorage(uri, options or {})
