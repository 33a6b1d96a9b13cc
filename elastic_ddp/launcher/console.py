"""What ``elastic-ddp launch`` prints while its job runs, and how it ends.

Two files are read, both structured, from where they stood when this launch started (a work directory
launched again keeps the previous launches' lines):

- rank 0's progress feed (:class:`elastic_ddp.metrics.ProgressFeed`, the file the launcher names in
  ``ELASTIC_DDP_PROGRESS_FILE``): the step reached, and at each ``--log-every`` line the loss, samples/s
  and world size;
- the run's events (``<--log-dir>/events.jsonl``, :mod:`elastic_ddp.events`), when the script was given a
  ``--log-dir``: every restart, membership change, recovery, stop and failed worker is one line as it
  happens, and the job's end comes from the workers' ``exit`` and ``done`` events.

On a terminal the progress is a live bar (tqdm) under those lines: step of total, loss, samples/s, world
size and the time left. Without one (a pipe, a CI log) it is one line every ``progress_every_s`` seconds::

    12:03:07 step 120/300 (40%) | loss 0.4321 | 85.3 samples/s | world 2 | ETA 0:21

The time left is the steps to go at the rate of the last half minute of steps (the worker's clock), so a
restart's pause shows as a slower rate, then wears off. The end is one line per node (its agent's exit
status and log file) and then one line that says how the job ended: done at step S, or why it did not —
for a configuration mistake the message of the worker's ``exit`` event (reason ``config``, status 2), not
torchrun's error banner.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from elastic_ddp.events import EVENTS_FILE, Event, parse_events
from elastic_ddp.metrics import bar_width

RATE_WINDOW_S = 30.0
"""The steps of this many seconds (worker time) give the rate the time left is computed at."""


def log_dir_of(command: Sequence[str]) -> str:
    """The ``--log-dir`` given to the training script (``--log-dir DIR`` or ``--log-dir=DIR``), or ""."""
    for index, arg in enumerate(command):
        if arg == "--log-dir" and index + 1 < len(command):
            return command[index + 1]
        if arg.startswith("--log-dir="):
            return arg.split("=", 1)[1]
    return ""


class Tail:
    """The whole lines appended to a file since this object was made (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.offset = path.stat().st_size
        except OSError:
            self.offset = 0
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size < self.offset:  # replaced: read it from its start
                    self.offset, self._partial = 0, b""
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        whole, _, self._partial = data.rpartition(b"\n")
        return [line.decode(errors="replace") for line in whole.split(b"\n")] if whole else []


def _interval(seconds: float) -> str:
    return tqdm.format_interval(max(0, int(seconds)))


def _first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return " ".join(line.strip() for line in lines) if lines else ""


@dataclass
class Progress:
    """Rank 0's latest progress, from the feed."""

    step: int | None = None
    total: int = 0
    loss: float | None = None
    samples_per_s: float | None = None
    world_size: int | None = None
    seen: deque[tuple[float, int]] = field(default_factory=deque)
    """(worker time, step) of the last RATE_WINDOW_S."""

    def add(self, record: dict[str, Any]) -> bool:
        step, when = record.get("step"), record.get("time")
        if not isinstance(step, int) or not isinstance(when, (int, float)):
            return False
        if self.step is not None and step < self.step:  # a restart went back to an older step: a new rate
            self.seen.clear()
        self.step = step
        self.total = int(record.get("total") or self.total)
        for name in ("loss", "samples_per_s", "world_size"):
            if record.get(name) is not None:
                setattr(self, name, record[name])
        self.seen.append((float(when), step))
        while self.seen and self.seen[0][0] < when - RATE_WINDOW_S:
            self.seen.popleft()
        return True

    def eta_s(self) -> float | None:
        if not self.total or self.step is None or len(self.seen) < 2:
            return None
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (self.total - s1) / ((s1 - s0) / (t1 - t0))

    def fields(self) -> list[str]:
        """loss, samples/s, world size, ETA: what is known of them."""
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:.1f} samples/s")
        if self.world_size is not None:
            parts.append(f"world {self.world_size}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_interval(eta)}")
        return parts

    def line(self) -> str:
        of = f"/{self.total} ({100 * (self.step or 0) // self.total}%)" if self.total else ""
        return " | ".join([f"step {self.step}{of}", *self.fields()])


class Console:
    """Reads the job's progress feed and events and prints them (see the module's docstring)."""

    def __init__(self, progress_file: Path, log_dir: str, stream: IO[str] | None = None, *,
                 terminal: bool | None = None, progress_every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.terminal = self._isatty() if terminal is None else terminal
        self.progress_every_s = progress_every_s
        self.feed = Tail(progress_file)
        self.log_dir = log_dir
        self.events = Tail(Path(log_dir) / EVENTS_FILE) if log_dir else None
        self.seen: list[dict[str, Any]] = []
        """This launch's events, in file order."""
        self.progress = Progress()
        self._bar: tqdm | None = None
        self._last_line = time.monotonic()
        self._printed_step: int | None = None
        self._world_size: int | None = None
        self._formations = 0
        self._broken = False
        self._closed = False

    def _isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError, OSError):
            return False

    # -- output -----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        """One line, above the bar on a terminal. A closed terminal (EIO) or pipe ends the console's output,
        never the launcher's cleanup."""
        if self._broken:
            return
        try:
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()
        except (OSError, ValueError):
            self._broken = True

    def note(self, text: str) -> None:
        """A line about the job, stamped with the wall-clock time."""
        self.say(f"{time.strftime('%H:%M:%S')} {text}")

    # -- reading ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Read what the feed and the events gained since the last call and print it."""
        if self.events is not None:
            records, _ = parse_events(self.events.lines())
            for record in records:
                self.seen.append(record)
                line = self.describe(record)
                if line:
                    self.note(line)
        changed = False
        for line in self.feed.lines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            changed |= isinstance(record, dict) and self.progress.add(record)
        if self.progress.step is None:
            return
        if self.terminal:
            self._draw(changed)
        elif self.progress_every_s > 0 and time.monotonic() - self._last_line >= self.progress_every_s \
                and self.progress.step != self._printed_step:
            self._last_line = time.monotonic()
            self._printed_step = self.progress.step
            self.note(self.progress.line())

    def _draw(self, changed: bool) -> None:
        if self._broken:
            return
        progress = self.progress
        try:
            if self._bar is None:
                self._bar = tqdm(total=progress.total or None, initial=progress.step or 0, file=self.stream,
                                 unit="step", mininterval=0.2, **bar_width(self.stream),
                                 bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
                                 if progress.total else "step {n_fmt} [{elapsed}{postfix}]")
            if changed:
                if progress.total and self._bar.total != progress.total:
                    self._bar.total = progress.total
                self._bar.n = progress.step or 0
                self._bar.set_postfix_str(", ".join(progress.fields()), refresh=False)
            self._bar.refresh()
        except (OSError, ValueError):
            self._broken = True

    def describe(self, record: dict[str, Any]) -> str:
        """The console's line for one event ("" for those it does not show): restarts, membership changes,
        recoveries, stops, failed workers."""
        kind, rank = record["event"], record["rank"]
        if kind == Event.PROCESS_GROUP_FORMED and rank == 0:
            world, before = record["world_size"], self._world_size
            self._world_size = world
            self._formations += 1
            if self._formations == 1:
                return f"process group formed: world size {world} (torchrun restart {record['restart_count']})"
            change = f", membership change from world size {before}" if before is not None and before != world else ""
            return (f"restart: attempt {self._formations} formed at world size {world}{change} "
                    f"(torchrun restart {record['restart_count']})")
        if kind == Event.RESUMED and rank == 0:
            source = "node memory" if record["source"] == "replica" else "storage"
            return (f"recovered: resumed from step {record['step']} ({source}), saved at world size "
                    f"{record['saved_world_size']}, now {record['world_size']}")
        if kind == Event.STARTED_FRESH and rank == 0:
            return f"started fresh at world size {record['world_size']} ({record['reason']})"
        if kind == Event.STOP_AGREED and rank == 0:
            return f"stop agreed at step {record['step']}: {record['reason']} ({record['source']})"
        if kind == Event.WATCHDOG_FIRED:
            return f"rank {rank}: watchdog fired in {record['phase']} after {record['stuck_s']:.0f} s ({record['reason']})"
        if kind == Event.RESTORE_FAILED:
            return f"rank {rank}: restore failed: {_first_line(record['error'])}"
        if kind == Event.SAVE_FAILED and rank == 0:
            return f"save of step {record['step']} failed: {_first_line(record['error'])}"
        if kind in (Event.CHECKPOINT_SKIPPED, Event.UNCOMMITTED) and rank == 0:
            verb = "skipped" if kind == Event.CHECKPOINT_SKIPPED else "set aside"
            return f"checkpoint of step {record['step']} {verb}: {_first_line(record['reason'])}"
        if kind == Event.EXIT and record["status"] != 0:
            why = _first_line(record.get("error") or record.get("detail"))
            return f"rank {rank} exited: {record['reason']} (status {record['status']})" + (f": {why}" if why else "")
        return ""

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Read what is left, say the last step reached without a terminal, and take the bar down (the summary
        follows it). Once closed, it reads and prints nothing more."""
        if self._closed:
            return
        self.poll()
        self._closed = True
        if not self.terminal and self.progress_every_s > 0 and self.progress.step not in (None, self._printed_step):
            self._printed_step = self.progress.step
            self.note(self.progress.line())
        if self._bar is not None:
            try:
                self._bar.close()
            except (OSError, ValueError):
                self._broken = True
            self._bar = None

    def outcome(self, codes: dict[str, int | None]) -> str:
        """The last line: how the job ended, from the events where there are some."""
        exits = [record for record in self.seen if record["event"] == Event.EXIT]
        config = [record for record in exits if record["reason"] == "config"]
        if config:
            first = config[0]
            return (f"elastic-ddp: rank {first['rank']} ended the job ({first['reason']}, exit status {first['status']}): "
                    f"{_first_line(first.get('error') or first.get('detail'))}")
        if all(code == 0 for code in codes.values()):
            done = [record for record in self.seen if record["event"] == Event.DONE and record["rank"] == 0]
            if done:
                end = done[-1]
                extra = "".join(f", {name} {end[name]:.4f}" for name in ("loss", "accuracy")
                                if isinstance(end.get(name), (int, float)))
                return f"elastic-ddp: done at step {end['step']} (epoch {end['epoch']}{extra})"
            stopped = [record for record in exits if record["rank"] == 0]
            if stopped and stopped[-1]["reason"] != "done":
                return f"elastic-ddp: the job stopped: rank 0 exited {stopped[-1]['reason']} at step {stopped[-1].get('step')}"
            return "elastic-ddp: every node exited 0" + ("" if self.log_dir else " (give the script --log-dir for more)")
        if any(code is None for code in codes.values()):
            return "elastic-ddp: the job was stopped at --timeout-s"
        failed = [record for record in exits if record["status"] not in (0, 75)] or \
            [record for record in exits if record["status"] != 0]
        if failed:
            last = failed[-1]
            why = _first_line(last.get("error") or last.get("detail"))
            return (f"elastic-ddp: the job failed: rank {last['rank']} exited {last['reason']} (status {last['status']})"
                    + (f": {why}" if why else ""))
        bad = next(name for name, code in codes.items() if code != 0)
        return f"elastic-ddp: the job failed: {bad} exited {codes[bad]}; its log says why"
