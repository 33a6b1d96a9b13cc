"""The run's event stream: what happened, for programs (docs/design.md, "Events").

Every rank appends one JSON object per line to ``<log_dir>/events.jsonl``: resumed, started
fresh, a checkpoint skipped, committed or un-committed, a save that failed, a stop requested
and agreed, the watchdog firing, the exit with its reason and status. The chaos verifier and
the tests read these records; the human log lines say the same things in prose and are free to
change.

A record is ``{"time", "event", "run_id", "rank", "step"?, ...fields, "host", "pid",
"agent_pid"?}``: ``time`` is the wall clock (``time.time()``), ``event`` one of :class:`Event`,
``step`` the step it is about (absent where none is), ``agent_pid`` the torchrun agent's pid
(under torchrun: it tells which node a rank ran on). Each kind's own fields are in
:data:`FIELDS`; :meth:`EventLog.emit` refuses a kind outside the set or a missing
field, and :func:`read_events` reports any line that is not a valid record instead of failing.

Writing: the file is opened ``O_APPEND`` and each record is one ``os.write`` of a whole line,
so a process that crashes keeps every event before the crash (no buffer to lose), and several
processes may append to the same file: on a local Linux file system the kernel appends each
``write`` whole, so lines of different ranks and nodes never interleave. Network file systems
(NFS) do not promise that: give each node its own ``--log-dir`` there. Without a log directory
an :class:`EventLog` writes nothing (as ``metrics.jsonl`` is not written).

The sample ledger (``--log-sample-ledger``; docs/design.md, "Data cursor") is the log directory's other file
for programs: rank 0 appends one :class:`LedgerEntry` per committed step to ``<log_dir>/samples.jsonl``
(:class:`SampleLedger`), the same way, one ``os.write`` per line; restarts append to the same file, so a
step redone after a restart appears again and its last line is the one that reached the final model.
:func:`read_ledger` reports every line that is not a valid entry instead of failing.

No heavy imports: the checkpoint and resilience packages use it.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_ddp.prefork import agent_pid

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
"""The events file's name under the log directory."""

MAX_TEXT = 2000
"""String fields (error messages) are cut to this many characters, so a line stays small."""


class Event(str, enum.Enum):
    """Every kind of event. A name that is not a member is an error, not a new kind."""

    PROCESS_GROUP_FORMED = "process_group_formed"
    STARTED_FRESH = "started_fresh"
    RESUMED = "resumed"
    FIRST_STEP = "first_step"
    RESTORE_FAILED = "restore_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    COMMITTED = "committed"
    REPLICA_SAVED = "replica_saved"
    UNCOMMITTED = "uncommitted"
    SAVE_FAILED = "save_failed"
    STOP_REQUESTED = "stop_requested"
    STOP_AGREED = "stop_agreed"
    WATCHDOG_FIRED = "watchdog_fired"
    LR_HORIZON_CHANGED = "lr_horizon_changed"
    RESCUE_RULED_OUT = "rescue_ruled_out"
    DONE = "done"
    EXIT = "exit"


FIELDS: Mapping[Event, tuple[str, ...]] = {
    Event.PROCESS_GROUP_FORMED: ("world_size", "backend", "store", "agent_store", "restart_count"),
    Event.STARTED_FRESH: ("world_size", "reason"),
    Event.RESUMED: ("step", "path", "saved_world_size", "world_size", "rank_state_reused", "source"),
    Event.FIRST_STEP: ("step", "data_wait_s", "step_time_s"),
    Event.RESTORE_FAILED: ("error",),
    Event.CHECKPOINT_SKIPPED: ("step", "path", "reason"),
    Event.COMMITTED: ("step", "path", "world_size", "files", "bytes"),
    Event.REPLICA_SAVED: ("step", "path", "token", "interval", "reason"),
    Event.UNCOMMITTED: ("step", "path", "reason"),
    Event.SAVE_FAILED: ("step", "error"),
    Event.STOP_REQUESTED: ("reason",),
    Event.STOP_AGREED: ("step", "reason", "source"),
    Event.WATCHDOG_FIRED: ("phase", "reason", "stuck_s", "limit_s"),
    Event.LR_HORIZON_CHANGED: ("step", "saved", "now"),
    Event.RESCUE_RULED_OUT: ("reason", "fix"),
    Event.DONE: ("step", "epoch", "model_digest", "data_digest"),
    Event.EXIT: ("reason", "status"),
}
"""The fields each kind always carries, besides the common ones (docs/design.md, "Events", says what each means)."""

WRITTEN: Mapping[Event, tuple[str, str]] = {
    Event.PROCESS_GROUP_FORMED: (
        "every rank, once the process group formed (the library path: when its runtime starts)",
        "`world_size`, `backend`, `store` (the workers' store, `host:port`), `agent_store` (it is torchrun's "
        "long-lived agent store), `restart_count` (torchrun's)"),
    Event.STARTED_FRESH: (
        "every rank, at step 0",
        "`world_size`, `reason`: `no-checkpoint` (none under the root), `no-valid-checkpoint` (none verified; "
        "`--checkpoint-allow-fresh-start`), `no-checkpoint-dir`, `resume-disabled` (`--no-checkpoint-resume`)"),
    Event.RESUMED: (
        "every rank, after loading (`CheckpointManager.restore`)",
        "`step`, `path` (the step directory, or the node's replica directory), `saved_world_size`, `world_size` "
        "(now), `rank_state_reused` (same world size: the rank's own RNG streams), `source` (`storage`, `replica`, or "
        "`live`: a new membership in the same process went on from the live state, `path` empty)"),
    Event.FIRST_STEP: (
        "every rank (trainer path), when the first step of its launch is done",
        "`step`, `data_wait_s` (time it waited for that step's batches: a node that joined with an empty shard "
        "cache shows here), `step_time_s`"),
    Event.RESTORE_FAILED: (
        "each rank whose restore raised (nothing valid and no fresh start allowed, a refused fingerprint, a file "
        "that changed after rank 0 verified it)", "`error`"),
    Event.CHECKPOINT_SKIPPED: (
        "rank 0, for each committed checkpoint that does not verify on restore",
        "`step`, `path`, `reason` (the file and what is wrong with it)"),
    Event.COMMITTED: ("rank 0, when the manifest is written", "`step`, `path`, `world_size`, `files`, `bytes`"),
    Event.REPLICA_SAVED: (
        "each node's first worker, when its replica's manifest is written; a survivor, when it kept its live "
        "state after a peer's loss",
        "`step`, `path` (the slot or rescue directory), `token` (the launch's writer token), `interval` (steps to "
        "the next replica, as agreed; 0 for a rescue), `reason` (`due` or `rescue`)"),
    Event.UNCOMMITTED: ("rank 0, when restore sets a damaged checkpoint's manifest aside", "`step`, `path`, `reason`"),
    Event.SAVE_FAILED: (
        "every rank, when a save raises (sync or background; the same outcome on every rank)", "`step`, `error`"),
    Event.STOP_REQUESTED: (
        "the rank that was asked (signal, spot notice), at the next step boundary",
        "`reason` (`signal:SIGTERM`, `spot-notice`, ...)"),
    Event.STOP_AGREED: (
        "every rank, at the step where the agreement stops the run",
        "`step`, `reason` (`preempted` on a rank that was asked, `peer-lost` on the others), `source` (what asked "
        "this rank, or `peer`)"),
    Event.WATCHDOG_FIRED: (
        "the rank whose watchdog expired, before it exits",
        "`phase`, `reason` (`hang:<phase>`, `save-deadline`), `stuck_s`, `limit_s`"),
    Event.LR_HORIZON_CHANGED: ("rank 0, on a resume that moves the LR schedule's horizon", "`step`, `saved`, `now`"),
    Event.RESCUE_RULED_OUT: (
        "rank 0, before the first step, when the run's own objects rule out every rescue (replicas on)",
        "`reason` (a sharded optimizer, per-rank state), `fix` (what the script can change)"),
    Event.DONE: (
        "every rank, when training ended normally",
        "`step`, `epoch`, `model_digest`, `data_digest`, `loss`, `accuracy` and `metrics` (the final evaluation, "
        "rank 0; the library path's `Runtime.report_done` may pass them)"),
    Event.EXIT: (
        "every rank, last",
        "`reason`, `status` (`ExitReason`), `detail` (the stop source, the watchdog's message, the peer loss), "
        "`error` (the error that ended it, when one did; an exception the runtime does not handle is `reason` "
        "`error`, `status` 1)"),
}
"""Who writes each kind and when, and what its fields mean (docs/reference.md is generated from it)."""

COMMON = ("time", "event", "run_id", "rank", "host", "pid")
"""The fields of every record."""


class EventLog:
    """One process's writer of the run's events file; a no-op without a log directory.

    ``emit`` is safe from any thread (one ``os.write`` per record). A failure to write is logged
    once and training goes on: the events describe the run, they are not needed to run it (and
    a reader that misses an event it expects fails its check).
    """

    def __init__(self, log_dir: str, *, run_id: str, rank: int) -> None:
        self.log_dir = log_dir
        """The run's log directory ("" when nothing is written); the sample ledger goes there too."""
        self.path = os.path.join(log_dir, EVENTS_FILE) if log_dir else ""
        self.run_id = run_id
        self.rank = rank
        self.step: int | None = None
        """The step most recent records are about (set by the training loop); ``emit(step=...)`` overrides it."""
        self._fd: int | None = None
        self._failed = False
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._identity: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self._identity["agent_pid"] = agent_pid()
        if self.path:
            os.makedirs(log_dir, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @classmethod
    def off(cls) -> EventLog:
        """An event log that writes nothing (for a component given none)."""
        return cls("", run_id="", rank=0)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def set_step(self, step: int | None) -> None:
        self.step = step

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener`` with every record this process emits from now on (e.g. the TensorBoard writer's
        markers), on the emitting thread; records reach listeners even when no file is written."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.remove(listener)

    def emit(self, kind: Event | str, **fields: Any) -> None:
        """Append one event; ``kind`` must be an :class:`Event` and ``fields`` hold at least its :data:`FIELDS`.

        ``step`` defaults to :attr:`step` when that is set and the kind has no step of its own.
        ValueError for an unknown kind or a missing field (a bug in the caller)."""
        event = Event(kind)
        missing = [name for name in FIELDS[event] if name not in fields]
        if missing:
            raise ValueError(f"event {event.value!r} needs {', '.join(missing)}")
        if self._fd is None and not self._listeners:
            return
        record: dict[str, Any] = {"time": time.time(), "event": event.value, "run_id": self.run_id, "rank": self.rank}
        if "step" not in fields and self.step is not None:
            record["step"] = self.step
        record.update((name, _bounded(value)) for name, value in fields.items())
        record.update(self._identity)
        for listener in self._listeners:
            listener(record)
        if self._fd is not None:
            self._write((json.dumps(record, default=str) + "\n").encode())

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        try:
            while line:  # one write in practice; the loop only matters for a short write (a full disk)
                line = line[os.write(self._fd, line):]
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.warning("cannot append to the events file %s: %s; further events of this process are lost",
                               self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _bounded(value: Any) -> Any:
    return value[:MAX_TEXT] if isinstance(value, str) else value


def check_record(record: Any) -> str | None:
    """Why ``record`` (a parsed line) is not a valid event, or None when it is."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    try:
        event = Event(record.get("event"))
    except ValueError:
        return f"unknown event {record.get('event')!r}"
    missing = [name for name in (*COMMON, *FIELDS[event]) if name not in record]
    if missing:
        return f"{event.value} without {', '.join(missing)}"
    if not isinstance(record["time"], (int, float)) or isinstance(record["time"], bool):
        return f"time {record['time']!r} is not a number"
    for name in ("rank", "step"):
        if name in record and (not isinstance(record[name], int) or isinstance(record[name], bool)):
            return f"{name} {record[name]!r} is not an integer"
    return None


def parse_events(lines: Iterable[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The valid records among ``lines``, and one problem per line that is not one (line numbers from 1)."""
    numbered, problems = _json_lines(lines, check_record, shown=120)
    return [record for _, record in numbered], problems


def _json_lines(lines: Iterable[str], check: Callable[[Any], str | None], shown: int,
                ) -> tuple[list[tuple[int, Any]], list[str]]:
    """``(line number, record)`` of each line that is JSON and passes ``check`` (None: no problem), and one problem
    per other non-blank line, naming its number (from 1) and, where the record has one, its step."""
    records, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc}): {line[:shown]!r}")
            continue
        problem = check(record)
        if problem:
            step = f" (step {record['step']!r})" if isinstance(record, dict) and "step" in record else ""
            problems.append(f"line {number}{step}: {problem}")
        else:
            records.append((number, record))
    return records, problems


def read_events(log_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of ``<log_dir>/events.jsonl`` (see :func:`parse_events`); a missing file is one problem."""
    path = os.path.join(log_dir, EVENTS_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return parse_events(handle)
    except FileNotFoundError:
        return [], [f"{path}: no such file"]


# -- the sample ledger ------------------------------------------------------------------------

SAMPLES_FILE = "samples.jsonl"
"""The sample ledger's name under the log directory."""


@dataclass(frozen=True)
class LedgerEntry:
    """One committed step in the sample ledger: positions ``[start, stop)`` of epoch ``epoch``'s permutation,
    at ``world_size``, and the step's global sample ids, sorted (``stop - start`` of them)."""

    step: int
    epoch: int
    start: int
    stop: int
    world_size: int
    ids: tuple[int, ...]
    line: int = 0
    """Its line in the file (from 1; 0: not read from a file)."""


class SampleLedger:
    """Rank 0's writer of ``<log_dir>/samples.jsonl``: one line per committed step.

    Each line is one ``os.write`` on an ``O_APPEND`` descriptor, not a buffer flushed at checkpoints: a resume
    may start from a survivor's live state of a step no checkpoint holds (the rescue), after rank 0 was killed,
    and a buffered tail lost with it would read as a gap. A line cut short by a crash is ended with a newline
    when the next launch opens the file, so it costs that line only. A failure to write is logged once and
    training goes on (the verifier then finds the steps missing).
    """

    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, SAMPLES_FILE)
        self._failed = False
        os.makedirs(log_dir, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._write(b"\n")  # the previous launch died in the middle of a line

    def record(self, step: int, epoch: int, start: int, stop: int, world_size: int, ids: Sequence[int]) -> None:
        """Append the line of one committed step (``ids``: its global sample ids, sorted)."""
        if self._fd is None:
            return
        line = {"time": time.time(), "step": step, "epoch": epoch, "start": start, "stop": stop,
                "world_size": world_size, "ids": list(ids)}
        self._write((json.dumps(line, separators=(",", ":")) + "\n").encode())

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.warning("cannot append to the sample ledger %s: %s; its further lines are lost", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_LEDGER_INTS = ("step", "epoch", "start", "stop", "world_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ledger_record(record: Any) -> str | None:
    """Why ``record`` (a parsed line) is not a valid ledger entry, or None when it is."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    missing = [name for name in (*_LEDGER_INTS, "ids") if name not in record]
    if missing:
        return f"without {', '.join(missing)}"
    bad = [name for name in _LEDGER_INTS if not _is_int(record[name])]
    if bad:
        return f"{', '.join(bad)} not an integer"
    if record["step"] < 1 or record["epoch"] < 0 or record["world_size"] < 1:
        return f"step {record['step']}, epoch {record['epoch']}, world_size {record['world_size']}: out of range"
    if not 0 <= record["start"] < record["stop"]:
        return f"positions [{record['start']}, {record['stop']}) are not a non-empty range"
    ids = record["ids"]
    if not isinstance(ids, list) or not all(_is_int(value) and value >= 0 for value in ids):
        return "ids is not a list of sample ids (integers >= 0)"
    if len(ids) != record["stop"] - record["start"]:
        return f"{len(ids)} ids for {record['stop'] - record['start']} positions [{record['start']}, {record['stop']})"
    if any(later < earlier for earlier, later in zip(ids, ids[1:])):
        return "ids are not sorted"
    return None


def parse_ledger(lines: Iterable[str]) -> tuple[list[LedgerEntry], list[str]]:
    """The valid entries among ``lines``, in file order, and one problem per line that is not one (from 1)."""
    numbered, problems = _json_lines(lines, check_ledger_record, shown=80)
    return [LedgerEntry(step=record["step"], epoch=record["epoch"], start=record["start"], stop=record["stop"],
                        world_size=record["world_size"], ids=tuple(record["ids"]), line=number)
            for number, record in numbered], problems


def read_ledger(log_dir: str | os.PathLike[str]) -> tuple[list[LedgerEntry], list[str]] | None:
    """The entries of ``<log_dir>/samples.jsonl`` (see :func:`parse_ledger`); None when there is no such file."""
    try:
        with open(os.path.join(log_dir, SAMPLES_FILE), encoding="utf-8", errors="replace") as handle:
            return parse_ledger(handle)
    except FileNotFoundError:
        return None
