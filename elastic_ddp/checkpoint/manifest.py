"""The manifest: the last file of a checkpoint, whose existence is the commit.

It holds what the commit protocol needs: the step, world size, run id, generation, writer
token, torch version and every data file with size and digest (``hash``: HASH_NAME, a tree of SHA-256
digests; ``sha256`` in checkpoints written before it, still verified). Beside them, ``meta`` is the
saved state's own small JSON object (for the trainer: data position, data digest, config
fingerprint), opaque to the commit protocol. Everything read back is validated before it is
trusted: a manifest is data from storage, not code.

Format 1 (before ``meta``) kept epoch, cursor, samples_seen, data_digest and fingerprint at
the top level; it is still read, with those fields gathered into ``meta``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from elastic_ddp.checkpoint.files import HASH_NAME, LEGACY_HASH_NAME, TREE_HASH_NAME, FileRecord
from elastic_ddp.errors import CheckpointCorruptError

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
_FORMAT_1_META = ("epoch", "cursor", "samples_seen", "data_digest", "fingerprint")
MANIFEST_NAME = "manifest.json"
REJECTED_MANIFEST_NAME = "manifest.rejected.json"
STEP_DIR_PATTERN = re.compile(r"^step-(\d{8,})$")
_FILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
HASHES = {TREE_HASH_NAME: _HEX64, LEGACY_HASH_NAME: _HEX64, "xxh3-128": re.compile(r"^[0-9a-f]{32}$")}
"""The file digests a manifest may name in its ``hash`` field, each with the form of its hex digest:
stored checkpoints use HASH_NAME (TREE_HASH_NAME; LEGACY_HASH_NAME before it, elastic_ddp.checkpoint.files),
node-memory replicas XXH3-128 (elastic_ddp.checkpoint.replica)."""
_TOKEN = re.compile(r"^[0-9a-f]{8,32}$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def replicated_file_name(token: str) -> str:
    """Rank 0's file of model, optimizer, scheduler and scaler state."""
    return f"replicated-{token}.eddp"


def rank_file_name(rank: int, token: str) -> str:
    """One rank's own state: RNG streams, sharded optimizer state, the script's per-rank objects."""
    return f"rank-{rank:05d}-{token}.eddp"


def parse_step_dir(name: str) -> int | None:
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's description."""

    step: int
    world_size: int
    run_id: str
    generation: int
    files: dict[str, FileRecord]
    token: str
    """Random per-launch tag in every data file name: two writers of the same step never share a file."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The saved state's own JSON object; its ``step`` equals :attr:`step`."""
    format_version: int = FORMAT_VERSION
    torch_version: str = field(default_factory=lambda: torch.__version__)
    created_at: float = field(default_factory=time.time)
    hash: str = HASH_NAME
    """The digest of every file record (a key of HASHES); the records name it: ``{"size", "<hash>"}``."""
    rank_state: bool = True
    """Whether every rank's own file is listed. False only for a rescue replica (elastic_ddp.checkpoint.replica):
    the replicated state alone, resumed like a world-size change (RNG streams re-derived)."""

    def to_json(self) -> bytes:
        body = {item.name: getattr(self, item.name) for item in fields(self)}  # asdict would deep-copy meta
        body["files"] = {name: {"size": record.size, self.hash: record.digest}
                         for name, record in sorted(self.files.items())}
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files.values())

    @property
    def replicated_file(self) -> str:
        return replicated_file_name(self.token)

    def rank_file(self, rank: int) -> str:
        return rank_file_name(rank, self.token)

    def resumes_rank_state_at(self, world_size: int) -> bool:
        """Whether a resume at ``world_size`` reloads every rank's own state (RNG streams, shards) from it."""
        return self.rank_state and self.world_size == world_size

    @property
    def data_digest(self) -> str | None:
        """The data digest the saved state recorded in its meta, when it has one."""
        digest = self.meta.get("data_digest")
        return digest if isinstance(digest, str) else None

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        """Parse and validate; any defect raises CheckpointCorruptError naming ``where``."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: manifest is not valid JSON ({exc})") from exc
        try:
            return cls._validated(body)
        except KeyError as exc:
            raise CheckpointCorruptError(f"{where}: malformed manifest: missing field {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed manifest: {exc}") from exc

    @classmethod
    def _validated(cls, body: Any) -> Manifest:
        if not isinstance(body, dict):
            raise TypeError("top level is not an object")
        version = body["format_version"]
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(f"unsupported format_version {version!r} (this runtime reads {READABLE_FORMAT_VERSIONS})")
        ints = {name: _int(body, name) for name in ("step", "world_size", "generation")}
        if ints["world_size"] < 1:
            raise ValueError("world_size must be >= 1")
        meta = {"step": ints["step"], **{name: body[name] for name in _FORMAT_1_META}} if version == 1 else _dict(body, "meta")
        if meta.get("step") != ints["step"]:
            raise ValueError(f"meta step {meta.get('step')!r} differs from the manifest's step {ints['step']}")
        if "data_digest" in meta and not _HEX64.match(str(meta["data_digest"])):
            raise ValueError("data_digest is not a sha256 hex digest")
        if "fingerprint" in meta and not isinstance(meta["fingerprint"], dict):
            raise TypeError("fingerprint is not an object")
        hash_name = str(body.get("hash", LEGACY_HASH_NAME))  # manifests before the field hashed with SHA-256
        if hash_name not in HASHES:
            raise ValueError(f"hash {hash_name!r} is not one of {', '.join(HASHES)}")
        files = {name: _file_record(name, record, hash_name) for name, record in _dict(body, "files").items()}
        token = str(body["token"])
        if not _TOKEN.match(token):
            raise ValueError(f"token {token!r} is not a writer token")
        rank_state = body.get("rank_state", True)
        if not isinstance(rank_state, bool):
            raise TypeError("rank_state is not a boolean")
        ranks = range(ints["world_size"]) if rank_state else range(0)
        missing = [name for name in (replicated_file_name(token), *(rank_file_name(r, token) for r in ranks))
                   if name not in files]
        if missing:  # every rank writes its own file: a manifest without one cannot be resumed at its world size
            raise ValueError(f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} not listed")
        return cls(
            **ints,
            run_id=str(body["run_id"]),
            files=files,
            token=token,
            meta=meta,
            format_version=version,
            torch_version=str(body["torch_version"]),
            created_at=float(body["created_at"]),
            hash=hash_name,
            rank_state=rank_state,
        )


def _int(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _dict(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body[name]
    if not isinstance(value, dict):
        raise TypeError(f"{name} is not an object")
    return value


def _file_record(name: str, record: Any, hash_name: str) -> FileRecord:
    if not _FILE_NAME_PATTERN.match(name) or ".." in name:
        raise ValueError(f"file name {name!r} is not allowed")
    if not isinstance(record, dict):
        raise TypeError(f"entry for {name} is not an object")
    size, digest = record["size"], record[hash_name]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size of {name} is not a non-negative integer")
    if not isinstance(digest, str) or not HASHES[hash_name].match(digest):
        raise ValueError(f"{hash_name} of {name} is not a hex digest")
    return FileRecord(size=size, digest=digest)
