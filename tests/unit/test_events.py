"""The run's event stream: records, the closed set of kinds, concurrent appenders, and what the runtime's
components emit (checkpoint manager, stop agreement, watchdog, exit) without processes of their own."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import pytest

from chaos.cluster import wait_for
from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.storage import FileRecord, LocalStorage
from elastic_ddp.errors import CheckpointError, NoValidCheckpointError
from elastic_ddp.events import EVENTS_FILE, FIELDS, Event, EventLog, parse_events, read_events
from elastic_ddp.resilience.agreement import StopAgreement
from elastic_ddp.resilience.exits import ExitReason, log_exit
from elastic_ddp.resilience.stop import StopRequests
from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog
from tests.unit.test_checkpoint_local import advance, make_state


def events_of(log_dir: Path) -> list[dict]:
    records, problems = read_events(log_dir)
    assert not problems, problems
    return records


def kinds(log_dir: Path) -> list[str]:
    return [record["event"] for record in events_of(log_dir)]


def test_an_event_is_one_line_with_the_common_fields_and_its_own(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path), run_id="job1", rank=3)
    log.set_step(40)
    log.emit(Event.COMMITTED, step=40, path="/c/step-00000040", world_size=4, files=5, bytes=1000)
    log.emit(Event.EXIT, reason="done", status=0)
    log.close()
    committed, exit_ = events_of(tmp_path)
    assert {key: committed[key] for key in ("event", "run_id", "rank", "step", "path", "world_size")} == {
        "event": "committed", "run_id": "job1", "rank": 3, "step": 40, "path": "/c/step-00000040", "world_size": 4}
    assert committed["pid"] == os.getpid() and isinstance(committed["time"], float) and committed["host"]
    assert exit_["step"] == 40, "an event without a step of its own is about the current step"
    assert (tmp_path / EVENTS_FILE).read_text().count("\n") == 2


def test_a_kind_outside_the_set_or_a_missing_field_is_refused(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path), run_id="r", rank=0)
    with pytest.raises(ValueError):
        log.emit("resume", step=1)  # the kind is "resumed"
    with pytest.raises(ValueError, match="needs reason"):
        log.emit(Event.EXIT, status=0)
    log.close()
    assert not (tmp_path / EVENTS_FILE).read_text()


def test_every_kind_has_its_fields_documented() -> None:
    assert set(FIELDS) == set(Event)
    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    section = reference.split("## Events", 1)[1].split("\n## ", 1)[0]
    for kind in Event:
        assert f"`{kind.value}`" in section, kind
        for name in FIELDS[kind]:
            assert f"`{name}`" in section, (kind, name)


def test_without_a_log_directory_nothing_is_written(tmp_path: Path) -> None:
    log = EventLog("", run_id="r", rank=0)
    log.emit(Event.STOP_REQUESTED, reason="signal:SIGTERM")
    assert not log.enabled and not any(tmp_path.iterdir())
    with pytest.raises(ValueError):  # still checked: a typo shows in every test, with or without a directory
        log.emit(Event.STOP_REQUESTED)


def _append(log_dir: str, rank: int, count: int) -> None:
    log = EventLog(log_dir, run_id="r", rank=rank)
    for step in range(count):
        log.emit(Event.SAVE_FAILED, step=step, error="x" * (50 + 37 * rank))
    log.close()


def test_concurrent_appenders_never_interleave_lines(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_append, args=(str(tmp_path), rank, 300)) for rank in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    records = events_of(tmp_path)
    assert len(records) == 1200
    for rank in range(4):
        assert [r["step"] for r in records if r["rank"] == rank] == list(range(300))


def _emit_then_die(log_dir: str) -> None:
    EventLog(log_dir, run_id="r", rank=0).emit(Event.STOP_REQUESTED, reason="signal:SIGTERM")
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_process_killed_right_after_an_event_keeps_it(tmp_path: Path) -> None:
    child = multiprocessing.get_context("fork").Process(target=_emit_then_die, args=(str(tmp_path),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    assert kinds(tmp_path) == ["stop_requested"]


def test_lines_that_are_not_events_are_reported_not_raised() -> None:
    good = json.dumps({"time": 1.0, "event": "exit", "run_id": "r", "rank": 0, "host": "h", "pid": 1,
                       "reason": "done", "status": 0})
    lines = [good, "not json", "[1, 2]", json.dumps({"event": "exploded"}), good.replace('"rank": 0', '"rank": "0"'),
             json.dumps({"time": 1.0, "event": "resumed", "run_id": "r", "rank": 0, "host": "h", "pid": 1}), '{"time": 2']
    records, problems = parse_events(lines)
    assert len(records) == 1
    assert [problem.split(":", 1)[0] for problem in problems] == [f"line {n}" for n in range(2, 8)]
    assert "not a JSON object" in problems[1] and "unknown event 'exploded'" in problems[2]
    assert "rank '0' is not an integer" in problems[3] and "resumed without step" in problems[4]


def test_a_missing_events_file_is_a_problem_not_an_empty_run(tmp_path: Path) -> None:
    records, problems = read_events(tmp_path)
    assert records == [] and problems == [f"{tmp_path / EVENTS_FILE}: no such file"]


# -- what the components emit --------------------------------------------------------------------


def manager(root: Path, log_dir: Path) -> CheckpointManager:
    return CheckpointManager(str(root), rank=0, world_size=1, run_id="unit", events=EventLog(str(log_dir), run_id="unit", rank=0))


def test_a_save_commits_and_a_restore_resumes_in_events(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    state = make_state()
    assert manager(tmp_path / "ckpt", logs).restore(state) is None
    advance(state, 2)
    manager(tmp_path / "ckpt", logs).save(state)
    manager(tmp_path / "ckpt", logs).restore(make_state(seed=1))
    fresh, committed, resumed = events_of(logs)
    assert (fresh["event"], fresh["reason"]) == ("started_fresh", "no-checkpoint")
    assert (committed["event"], committed["step"]) == ("committed", 2)
    assert committed["path"] == str(tmp_path / "ckpt" / "step-00000002")
    assert (resumed["event"], resumed["step"], resumed["saved_world_size"], resumed["rank_state_reused"]) == (
        "resumed", 2, 1, True)


def test_a_damaged_checkpoint_is_skipped_and_uncommitted_in_events(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    state = make_state()
    for _ in range(2):
        advance(state, 2)
        manager(tmp_path / "ckpt", logs).save(state)
    replicated = next((tmp_path / "ckpt" / "step-00000004").glob("replicated-*"))
    replicated.write_bytes(b"garbage")
    manager(tmp_path / "ckpt", logs).restore(make_state())
    records = events_of(logs)
    assert [r["event"] for r in records] == ["committed", "committed", "checkpoint_skipped", "uncommitted", "resumed"]
    skipped, uncommitted, resumed = records[2:]
    assert skipped["step"] == uncommitted["step"] == 4 and "size" in skipped["reason"]
    assert resumed["step"] == 2


def test_a_restore_that_finds_nothing_valid_fails_in_events(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    state = make_state()
    advance(state)
    manager(tmp_path / "ckpt", logs).save(state)
    next((tmp_path / "ckpt" / "step-00000001").glob("replicated-*")).write_bytes(b"x")
    with pytest.raises(NoValidCheckpointError):
        manager(tmp_path / "ckpt", logs).restore(make_state())
    assert kinds(logs) == ["committed", "checkpoint_skipped", "restore_failed"]
    assert "no valid checkpoint" in events_of(logs)[-1]["error"]


class FailingStorage(LocalStorage):
    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        raise CheckpointError(f"{path}: disk full")


def test_a_failed_save_is_an_event_naming_its_step(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    events = EventLog(str(logs), run_id="unit", rank=0)
    broken = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit",
                               storage=FailingStorage(str(tmp_path / "ckpt")), events=events)
    state = make_state()
    advance(state, 3)
    with pytest.raises(CheckpointError):
        broken.save(state)
    (failed,) = events_of(logs)
    assert (failed["event"], failed["step"]) == ("save_failed", 3) and "disk full" in failed["error"]


def test_a_stop_is_requested_and_agreed_once_each(tmp_path: Path) -> None:
    requests = StopRequests()
    agreement = StopAgreement(world_size=1, requests=requests, events=EventLog(str(tmp_path), run_id="r", rank=0))
    assert agreement.after_step(1, 0.1).stop is None
    requests.request("signal:SIGTERM")
    assert agreement.after_step(2, 0.1).stop == "preempted"
    agreement.after_step(3, 0.1)
    requested, agreed = events_of(tmp_path)
    assert (requested["event"], requested["reason"]) == ("stop_requested", "signal:SIGTERM")
    assert (agreed["event"], agreed["step"], agreed["reason"], agreed["source"]) == (
        "stop_agreed", 2, "preempted", "signal:SIGTERM")


def test_the_watchdog_records_its_expiry_and_the_exit(tmp_path: Path) -> None:
    exits: list[int] = []
    events = EventLog(str(tmp_path), run_id="r", rank=0)
    events.set_step(7)
    watchdog = Watchdog({Phase.STEP: PhaseLimit(0.2, "hang")}, poll_s=0.02, exit=exits.append, events=events).start()
    try:
        watchdog.enter(Phase.STEP)
        wait_for(lambda: exits, 10, "the watchdog to fire")
    finally:
        watchdog.close()
    fired, exit_ = events_of(tmp_path)
    assert (fired["event"], fired["phase"], fired["reason"], fired["step"]) == ("watchdog_fired", "step", "hang:step", 7)
    assert (exit_["event"], exit_["reason"], exit_["status"]) == ("exit", "hang:step", 76) and exits == [76]


def test_the_exit_event_carries_the_error_the_log_line_leaves_out(tmp_path: Path) -> None:
    events = EventLog(str(tmp_path), run_id="r", rank=1)
    assert log_exit(ExitReason.ERROR, events=events, error="checkpoint location s3://b/p is not usable") == 1
    (exit_,) = events_of(tmp_path)
    assert (exit_["reason"], exit_["status"], exit_["error"]) == ("error", 1, "checkpoint location s3://b/p is not usable")

