"""Map-style datasets over shards in any fsspec storage, read through the node's piece cache.

Sample ``i`` of the dataset is sample ``i`` of the global order the :class:`~elastic_ddp.data.ElasticSampler`
draws, so the cursor's guarantees (no sample repeated or skipped across kills and world-size changes) hold
unchanged; where the bytes come from is this module's business alone.

- :class:`TokenWindows`: windows of ``context + 1`` tokens of flat token shards, as
  ``(inputs[context], targets[context], i)`` int64 tensors;
- :class:`TarSamples`: WebDataset-layout tar shards; each sample's members are read with range reads and
  handed to ``decode({ext: bytes}, i)``, which returns the item.

Both plug into the trainer (``Built.train_data``) and the library path (``ElasticSampler(len(dataset), ...)``),
and both can prefetch what this rank's next steps need (:mod:`elastic_ddp.shards.prefetch`).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import fsspec
import numpy as np
import torch
from torch.utils.data import Dataset

from elastic_ddp.errors import DataError
from elastic_ddp.shards.cache import ShardCache
from elastic_ddp.shards.index import ShardIndex, load_index, window_counts

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "ELASTIC_DDP_SHARD_CACHE_DIR"
DEFAULT_CACHE_BYTES = 8 << 30


def default_cache_dir() -> str:
    """``$ELASTIC_DDP_SHARD_CACHE_DIR``, else ``<temp dir>/elastic_ddp-shards-<uid>``: one cache per node and user."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"elastic_ddp-shards-{os.getuid()}")


ByteRange = tuple[int, int, int]
"""``(shard number, start, stop)``: bytes ``[start, stop)`` of one shard."""


class ShardReader:
    """The shards of one index, read through a node-local :class:`ShardCache`. Safe to pickle into DataLoader
    workers: each process opens its own filesystem and shares the cache directory."""

    def __init__(self, uri: str, *, cache_dir: str = "", cache_bytes: int = DEFAULT_CACHE_BYTES,
                 storage_options: Mapping[str, Any] | None = None, index: ShardIndex | None = None,
                 prefetch_steps: int = 8, prefetch_inflight: int = 4, read_timeout_s: float = 300.0) -> None:
        if prefetch_steps < 0 or prefetch_inflight < 1:
            raise DataError(f"prefetch_steps must be >= 0 and prefetch_inflight >= 1 (got {prefetch_steps}, {prefetch_inflight})")
        self.uri = uri.rstrip("/")
        self.prefetch_steps = prefetch_steps
        """Steps ahead whose pieces :meth:`ShardedDataset.prefetch` fetches (0: none)."""
        self.prefetch_inflight = prefetch_inflight
        self.read_timeout_s = read_timeout_s
        """How long a read from storage is retried (with backoff) before it fails: an outage costs time, not the run."""
        self.read_retries = 0
        """Reads from storage this process retried."""
        self.storage_options = dict(storage_options or {})
        self._fs: fsspec.AbstractFileSystem | None = None
        self._fs_pid = -1
        try:
            self.index = index if index is not None else load_index(self.uri, self.fs)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read the shard index at {self.uri}: {type(exc).__name__}: {exc}") from exc
        # one cache and one budget per node directory, whatever the datasets: each keeps its pieces under its digest
        self.cache = ShardCache(cache_dir or default_cache_dir(), cache_bytes)
        self._root = self.fs._strip_protocol(self.uri)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = fsspec.core.url_to_fs(self.uri, **self.storage_options)[0]
            self._fs_pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_fs_pid": -1}

    def piece_key(self, shard: int, piece: int) -> str:
        return f"{self.index.digest[:16]}/{self.index.shards[shard].name}.{piece:06d}"

    def ensure(self, shard: int, piece: int, hold_s: float = 0.0) -> str:
        """The local path of a verified piece, fetched if the node does not hold it yet (``hold_s``: see
        :meth:`ShardCache.get`)."""
        entry = self.index.shards[shard]
        start, stop = self.index.piece_range(entry, piece)
        path = f"{self._root}/{entry.name}"
        return str(self.cache.get(self.piece_key(shard, piece), stop - start, entry.pieces[piece],
                                  lambda: self._fetch(path, start, stop), hold_s=hold_s))

    def _fetch(self, path: str, start: int, stop: int) -> bytes:
        deadline, delay = time.monotonic() + self.read_timeout_s, 0.1
        for attempt in itertools.count(1):
            try:
                return bytes(self.fs.cat_file(path, start=start, end=stop))
            except FileNotFoundError as exc:
                raise DataError(f"shard {path} is gone from storage") from exc
            except PermissionError as exc:
                raise DataError(f"shard {path}: access denied ({exc})") from exc
            except Exception as exc:  # transports raise many kinds (OSError, botocore's, aiohttp's)
                if time.monotonic() + delay > deadline:
                    raise DataError(f"reading bytes {start}-{stop} of shard {path} failed for {self.read_timeout_s:.0f} s "
                                    f"({attempt} attempts): {type(exc).__name__}: {exc}") from exc
                self.read_retries += 1
                if attempt == 1 or attempt % 10 == 0:
                    logger.warning("reading bytes %d-%d of shard %s failed (attempt %d: %s: %s); retrying for up to "
                                   "%.0f s", start, stop, path, attempt, type(exc).__name__, exc, deadline - time.monotonic())
                time.sleep(delay)
                delay = min(2 * delay, 1.0)  # an outage that ends is noticed within a second
        raise AssertionError("not reached")

    def read(self, shard: int, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of a shard, from verified pieces."""
        parts = []
        for piece in self.index.pieces_of(start, stop):
            first, _ = self.index.piece_range(self.index.shards[shard], piece)
            lo, hi = max(start, first) - first, min(stop, first + self.index.piece_bytes) - first
            parts.append(_read_piece(self, shard, piece, lo, hi))
        return b"".join(parts)

    def pieces(self, ranges: list[ByteRange]) -> list[tuple[int, int]]:
        """The ``(shard, piece)`` pairs that hold ``ranges``, in order, each once."""
        seen: dict[tuple[int, int], None] = {}
        for shard, start, stop in ranges:
            for piece in self.index.pieces_of(start, stop):
                seen.setdefault((shard, piece), None)
        return list(seen)


def _read_piece(reader: ShardReader, shard: int, piece: int, lo: int, hi: int) -> bytes:
    for _ in range(3):  # evicted between ensure and open by another process: fetch it again
        path = reader.ensure(shard, piece)
        try:
            with open(path, "rb") as handle:
                handle.seek(lo)
                return handle.read(hi - lo)
        except FileNotFoundError:
            continue
    raise DataError(f"shard piece {reader.piece_key(shard, piece)} was evicted three times before it could be "
                    "read: the shard cache budget is too small for this node's readers")


class ShardedDataset(Dataset):
    """What the two shard datasets share: the reader, and the byte ranges a sample needs (for prefetch)."""

    reader: ShardReader

    def __len__(self) -> int:
        raise NotImplementedError

    def byte_ranges(self, index: int) -> list[ByteRange]:
        raise NotImplementedError

    def prefetch(self, sampler: Any, *, steps: int | None = None, inflight: int | None = None,
                 max_bytes: int = 0) -> AbstractContextManager[Any]:
        """Start fetching, in the background, the pieces this rank's next ``steps`` steps need (default: the
        reader's ``prefetch_steps``; 0: nothing is started); see :class:`~elastic_ddp.shards.prefetch.Prefetcher`.
        Returns a context manager that stops it. The trainer calls this itself; the library path writes
        ``with dataset.prefetch(sampler):`` around its loop."""
        from elastic_ddp.shards.prefetch import Prefetcher

        steps = self.reader.prefetch_steps if steps is None else steps
        if steps == 0:
            return nullcontext()
        return Prefetcher(self, sampler, steps=steps, inflight=inflight or self.reader.prefetch_inflight,
                          max_bytes=max_bytes).start()


class TokenWindows(ShardedDataset):
    """Windows of ``context + 1`` tokens that overlap by one, within each token shard: sample ``i`` is
    ``(tokens[s : s+context], tokens[s+1 : s+context+1], i)`` as int64 tensors."""

    def __init__(self, reader: ShardReader, context: int) -> None:
        if reader.index.kind != "tokens":
            raise DataError(f"{reader.uri} holds {reader.index.kind} shards, not token shards")
        if context < 1:
            raise DataError(f"context must be >= 1, got {context}")
        self.reader, self.context = reader, context
        counts = window_counts(reader.index, context)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._dtype = np.dtype(reader.index.dtype).newbyteorder("<")
        if self._starts[-1] == 0:
            raise DataError(f"{reader.uri}: no shard holds a window of {context + 1} tokens")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def byte_ranges(self, index: int) -> list[ByteRange]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range (0..{len(self) - 1})")
        shard = bisect.bisect_right(self._starts, index) - 1
        first = (index - int(self._starts[shard])) * self.context * self._dtype.itemsize
        return [(shard, first, first + (self.context + 1) * self._dtype.itemsize)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        ((shard, start, stop),) = self.byte_ranges(index)
        tokens = torch.from_numpy(np.frombuffer(self.reader.read(shard, start, stop), dtype=self._dtype).astype(np.int64))
        return tokens[:-1], tokens[1:], index


class TarSamples(ShardedDataset):
    """Samples of WebDataset-layout tar shards: item ``i`` is ``decode({ext: bytes}, i)``."""

    def __init__(self, reader: ShardReader, decode: Callable[[dict[str, bytes], int], Any]) -> None:
        if reader.index.kind != "tar":
            raise DataError(f"{reader.uri} holds {reader.index.kind} shards, not tar shards")
        self.reader, self.decode = reader, decode
        self._where = [(shard, sample) for shard, entry in enumerate(reader.index.shards) for sample in range(len(entry.samples))]

    def __len__(self) -> int:
        return len(self._where)

    def byte_ranges(self, index: int) -> list[ByteRange]:
        shard, sample = self._where[index]
        _, members = self.reader.index.shards[shard].samples[sample]
        return [(shard, member.offset, member.offset + member.size) for member in members]

    def key(self, index: int) -> str:
        shard, sample = self._where[index]
        return self.reader.index.shards[shard].samples[sample][0]

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range (0..{len(self) - 1})")
        shard, sample = self._where[index]
        _, members = self.reader.index.shards[shard].samples[sample]
        return self.decode({m.ext: self.reader.read(shard, m.offset, m.offset + m.size) for m in members}, index)
