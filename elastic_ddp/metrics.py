"""Step metrics: a JSONL file (rank 0), a progress line, and the timers that feed them."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any


class MetricsWriter:
    """Appends one JSON object per line to ``<log_dir>/metrics.jsonl``; a no-op without a directory.

    Each line is flushed as it is written, so a crashed run keeps every line before the crash.
    """

    def __init__(self, log_dir: str, enabled: bool) -> None:
        self.path = os.path.join(log_dir, "metrics.jsonl") if (log_dir and enabled) else ""
        self._file: IO[str] | None = None
        if self.path:
            os.makedirs(log_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the writer's life, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
