"""A worker's word to its agent that the job must end rather than restart: a configuration mistake.

torchrun's agent restarts a failed worker group whatever the workers' exit status, so a refused
configuration (a flag out of range, a resume that does not match the checkpoint) would fail once per
``--max-restarts``. A worker that ends as ``config`` therefore writes one record, :class:`JobEnd`, to the
directory its agent named in ``ELASTIC_DDP_JOB_END_DIR``; the ``etcd-v3`` handler, asked by the agent for
the restart's rendezvous, finds the record, closes the rendezvous for every node with the record as the
reason, and ends its agent with the worker's status. Every other agent finds the rendezvous closed with
that reason and ends the same way (docs/design.md, "Failure semantics").

Without the variable (another rendezvous backend, no agent) nothing is written. This module imports
nothing of torch: the rendezvous package and the runtime both use it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DIR_ENV = "ELASTIC_DDP_JOB_END_DIR"
"""Set by the ``etcd-v3`` handler in its agent's environment (so in its workers'): where a worker writes."""

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"

MAX_DETAIL = 2000
"""Characters of the reason a record keeps (the first line of a long message is what matters)."""

MAX_BYTES = 8192
"""A record larger than this is not one this module wrote."""


class JobEndRecordError(ValueError):
    """Bytes that are not a job-end record."""


@dataclass(frozen=True)
class JobEnd:
    """Why the job ends: the worker's exit reason (``config``), its status and the message that says what to fix."""

    reason: str
    status: int
    detail: str
    rank: int

    def encode(self) -> bytes:
        return json.dumps({"reason": self.reason, "status": self.status, "detail": self.detail[:MAX_DETAIL],
                           "rank": self.rank}, sort_keys=True).encode()

    @staticmethod
    def decode(payload: bytes) -> JobEnd:
        """The record in ``payload``; :class:`JobEndRecordError` for anything else."""
        if len(payload) > MAX_BYTES:
            raise JobEndRecordError(f"a job-end record of {len(payload)} bytes (at most {MAX_BYTES})")
        try:
            body = json.loads(payload)
        except (UnicodeDecodeError, ValueError) as exc:
            raise JobEndRecordError(f"a job-end record that is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise JobEndRecordError("a job-end record that is not an object")
        reason, status, detail, rank = (body.get(name) for name in ("reason", "status", "detail", "rank"))
        if not (isinstance(reason, str) and reason.isidentifier() and len(reason) <= 32):
            raise JobEndRecordError(f"a job-end record with reason {reason!r}")
        if isinstance(status, bool) or not isinstance(status, int) or not 1 <= status <= 255:
            raise JobEndRecordError(f"a job-end record with status {status!r}")
        if not isinstance(detail, str) or len(detail) > MAX_DETAIL:
            raise JobEndRecordError("a job-end record whose detail is not a string of at most %d characters" % MAX_DETAIL)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise JobEndRecordError(f"a job-end record with rank {rank!r}")
        return JobEnd(reason, status, detail, rank)


def record_path(directory: str, run_id: str) -> str:
    """Where the record of run ``run_id`` goes in ``directory`` (the run id as a file name, made safe)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "_"
    return os.path.join(directory, f"{safe.lstrip('.') or '_'}.json")


def tell_agent(end: JobEnd) -> bool:
    """Write ``end`` where this worker's agent looks (atomically: a reader sees all of it or nothing).
    Returns whether it was written; False without an agent that looks, or when the write failed (logged)."""
    directory, run_id = os.environ.get(DIR_ENV, ""), os.environ.get(RUN_ID_ENV, "")
    if not directory or not run_id or not os.path.isdir(directory):
        return False
    path = record_path(directory, run_id)
    try:
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".job-end-")
        with os.fdopen(handle, "wb") as out:
            out.write(end.encode())
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning("could not tell the agent that the job ends (%s): it may restart the workers", exc)
        return False
    return True


def read(directory: str, run_id: str) -> JobEnd | None:
    """The record a worker of run ``run_id`` left in ``directory``, if any (one that does not decode is
    logged and ignored: the agent then restarts as it would without it)."""
    try:
        with open(record_path(directory, run_id), "rb") as handle:
            payload = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read the workers' job-end record in %s: %s", directory, exc)
        return None
    try:
        return JobEnd.decode(payload)
    except JobEndRecordError as exc:
        logger.warning("ignoring %s in %s", exc, directory)
        return None
