"""The index of a sharded dataset: which shards, their sizes and digests, and where each sample lies.

An index is one JSON file, ``index.json``, stored beside the shards (docs/design.md, "Sharded data"). It is
built once (:func:`build_index`, ``elastic-ddp shards index``) and read by every process that serves the
data. Everything in it is checked on load, since it comes from storage:

- ``kind`` ``tokens``: flat token shards (raw little-endian integers of ``dtype``, the ``.bin`` layout
  tokenisers write). A shard of ``tokens`` tokens holds ``(tokens - 1) // context`` windows of
  ``context + 1`` tokens that overlap by one; windows never cross shards.
- ``kind`` ``tar``: POSIX tar shards in the WebDataset layout: a sample is the run of members that share a
  key (the member name up to its first dot), e.g. ``000017.input.npy`` and ``000017.target.cls``. The index
  keeps each member's data offset and size, so a sample is read with range reads and no tar parsing.

Every shard is split into fixed-size *pieces* (``piece_bytes``, the last one shorter). Each piece has its
own SHA-256: a node caches and verifies pieces, so it downloads the parts of shards its samples need and
never serves a byte that does not match the index.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from elastic_ddp.errors import DataError

INDEX_NAME = "index.json"
FORMAT = "elastic_ddp.shards"
VERSION = 1
KINDS = ("tokens", "tar")
DTYPES = ("uint8", "uint16", "uint32")
DEFAULT_PIECE_BYTES = 4 << 20
"""4 MiB: large enough that a range request's latency is small beside its transfer, small enough that a
rank's samples of the next steps cost a few pieces each."""
MIN_PIECE_BYTES = 4 << 10
MAX_PIECE_BYTES = 1 << 30
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_KEY = re.compile(r"^[^/]{1,255}$")


@dataclass(frozen=True)
class Member:
    """One file of a tar sample: its extension (name after the key's dot), data offset and size in the shard."""

    ext: str
    offset: int
    size: int


@dataclass(frozen=True)
class Shard:
    name: str
    """File name relative to the index's directory (no ``/``)."""
    bytes: int
    sha256: str
    """Of the whole shard: ``elastic-ddp shards verify`` checks it."""
    pieces: tuple[str, ...]
    """SHA-256 of each piece, in order."""
    tokens: int = 0
    """``tokens`` kind: how many tokens the shard holds."""
    samples: tuple[tuple[str, tuple[Member, ...]], ...] = ()
    """``tar`` kind: each sample's key and members, in the shard's order."""


@dataclass(frozen=True)
class ShardIndex:
    kind: str
    piece_bytes: int
    shards: tuple[Shard, ...]
    dtype: str = "uint8"
    """``tokens`` kind: the tokens' integer type."""
    digest: str = ""
    """SHA-256 of the index file's bytes: identifies the dataset (fingerprints, cache directories)."""

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def total_bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    def piece_range(self, shard: Shard, piece: int) -> tuple[int, int]:
        """The byte range ``[start, stop)`` of ``piece`` in ``shard``."""
        start = piece * self.piece_bytes
        return start, min(start + self.piece_bytes, shard.bytes)

    def pieces_of(self, start: int, stop: int) -> range:
        """The pieces that hold bytes ``[start, stop)`` of a shard."""
        return range(start // self.piece_bytes, (stop - 1) // self.piece_bytes + 1) if stop > start else range(0)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": self.kind, "piece_bytes": self.piece_bytes}
        if self.kind == "tokens":
            body["dtype"] = self.dtype
        body["shards"] = [_shard_json(shard, self.kind) for shard in self.shards]
        return (json.dumps(body, indent=None, separators=(",", ":")) + "\n").encode()


def _shard_json(shard: Shard, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": shard.name, "bytes": shard.bytes, "sha256": shard.sha256, "pieces": list(shard.pieces)}
    if kind == "tokens":
        out["tokens"] = shard.tokens
    else:
        out["samples"] = [[key, [[m.ext, m.offset, m.size] for m in members]] for key, members in shard.samples]
    return out


# -- reading -----------------------------------------------------------------------------------------------


def parse_index(data: bytes, where: str = INDEX_NAME) -> ShardIndex:
    """Check and decode an index file's bytes (from storage: every value is validated)."""

    def bad(why: str) -> DataError:
        return DataError(f"{where}: not a valid shard index: {why}")

    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"not JSON ({exc})") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise bad(f"'format' is not {FORMAT!r}")
    if body.get("version") != VERSION:
        raise bad(f"version {body.get('version')!r}; this elastic_ddp reads version {VERSION}")
    kind = body.get("kind")
    if kind not in KINDS:
        raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    piece_bytes = _int(body.get("piece_bytes"), MIN_PIECE_BYTES, MAX_PIECE_BYTES, "piece_bytes", bad)
    dtype = body.get("dtype", "uint8") if kind == "tokens" else "uint8"
    if dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    raw = body.get("shards")
    if not isinstance(raw, list) or not raw:
        raise bad("'shards' must be a non-empty list")
    shards, names = [], set()
    for position, item in enumerate(raw):
        def bad_shard(why: str, position: int = position) -> DataError:
            return bad(f"shard {position}: {why}")

        shard = _parse_shard(item, kind, piece_bytes, np.dtype(dtype).itemsize, bad_shard)
        if shard.name in names:
            raise bad(f"shard {shard.name!r} is listed twice")
        names.add(shard.name)
        shards.append(shard)
    return ShardIndex(kind=kind, piece_bytes=piece_bytes, shards=tuple(shards), dtype=dtype,
                      digest=hashlib.sha256(data).hexdigest())


def _parse_shard(item: Any, kind: str, piece_bytes: int, itemsize: int, bad: Callable[[str], DataError]) -> Shard:
    if not isinstance(item, dict):
        raise bad("not an object")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise bad(f"name {name!r} is not a plain file name")
    size = _int(item.get("bytes"), 1, 1 << 50, "bytes", bad)
    sha = item.get("sha256")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise bad("sha256 is not a hex SHA-256")
    pieces = item.get("pieces")
    expected = -(-size // piece_bytes)
    if not (isinstance(pieces, list) and len(pieces) == expected
            and all(isinstance(p, str) and _SHA256.match(p) for p in pieces)):
        raise bad(f"'pieces' must list {expected} hex SHA-256 digests ({size} bytes in pieces of {piece_bytes})")
    if kind == "tokens":
        tokens = _int(item.get("tokens"), 1, 1 << 50, "tokens", bad)
        if tokens * itemsize != size:
            raise bad(f"{tokens} tokens of {itemsize} bytes are not its {size} bytes")
        return Shard(name, size, sha, tuple(pieces), tokens=tokens)
    raw = item.get("samples")
    if not isinstance(raw, list) or not raw:
        raise bad("'samples' must be a non-empty list")
    samples = []
    for sample in raw:
        if not (isinstance(sample, list) and len(sample) == 2 and isinstance(sample[0], str) and _KEY.match(sample[0])
                and isinstance(sample[1], list) and sample[1]):
            raise bad(f"sample {sample!r:.80} is not [key, [[ext, offset, size], ...]]")
        members = []
        for member in sample[1]:
            if not (isinstance(member, list) and len(member) == 3 and isinstance(member[0], str)):
                raise bad(f"member {member!r:.80} of sample {sample[0]!r} is not [ext, offset, size]")
            offset = _int(member[1], 0, size, "member offset", bad)
            length = _int(member[2], 0, size - offset, "member size", bad)
            members.append(Member(member[0], offset, length))
        samples.append((sample[0], tuple(members)))
    return Shard(name, size, sha, tuple(pieces), samples=tuple(samples))


def _int(value: Any, low: int, high: int, what: str, bad: Callable[[str], DataError]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"{what} {value!r} is not an integer in [{low}, {high}]")
    return value


def load_index(uri: str, fs: fsspec.AbstractFileSystem, *, check_sizes: bool = True) -> ShardIndex:
    """Read ``<uri>/index.json`` and, with ``check_sizes``, check every shard's size in storage (one listing)."""
    path = posixpath.join(fs._strip_protocol(uri), INDEX_NAME)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError as exc:
        raise DataError(f"{uri}: no {INDEX_NAME}; build it once with: elastic-ddp shards index {uri}") from exc
    index = parse_index(data, f"{uri}/{INDEX_NAME}")
    if check_sizes:
        sizes = _sizes(fs, fs._strip_protocol(uri))
        for shard in index.shards:
            if shard.name not in sizes:
                raise DataError(f"{uri}: shard {shard.name} of the index is missing from storage")
            if sizes[shard.name] != shard.bytes:
                raise DataError(f"{uri}: shard {shard.name} has {sizes[shard.name]} bytes in storage, the index says "
                                f"{shard.bytes}: the shards changed after the index was built; build it again")
    return index


def _sizes(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, int]:
    fs.invalidate_cache(directory)  # a listing another process made stale must not hide a changed shard
    return {posixpath.basename(entry["name"].rstrip("/")): int(entry.get("size") or 0)
            for entry in fs.ls(directory, detail=True) if entry.get("type") != "directory"}


# -- building ----------------------------------------------------------------------------------------------


def build_index(uri: str, fs: fsspec.AbstractFileSystem, *, kind: str, pattern: str = "", dtype: str = "uint16",
                piece_bytes: int = DEFAULT_PIECE_BYTES, progress: Callable[[str], None] | None = None) -> ShardIndex:
    """Read every shard under ``uri`` that matches ``pattern`` (default ``*.bin`` for tokens, ``*.tar`` for tar),
    in name order, and write ``<uri>/index.json``. Returns the index written."""
    if kind not in KINDS:
        raise DataError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if dtype not in DTYPES:
        raise DataError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not MIN_PIECE_BYTES <= piece_bytes <= MAX_PIECE_BYTES:
        raise DataError(f"piece_bytes {piece_bytes} is not in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}]")
    root = fs._strip_protocol(uri).rstrip("/")
    pattern = pattern or ("*.bin" if kind == "tokens" else "*.tar")
    names = sorted(posixpath.basename(path) for path in fs.glob(posixpath.join(root, pattern)))
    names = [name for name in names if name != INDEX_NAME]
    if not names:
        raise DataError(f"{uri}: no shard matches {pattern!r}")
    itemsize = int(np.dtype(dtype).itemsize)
    shards = []
    for number, name in enumerate(names, 1):
        if not _NAME.match(name):
            raise DataError(f"{uri}: shard name {name!r} is not a plain file name (letters, digits, '.', '_', '-'; "
                            "not starting with '.')")
        path = posixpath.join(root, name)
        with fs.open(path, "rb") as handle:
            whole, pieces, size = shard_digests(handle, piece_bytes)
        if size == 0:
            raise DataError(f"{uri}: shard {name} is empty")
        if kind == "tokens":
            if size % itemsize:
                raise DataError(f"{uri}: shard {name} has {size} bytes, not a whole number of {dtype} tokens")
            shard = Shard(name, size, whole, tuple(pieces), tokens=size // itemsize)
        else:
            with fs.open(path, "rb") as handle:
                samples = tar_samples(handle, f"{uri}/{name}")
            shard = Shard(name, size, whole, tuple(pieces), samples=samples)
        shards.append(shard)
        if progress is not None:
            progress(f"[{number}/{len(names)}] {name}: {size:,} bytes, {len(pieces)} pieces"
                     + (f", {shard.tokens:,} tokens" if kind == "tokens" else f", {len(shard.samples):,} samples"))
    draft = ShardIndex(kind=kind, piece_bytes=piece_bytes, shards=tuple(shards), dtype=dtype if kind == "tokens" else "uint8")
    data = draft.to_json()
    fs.pipe_file(posixpath.join(root, INDEX_NAME), data)
    return parse_index(data, f"{uri}/{INDEX_NAME}")


def shard_digests(handle: Any, piece_bytes: int) -> tuple[str, list[str], int]:
    """Read an open shard to its end: its SHA-256, the SHA-256 of each ``piece_bytes`` piece, and its size."""
    whole, pieces, size = hashlib.sha256(), [], 0
    while block := handle.read(piece_bytes):
        whole.update(block)
        pieces.append(hashlib.sha256(block).hexdigest())
        size += len(block)
    return whole.hexdigest(), pieces, size


def tar_samples(handle: Any, where: str) -> tuple[tuple[str, tuple[Member, ...]], ...]:
    """The samples of a WebDataset-layout tar: members grouped by key (name up to the first dot of its base
    name), in the archive's order; a key must be contiguous. Directories are skipped; links are refused."""
    samples: list[tuple[str, list[Member]]] = []
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=handle, mode="r:") as archive:
            for info in archive:
                if info.isdir():
                    continue
                if not info.isfile():
                    raise DataError(f"{where}: member {info.name!r} is not a regular file (links are not read)")
                base = posixpath.basename(info.name)
                key, dot, ext = base.partition(".")
                key = posixpath.join(posixpath.dirname(info.name), key).replace("/", "_") if dot else ""
                if not key or not ext:
                    raise DataError(f"{where}: member {info.name!r} has no 'key.ext' name")
                if samples and samples[-1][0] == key:
                    samples[-1][1].append(Member(ext, info.offset_data, info.size))
                    continue
                if key in seen:
                    raise DataError(f"{where}: the members of sample {key!r} are not next to each other")
                seen.add(key)
                samples.append((key, [Member(ext, info.offset_data, info.size)]))
    except tarfile.TarError as exc:
        raise DataError(f"{where}: not a readable tar file: {exc}") from exc
    if not samples:
        raise DataError(f"{where}: no samples")
    return tuple((key, tuple(members)) for key, members in samples)


def window_counts(index: ShardIndex, context: int) -> Sequence[int]:
    """``tokens`` kind: how many windows of ``context + 1`` tokens each shard holds."""
    return [max(0, (shard.tokens - 1) // context) for shard in index.shards]
