"""The job-end record (elastic_ddp.job_end): what a worker that ends as ``config`` leaves for its agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ddp import job_end
from elastic_ddp.job_end import JobEnd, JobEndRecordError
from elastic_ddp.resilience.exits import ExitReason, tell_the_agent


@pytest.fixture
def agent_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(job_end.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(job_end.RUN_ID_ENV, "job/../1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    return tmp_path


def test_a_config_exit_leaves_one_line_for_the_agent(agent_dir: Path) -> None:
    tell_the_agent(ExitReason.CONFIG, "checkpoint at step 4 cannot be resumed by this run:\n  --seed was 1, is 7 now")
    found = job_end.read(str(agent_dir), "job/../1")
    assert found == JobEnd("config", 2, "checkpoint at step 4 cannot be resumed by this run: --seed was 1, is 7 now", 3)
    assert [p.name for p in agent_dir.iterdir()] == ["job_.._1.json"]  # inside the directory, whatever the run id


@pytest.mark.parametrize("reason", [ExitReason.ERROR, ExitReason.DIVERGENCE])
def test_other_exits_leave_nothing_so_the_agent_restarts(agent_dir: Path, reason: ExitReason) -> None:
    tell_the_agent(reason, "boom")
    assert job_end.read(str(agent_dir), "job/../1") is None and not list(agent_dir.iterdir())


def test_without_an_agent_that_looks_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(job_end.DIR_ENV, raising=False)
    assert job_end.tell_agent(JobEnd("config", 2, "x", 0)) is False


@pytest.mark.parametrize("payload", [
    b"not json", b"[]", b'{"reason": "config", "status": 0, "detail": "", "rank": 0}',
    b'{"reason": "rm -rf", "status": 2, "detail": "", "rank": 0}',
    b'{"reason": "config", "status": 2, "detail": 5, "rank": 0}',
    b'{"reason": "config", "status": true, "detail": "", "rank": 0}',
    b'{"reason": "config", "status": 2, "detail": "", "rank": -1}', b"{" + b" " * 9000 + b"}",
])
def test_bytes_that_are_not_a_record_are_refused(payload: bytes) -> None:
    with pytest.raises(JobEndRecordError):
        JobEnd.decode(payload)


def test_a_record_round_trips_and_a_damaged_file_is_ignored(tmp_path: Path) -> None:
    end = JobEnd("config", 2, "--global-batch-size: must be >= 1", 0)
    assert JobEnd.decode(end.encode()) == end
    Path(job_end.record_path(str(tmp_path), "r")).write_bytes(b"\x80garbage")
    assert job_end.read(str(tmp_path), "r") is None
