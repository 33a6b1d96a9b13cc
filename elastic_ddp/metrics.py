"""Step metrics: a JSONL file (rank 0), the same scalars for TensorBoard, a progress bar, and the timers that feed them.

Under ``elastic-ddp launch`` rank 0 also feeds the launcher's console: the launcher names a file in
:data:`PROGRESS_FILE_ENV`, and rank 0 appends one JSON line to it for the step it reached (at most
every :data:`FEED_INTERVAL_S`, and the last step) and one for each metrics line (loss, samples/s, world
size): :class:`ProgressFeed`; the launcher reads it (:mod:`elastic_ddp.launcher.console`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any

from tqdm import tqdm

from elastic_ddp.events import Event, EventLog

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
"""Under the log directory: the TensorBoard run directory (``tensorboard --logdir <log-dir>/tensorboard``)."""
_NOT_SCALARS = frozenset({"step", "time"})
PROGRESS_FILE_ENV = "ELASTIC_DDP_PROGRESS_FILE"
"""Set by ``elastic-ddp launch`` for every worker: the file rank 0 appends its progress to (:class:`ProgressFeed`)."""
FEED_INTERVAL_S = 0.5
"""The least time between two step lines of the feed."""
FEED_FIELDS = ("step", "total", "epoch", "loss", "samples_per_s", "tokens_per_s", "world_size")
"""What a feed line may carry besides ``time`` (each line has ``time`` and ``step``)."""


class ProgressFeed:
    """Rank 0's progress for the launcher's console: one JSON object per line, appended with one ``os.write`` to
    the file :data:`PROGRESS_FILE_ENV` names (opened ``O_APPEND``, as the events file is, so restarted workers and
    a rank 0 on another node append to the same file). A no-op elsewhere, and after a failed write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._last_step_line = 0.0
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                self._fd = None

    @classmethod
    def from_env(cls, is_main: bool | None = None) -> ProgressFeed:
        """The feed of this process: the launcher's file for rank 0 (``is_main``, default: ``RANK`` is 0 or unset)."""
        if is_main is None:
            is_main = os.environ.get("RANK", "0") == "0"
        return cls(os.environ.get(PROGRESS_FILE_ENV, "") if is_main else "")

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def step(self, step: int, total: int, final: bool = False) -> None:
        """The step reached (of ``total``; 0: no end in steps); written at most every FEED_INTERVAL_S unless ``final``."""
        now = time.monotonic()
        if self._fd is None or (not final and now - self._last_step_line < FEED_INTERVAL_S):
            return
        self._last_step_line = now
        self._write({"step": step, **({"total": total} if total else {})})

    def metrics(self, record: dict[str, Any]) -> None:
        """A metrics line (what metrics.jsonl gets): its step, loss, throughput and world size."""
        if self._fd is not None and "step" in record and "loss" in record:
            self._write({name: record[name] for name in FEED_FIELDS if name in record})

    def _write(self, fields: dict[str, Any]) -> None:
        assert self._fd is not None
        try:
            os.write(self._fd, (json.dumps({"time": time.time(), **fields}) + "\n").encode())
        except OSError:
            self.close()  # the console is a view: training goes on without it

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MetricsWriter:
    """Appends one JSON object per line to ``<log_dir>/metrics.jsonl``; a no-op without a directory.

    Each line is flushed as it is written, so a crashed run keeps every line before the crash.
    With ``tensorboard``, every number of every line is also a TensorBoard scalar at the line's
    step, and the resumes and fresh starts that ``events`` reports are marked (see :class:`TensorBoardWriter`).
    """

    def __init__(self, log_dir: str, enabled: bool, tensorboard: bool = False, events: EventLog | None = None) -> None:
        self.path = os.path.join(log_dir, METRICS_FILE) if (log_dir and enabled) else ""
        self._feed = ProgressFeed.from_env(is_main=enabled)
        """The launcher's console gets every line too (:class:`ProgressFeed`), with or without a log directory."""
        self._file: IO[str] | None = None
        self._board: TensorBoardWriter | None = None
        self._events = events
        if self.path:
            os.makedirs(log_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the writer's life, closed by close()
            if tensorboard:
                self._board = TensorBoardWriter(os.path.join(log_dir, TENSORBOARD_DIR))
                if events is not None:
                    events.add_listener(self._board.mark)

    def write(self, record: dict[str, Any]) -> None:
        self._feed.metrics(record)
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        if self._board is not None:
            self._board.scalars(record)

    def close(self) -> None:
        self._feed.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            if self._events is not None:
                self._events.remove_listener(self._board.mark)
            self._board.close()
            self._board = None


class TensorBoardWriter:
    """TensorBoard event files with metrics.jsonl's scalars, plus markers where the run's membership changed.

    Scalars keep their metrics.jsonl names (``loss``, ``lr``, ``samples_per_s``, ``tokens_per_s``,
    ``step_time_s``, ``data_wait_s``, ``world_size``, ``epoch``, ``eval_<name>``). A resume (every
    launch after a membership change resumes) and a fresh start add ``membership/world_size`` and
    ``membership/resumed`` (1 for a resume, 0 for a fresh start) at the step training goes on from,
    and a text ``membership`` saying what happened; a stop agreement adds a ``stop`` text.
    """

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.directory = directory
        self._writer = SummaryWriter(log_dir=directory)

    def scalars(self, record: dict[str, Any]) -> None:
        step, walltime = record["step"], record.get("time")
        for name, value in record.items():
            if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, step, walltime=walltime)
        self._writer.flush()

    def mark(self, event: dict[str, Any]) -> None:
        """An :class:`~elastic_ddp.events.EventLog` listener: marks resumes, fresh starts and stop agreements."""
        kind, walltime = event["event"], event.get("time")
        if kind == Event.RESUMED:
            step = event["step"]
            source = "a node's replica" if event.get("source") == "replica" else "storage"
            text = (f"resumed from step {step} ({source}: {event['path']}), saved at world size "
                    f"{event['saved_world_size']}, now {event['world_size']}")
            self._membership(step, event["world_size"], 1, text, walltime)
        elif kind == Event.STARTED_FRESH:
            self._membership(0, event["world_size"], 0, f"started fresh at world size {event['world_size']} "
                             f"({event['reason']})", walltime)
        elif kind == Event.STOP_AGREED:
            self._writer.add_text("stop", f"stop agreed at step {event['step']}: {event['reason']}", event["step"],
                                  walltime=walltime)
            self._writer.flush()

    def _membership(self, step: int, world_size: int, resumed: int, text: str, walltime: float | None) -> None:
        self._writer.add_scalar("membership/world_size", world_size, step, walltime=walltime)
        self._writer.add_scalar("membership/resumed", resumed, step, walltime=walltime)
        self._writer.add_text("membership", text, step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def bar_width(stream: IO[str]) -> dict[str, Any]:
    """tqdm's size options for ``stream``: follow the terminal's size, or 100 columns and 24 rows where it reports
    none (a pty of size 0, as ``script`` makes one: tqdm would draw nothing)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        size = os.terminal_size((0, 0))
    return {"dynamic_ncols": True} if size.columns > 0 and size.lines > 0 else {"ncols": 100, "nrows": 24}


class Progress:
    """Rank 0's progress bar on stderr (tqdm): steps done of ``total``, the rate, the time left and ``text`` (the
    loss); drawn only when ``enabled`` (rank 0, a terminal: :meth:`wanted`). Under ``elastic-ddp launch`` rank 0
    also feeds the launcher's console (:class:`ProgressFeed`), terminal or not."""

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._bar: tqdm | None = None
        self._feed = ProgressFeed.from_env()
        self._step: int | None = None

    @staticmethod
    def wanted(mode: str, is_main: bool) -> bool:
        return is_main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))

    def update(self, step: int, text: str) -> None:
        self._step = step
        self._feed.step(step, self.total, final=step == self.total)
        if not self.enabled:
            return
        if self._bar is None:  # from the step this launch resumed at: the rate and time left are this launch's
            self._bar = tqdm(total=self.total or None, initial=max(step - 1, 0), file=self.stream, unit="step",
                             mininterval=0.1, leave=True, **bar_width(self.stream))
        self._bar.update(step - self._bar.n)
        if text:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._step is not None:
            self._feed.step(self._step, self.total, final=True)
        self._feed.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class StepTimer:
    """Accumulates step time and data-wait time between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.samples = 0
        self.step_time = 0.0
        self.data_wait = 0.0

    def add(self, samples: int, step_time: float, data_wait: float) -> None:
        self.steps += 1
        self.samples += samples
        self.step_time += step_time
        self.data_wait += data_wait

    def summary(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {
            "step_time_s": self.step_time / steps,
            "data_wait_s": self.data_wait / steps,
            "samples_per_s": self.samples / self.step_time if self.step_time > 0 else 0.0,
        }
