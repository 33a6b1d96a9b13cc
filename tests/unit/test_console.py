"""The launcher's console (elastic_ddp.launcher.console) and rank 0's progress feed (elastic_ddp.metrics), no processes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from elastic_ddp.events import EventLog
from elastic_ddp.launcher.console import Console, Tail, log_dir_of
from elastic_ddp.metrics import PROGRESS_FILE_ENV, MetricsWriter, Progress


def console(tmp_path: Path, terminal: bool = False, every: float = 0.0) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(tmp_path / "progress.jsonl", str(tmp_path / "logs"), out, terminal=terminal,
                   progress_every_s=every), out


def test_the_log_dir_is_read_from_the_scripts_arguments() -> None:
    assert log_dir_of(["--max-steps", "5", "--log-dir", "runs/logs"]) == "runs/logs"
    assert log_dir_of(["--log-dir=/tmp/x"]) == "/tmp/x"
    assert log_dir_of(["--log-dir-other", "x"]) == "" and log_dir_of(["--log-dir"]) == ""


def test_a_tail_reads_only_whole_lines_appended_since_it_was_made(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text("old\n")
    tail = Tail(path)
    with open(path, "a") as handle:
        handle.write("one\ntw")
    assert tail.lines() == ["one"]
    with open(path, "a") as handle:
        handle.write("o\n")
    assert tail.lines() == ["two"] and tail.lines() == []


def test_rank_0s_progress_reaches_the_console_through_the_feed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    view, out = console(tmp_path, every=1e-9)
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(tmp_path / "progress.jsonl"))
    monkeypatch.setenv("RANK", "0")
    progress, writer = Progress(100, enabled=False), MetricsWriter("", enabled=True)
    progress.update(1, "")
    progress.update(10, "")  # within the feed's interval: not written until close
    writer.write({"step": 10, "loss": 0.5, "samples_per_s": 123.4, "world_size": 2, "lr": 0.1})
    progress.close()
    writer.close()
    view.poll()
    assert view.progress.step == 10 and view.progress.total == 100
    assert "step 10/100 (10%) | loss 0.5000 | 123.4 samples/s | world 2" in out.getvalue().splitlines()[-1]


def test_only_rank_0_feeds_the_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(tmp_path / "progress.jsonl"))
    monkeypatch.setenv("RANK", "1")
    progress = Progress(100, enabled=False)
    progress.update(5, "")
    progress.close()
    MetricsWriter("", enabled=False).write({"step": 5, "loss": 1.0})
    assert not (tmp_path / "progress.jsonl").exists()


def test_the_time_left_is_the_steps_to_go_at_the_recent_rate(tmp_path: Path) -> None:
    view, _ = console(tmp_path)
    for when, step in ((100.0, 10), (110.0, 30)):
        view.progress.add({"time": when, "step": step, "total": 50})
    assert view.progress.eta_s() == pytest.approx(10.0)
    view.progress.add({"time": 111.0, "step": 5})  # a restart back to an older step: a new rate
    assert view.progress.eta_s() is None


def test_the_workers_own_bar_is_tqdm_from_the_step_the_launch_resumed_at() -> None:
    out = io.StringIO()
    progress = Progress(10, enabled=True, stream=out)
    for step in range(6, 11):
        progress.update(step, "loss 0.25")
    progress.close()
    assert "10/10" in out.getvalue() and "loss 0.25" in out.getvalue() and "5/10" in out.getvalue()


def emit_all(tmp_path: Path, records: list[tuple[int, str, dict]]) -> None:
    logs = {}
    for rank, kind, fields in records:
        log = logs.setdefault(rank, EventLog(str(tmp_path / "logs"), run_id="r", rank=rank))
        log.emit(kind, **fields)
    for log in logs.values():
        log.close()


def test_restarts_membership_changes_and_recoveries_are_one_line_each(tmp_path: Path) -> None:
    view, out = console(tmp_path)
    formed = {"backend": "gloo", "store": "h:1", "agent_store": False}
    emit_all(tmp_path, [
        (0, "process_group_formed", {"world_size": 2, "restart_count": 0, **formed}),
        (1, "process_group_formed", {"world_size": 2, "restart_count": 0, **formed}),
        (0, "started_fresh", {"world_size": 2, "reason": "no-checkpoint"}),
        (1, "exit", {"reason": "peer-lost", "status": 75, "detail": "a peer left"}),
        (0, "process_group_formed", {"world_size": 1, "restart_count": 1, **formed}),
        (0, "resumed", {"step": 40, "path": "/x", "saved_world_size": 2, "world_size": 1, "rank_state_reused": False,
                        "source": "replica"}),
    ])
    view.poll()
    lines = [line.split(" ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "process group formed: world size 2 (torchrun restart 0)",
        "started fresh at world size 2 (no-checkpoint)",
        "rank 1 exited: peer-lost (status 75): a peer left",
        "restart: attempt 2 formed at world size 1, membership change from world size 2 (torchrun restart 1)",
        "recovered: resumed from step 40 (node memory), saved at world size 2, now 1",
    ]


def test_a_configuration_mistake_is_the_last_line(tmp_path: Path) -> None:
    view, _ = console(tmp_path)
    emit_all(tmp_path, [(1, "exit", {"reason": "config", "status": 2, "detail": "",
                                     "error": "the loss left parameters without a gradient:\n  probe.weight"}),
                        (0, "exit", {"reason": "config", "status": 2, "detail": "", "error": "same"})])
    view.close()
    assert view.outcome({"node0": 2, "node1": 2}) == (
        "elastic-ddp: rank 1 ended the job (config, exit status 2): the loss left parameters without a gradient: probe.weight")


def test_the_end_of_a_job_that_finished_and_of_one_without_events(tmp_path: Path) -> None:
    view, _ = console(tmp_path)
    emit_all(tmp_path, [(0, "done", {"step": 30, "epoch": 1, "model_digest": "m", "data_digest": "d", "loss": 0.25})])
    view.close()
    assert view.outcome({"node0": 0}) == "elastic-ddp: done at step 30 (epoch 1, loss 0.2500)"
    bare = Console(tmp_path / "p.jsonl", "", io.StringIO(), terminal=False)
    assert bare.outcome({"node0": 1}) == "elastic-ddp: the job failed: node0 exited 1; its log says why"


def test_a_closed_terminal_ends_the_output_not_the_launcher(tmp_path: Path) -> None:
    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(5, "Input/output error")

    view = Console(tmp_path / "p.jsonl", "", Gone(), terminal=False)
    view.say("anything")  # no exception
    (tmp_path / "p.jsonl").write_text(json.dumps({"time": 1.0, "step": 3}) + "\n")
    view.close()
