"""``elastic-ddp ckpt export``: one part of a checkpoint as a file that needs no elastic_ddp to load.

``model.safetensors`` is a plain safetensors file of the model's ``state_dict`` (no elastic_ddp
metadata): ``model.load_state_dict(safetensors.torch.load_file(path))``. ``model.pt`` is
``torch.save`` of the chosen part: ``torch.load(path, weights_only=True)``. The checkpoint's
file is verified against the manifest before anything is written, and the output is written
to a temporary name, synced and renamed: it appears whole or not at all.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, cast

import torch

from elastic_ddp.checkpoint.files import fsync_dir, temp_name, unlink_quietly
from elastic_ddp.checkpoint.format import encode_chunks, flatten
from elastic_ddp.errors import CheckpointError

SUFFIXES = (".safetensors", ".pt")
PARTS = ("model", "optimizer", "all")
PROGRESS_MIN_BYTES = 64 << 20
"""Files at least this large get progress lines on stderr while they are read or written."""


class ExportError(CheckpointError):
    """What ``ckpt export`` cannot do with the checkpoint it was given (the message says what to do instead)."""


def check_target(path: str, force: bool = False) -> str:
    """The output's kind (its suffix), before anything is read. ExportError for any other suffix, a directory
    that does not exist or cannot be written, or an existing file without ``force``."""
    suffix = next((suffix for suffix in SUFFIXES if path.endswith(suffix)), None)
    if suffix is None:
        raise ExportError(f"--to {path}: the output must end in .safetensors or .pt")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ExportError(f"--to {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ExportError(f"--to {path}: the directory {directory} is not writable")
    if os.path.isdir(path):
        raise ExportError(f"--to {path}: is a directory")
    if os.path.exists(path) and not force:
        raise ExportError(f"--to {path}: the file exists; pass --force to replace it")
    return suffix


def select(replicated: Any, what: str, where: str) -> Any:
    """The part of a replicated state (``model``, ``optimizer`` or ``all``) to export."""
    if what == "all":
        return replicated
    part = replicated.get(what) if isinstance(replicated, dict) else None
    if part is None:
        if what == "optimizer" and isinstance(replicated, dict) and "optimizer_groups" in replicated:
            raise ExportError(f"{where}: the optimizer state is sharded over the rank files (ZeroRedundancyOptimizer); "
                              "the replicated file holds only the model (--what model) and the param groups (--what all)")
        raise ExportError(f"{where}: the checkpoint holds no {what} state")
    return part


def flat_tensors(obj: Any, what: str, where: str, instead: str) -> dict[str, torch.Tensor]:
    """``obj`` as the ``{name: tensor}`` map a safetensors file holds; ExportError naming ``instead`` (a .pt
    output) when it is not one."""
    if isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return obj
    label = "replicated" if what == "all" else what
    raise ExportError(
        f"{where}: the {label} state is not a flat map of named tensors (it holds nested dicts, integer keys or "
        f"non-tensor values), which a .safetensors file cannot hold; export it with --to {instead} "
        "(loads with torch.load(path, weights_only=True))"
    )


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], progress: Progress) -> int:
    """Write ``tensors`` as a plain safetensors file, atomically; checked with safetensors' own reader first."""
    from safetensors import safe_open

    def check(temp: str) -> None:
        with safe_open(temp, framework="pt") as handle:
            if set(handle.keys()) != set(tensors):
                raise ExportError(f"{path}: safetensors reads other names than were written")

    def write(handle: IO[bytes]) -> None:
        for chunk in progress.track(encode_chunks(flatten(tensors), metadata={})):
            handle.write(chunk)

    return _write_atomically(path, write, check)


def write_torch(path: str, obj: Any, progress: Progress) -> int:
    """``torch.save`` of ``obj``, atomically."""
    def write(handle: IO[bytes]) -> None:
        torch.save(obj, cast(IO[bytes], _Counting(handle, progress)))

    return _write_atomically(path, write, lambda temp: None)


def _write_atomically(path: str, write: Any, check: Any) -> int:
    directory = os.path.dirname(os.path.abspath(path))
    temp = temp_name(path)
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        check(temp)
        os.replace(temp, path)
    except OSError as exc:
        unlink_quietly(temp)
        raise ExportError(f"cannot write {path}: {exc}") from exc
    except BaseException:
        unlink_quietly(temp)
        raise
    try:
        fsync_dir(directory)
    except OSError as exc:  # the file is in place; a directory that cannot be synced is worth a word, not a failure
        print(f"elastic-ddp: warning: {path} written, but syncing {directory} failed: {exc}", file=sys.stderr)
    return os.path.getsize(path)


class _Counting:
    """A binary file that tells ``progress`` how many bytes went through it (what torch.save writes to)."""

    def __init__(self, handle: IO[bytes], progress: Progress) -> None:
        self._handle = handle
        self._progress = progress

    def write(self, data: bytes) -> int:
        written = self._handle.write(data)
        self._progress.advance(len(memoryview(data).cast("B")))
        return written

    def flush(self) -> None:
        self._handle.flush()


class Progress:
    """``label: 45% (362 of 806 MB)`` lines on ``stream``, for totals of at least PROGRESS_MIN_BYTES
    (in place on a terminal, every 10% otherwise)."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.quiet = total < PROGRESS_MIN_BYTES
        self._tenths = -1  # the last tenth of the total shown
        self._started = time.monotonic()

    def track(self, chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        for chunk in chunks:
            yield chunk
            self.advance(memoryview(chunk).nbytes)

    def advance(self, count: int) -> None:
        self.done += count
        tenths = min(10 * self.done // self.total, 10) if self.total else 10
        if self.quiet or tenths <= self._tenths:
            return
        self._tenths = tenths
        percent = min(100 * self.done // self.total, 100)
        terminal = self.stream.isatty()
        line = (f"{self.label}: {percent:3d}% ({self.done / 1e6:.0f} of {self.total / 1e6:.0f} MB, "
                f"{time.monotonic() - self._started:.1f} s)")
        end = "\n" if tenths == 10 or not terminal else ""
        print(("\r" if terminal else "") + line, end=end, file=self.stream, flush=True)
