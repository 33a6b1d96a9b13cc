"""Step metrics: a JSONL file (rank 0), the same scalars for TensorBoard, a progress line, and the timers that feed them."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any

from elastic_ddp.events import Event, EventLog

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
"""Under the log directory: the TensorBoard run directory (``tensorboard --logdir <log-dir>/tensorboard``)."""
_NOT_SCALARS = frozenset({"step", "time"})


class MetricsWriter:
    """Appends one JSON object per line to ``<log_dir>/metrics.jsonl``; a no-op without a directory.

    Each line is flushed as it is written, so a crashed run keeps every line before the crash.
    With ``tensorboard``, every number of every line is also a TensorBoard scalar at the line's
    step, and the resumes and fresh starts that ``events`` reports are marked (see :class:`TensorBoardWriter`).
    """

    def __init__(self, log_dir: str, enabled: bool, tensorboard: bool = False, events: EventLog | None = None) -> None:
        self.path = os.path.join(log_dir, METRICS_FILE) if (log_dir and enabled) else ""
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
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        if self._board is not None:
            self._board.scalars(record)

    def close(self) -> None:
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


class Progress:
    """A one-line progress bar on stderr, redrawn in place; only when enabled (rank 0, a terminal)."""

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._last_draw = 0.0

    @staticmethod
    def wanted(mode: str, is_main: bool) -> bool:
        return is_main and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))

    def update(self, step: int, text: str) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last_draw < 0.1 and step != self.total):
            return
        self._last_draw = now
        width = 30
        filled = int(width * step / self.total) if self.total else 0
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{bar}] {step}/{self.total or '?'} {text}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


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
