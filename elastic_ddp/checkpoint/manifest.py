"""The manifest: the last file of a checkpoint, whose existence is the commit.

It lists every data file with size and SHA-256, plus the step, data position, world size,
run id and generation. Everything read back is validated before it is trusted: a
manifest is data from storage, not code.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from elastic_ddp.checkpoint.storage import FileRecord
from elastic_ddp.errors import CheckpointCorruptError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REJECTED_MANIFEST_NAME = "manifest.rejected.json"
STEP_DIR_PATTERN = re.compile(r"^step-(\d{8,})$")
_FILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TOKEN = re.compile(r"^[0-9a-f]{8,32}$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def replicated_file_name(token: str) -> str:
    """Rank 0's file of model, optimizer, scheduler and scaler state."""
    return f"replicated-{token}.eddp"


def rank_file_name(rank: int, token: str) -> str:
    """One rank's own state (RNG streams)."""
    return f"rank-{rank:05d}-{token}.eddp"


def parse_step_dir(name: str) -> int | None:
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's description."""

    step: int
    epoch: int
    cursor: int
    samples_seen: int
    world_size: int
    run_id: str
    generation: int
    data_digest: str
    fingerprint: dict[str, Any]
    files: dict[str, FileRecord]
    token: str
    """Random per-launch tag in every data file name: two writers of the same step never share a file."""
    format_version: int = FORMAT_VERSION
    torch_version: str = field(default_factory=lambda: torch.__version__)
    created_at: float = field(default_factory=time.time)
    hash: str = "sha256"

    def to_json(self) -> bytes:
        body = asdict(self)
        body["files"] = {name: asdict(record) for name, record in sorted(self.files.items())}
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files.values())

    @property
    def replicated_file(self) -> str:
        return replicated_file_name(self.token)

    def rank_file(self, rank: int) -> str:
        return rank_file_name(rank, self.token)

    def meta(self) -> dict[str, Any]:
        """The TrainState ``meta`` part recorded in this manifest."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "samples_seen": self.samples_seen,
            "data_digest": self.data_digest,
            "fingerprint": self.fingerprint,
        }

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
        if body["format_version"] != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {body['format_version']!r} (this runtime reads {FORMAT_VERSION})")
        ints = {name: _int(body, name) for name in ("step", "epoch", "cursor", "samples_seen", "world_size", "generation")}
        if ints["world_size"] < 1:
            raise ValueError("world_size must be >= 1")
        if not _HEX64.match(str(body["data_digest"])):
            raise ValueError("data_digest is not a sha256 hex digest")
        if not isinstance(body["fingerprint"], dict):
            raise TypeError("fingerprint is not an object")
        files = {name: _file_record(name, record) for name, record in _dict(body, "files").items()}
        token = str(body["token"])
        if not _TOKEN.match(token):
            raise ValueError(f"token {token!r} is not a writer token")
        if replicated_file_name(token) not in files:
            raise ValueError(f"{replicated_file_name(token)} is not listed")
        return cls(
            **ints,
            run_id=str(body["run_id"]),
            data_digest=str(body["data_digest"]),
            fingerprint=body["fingerprint"],
            files=files,
            token=token,
            torch_version=str(body["torch_version"]),
            created_at=float(body["created_at"]),
            hash=str(body.get("hash", "sha256")),
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


def _file_record(name: str, record: Any) -> FileRecord:
    if not _FILE_NAME_PATTERN.match(name) or ".." in name:
        raise ValueError(f"file name {name!r} is not allowed")
    if not isinstance(record, dict):
        raise TypeError(f"entry for {name} is not an object")
    size, digest = record["size"], record["sha256"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size of {name} is not a non-negative integer")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise ValueError(f"sha256 of {name} is not a hex digest")
    return FileRecord(size=size, sha256=digest)
