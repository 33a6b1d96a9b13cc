"""metrics.jsonl and its TensorBoard twin: the same scalars, plus markers where the run resumed or started fresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import TensorDataset

from elastic_ddp.build import Built
from elastic_ddp.config import LogConfig
from elastic_ddp.events import Event, EventLog
from elastic_ddp.metrics import TENSORBOARD_DIR, MetricsWriter, StepTimer
from elastic_ddp.report import StepReport


def board(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def texts(accumulator: EventAccumulator, tag: str) -> dict[int, str]:
    return {event.step: event.tensor_proto.string_val[0].decode() for event in accumulator.Tensors(f"{tag}/text_summary")}


def test_tensorboard_gets_every_metrics_scalar_and_a_marker_at_each_resume_and_fresh_start(tmp_path: Path) -> None:
    events = EventLog(str(tmp_path), run_id="unit", rank=0)
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True, events=events)
    events.emit(Event.STARTED_FRESH, world_size=2, reason="no-checkpoint")
    for step in (10, 20):
        writer.write({"step": step, "epoch": 0, "loss": 1.0 / step, "lr": 0.01, "world_size": 2, "time": 1.0e9 + step,
                      "samples_per_s": 100.0, "tokens_per_s": 900.0, "step_time_s": 0.1, "data_wait_s": 0.002})
    writer.write({"step": 20, "eval_loss": 0.5, "eval_accuracy": 0.75, "time": 1.0e9 + 21})
    events.emit(Event.RESUMED, step=20, path="ckpt/step-00000020", saved_world_size=2, world_size=3, rank_state_reused=False,
                source="storage")
    writer.close()
    events.close()

    accumulator = board(tmp_path)
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for name in ("loss", "lr", "samples_per_s", "tokens_per_s", "step_time_s", "data_wait_s", "world_size", "epoch",
                 "eval_loss", "eval_accuracy"):
        expected = {record["step"]: record[name] for record in jsonl if name in record}
        assert scalars(accumulator, name) == pytest.approx(expected), name
    assert scalars(accumulator, "membership/world_size") == {0: 2, 20: 3}
    assert scalars(accumulator, "membership/resumed") == {0: 0, 20: 1}
    marks = texts(accumulator, "membership")
    assert "started fresh at world size 2" in marks[0]
    assert "resumed from step 20" in marks[20] and "saved at world size 2, now 3" in marks[20]


def test_without_a_log_directory_or_on_other_ranks_nothing_is_written(tmp_path: Path) -> None:
    events = EventLog("", run_id="unit", rank=1)
    writer = MetricsWriter(str(tmp_path), enabled=False, tensorboard=True, events=events)
    writer.write({"step": 1, "loss": 1.0})
    events.emit(Event.STARTED_FRESH, world_size=2, reason="no-checkpoint")
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_needs_a_log_directory_and_the_package(monkeypatch) -> None:
    assert LogConfig(tensorboard=True, dir="logs").problems() == []
    assert ("tensorboard", "needs --log-dir") in LogConfig(tensorboard=True).problems()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    problems = dict(LogConfig(tensorboard=True, dir="logs").problems())
    assert problems["tensorboard"] == "the tensorboard package is not installed: pip install 'elastic-ddp[tensorboard]'"


def test_a_rank_that_becomes_rank_0_in_process_takes_over_the_metrics_file_and_the_old_one_leaves_it(
        tmp_path: Path) -> None:
    """After an in-process re-formation that lost rank 0, the new rank 0 appends the step records (a chaos run
    and the launcher read them); a rank that stops being rank 0 writes none."""
    built = Built(model=torch.nn.Linear(2, 2), train_data=TensorDataset(torch.zeros(4, 2), torch.zeros(4)))
    log = LogConfig(dir=str(tmp_path))
    # one process plays both ranks: world size 1 keeps log_step's all-reduce out
    old, new = (StepReport(built, log, rank=rank, world_size=1, events=EventLog.off()) for rank in (0, 1))
    timer = StepTimer()
    timer.add(4, 0.01, 0.0)
    old.log_step(1, 0, 0.1, timer, torch.tensor([1.0, 4.0], dtype=torch.float64))
    old.follow(1, 1)
    new.follow(0, 1)
    old.log_step(2, 0, 0.1, timer, torch.tensor([1.0, 4.0], dtype=torch.float64))
    new.log_step(2, 0, 0.1, timer, torch.tensor([2.0, 4.0], dtype=torch.float64))
    new.metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(record["step"], record["loss"]) for record in records] == [(1, 0.25), (2, 0.5)]
