"""Checkpoint storage: a small protocol over a directory tree addressed by ``str`` URIs.

Paths stay strings (a ``pathlib.Path`` would mangle ``s3://``). Every write is atomic: a
reader sees a whole file or no file. :meth:`Storage.create` is create-only, which is what
makes a manifest a commit: of two writers racing for the same step, one gets
:class:`CheckpointConflictError`.
"""

from __future__ import annotations

import hashlib
import shutil
import os
import posixpath
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_ddp.errors import CheckpointConflictError, CheckpointError

HASH_NAME = "sha256"


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says about one data file."""

    size: int
    sha256: str


class Storage(Protocol):
    """Where checkpoints live. Implementations: :class:`LocalStorage` (and fsspec URIs)."""

    root: str

    def join(self, *parts: str) -> str: ...

    def write(self, path: str, chunks: Iterable[bytes]) -> FileRecord:
        """Write a file atomically (whole or not at all) and return its size and checksum."""

    def create(self, path: str, data: bytes) -> None:
        """Write a small file only if it does not exist yet; raise CheckpointConflictError if it does."""

    def replace(self, path: str, data: bytes) -> None:
        """Write a small file atomically, replacing any previous content."""

    def read(self, path: str) -> bytes: ...

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``; empty when it does not exist."""

    def exists(self, path: str) -> bool: ...

    def mtime(self, path: str) -> float:
        """Modification time (seconds since the epoch) of a file or directory."""

    def remove(self, path: str) -> None:
        """Delete one file."""

    def remove_tree(self, path: str) -> None: ...


class LocalStorage:
    """A local directory: temp file + fsync + ``os.replace`` for data, ``os.link`` for create-only."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root.removeprefix("file://"))

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def write(self, path: str, chunks: Iterable[bytes]) -> FileRecord:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = self._temp_name(path)
        hasher = hashlib.sha256()
        size = 0
        try:
            with open(temp, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                    hasher.update(chunk)
                    size += len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            _unlink_quietly(temp)
            raise
        _fsync_dir(os.path.dirname(path))
        return FileRecord(size=size, sha256=hasher.hexdigest())

    def create(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = self._temp_name(path)
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temp, path)  # atomic and create-only: fails if `path` exists
            except FileExistsError as exc:
                raise CheckpointConflictError(f"{path} already exists: another writer committed first") from exc
        finally:
            _unlink_quietly(temp)
        _fsync_dir(os.path.dirname(path))

    def replace(self, path: str, data: bytes) -> None:
        self.write(path, [data])

    def read(self, path: str) -> bytes:
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path} does not exist") from exc

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mtime(self, path: str) -> float:
        return os.stat(path).st_mtime

    def remove(self, path: str) -> None:
        os.unlink(path)
        _fsync_dir(os.path.dirname(path))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path)

    @staticmethod
    def _temp_name(path: str) -> str:
        return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def open_storage(uri: str, options: Mapping[str, Any] | None = None) -> Storage:
    """The storage for a checkpoint root URI: a local path or ``file://`` URI.

    ``options`` are fsspec storage options for remote URIs (never logged).
    """
    if not uri:
        raise CheckpointError("no checkpoint directory configured (--checkpoint-dir)")
    if is_local(uri):
        return LocalStorage(uri)
    raise CheckpointError(f"unsupported checkpoint URI {uri!r}: use a local path or file:// URI")


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))
