"""``elastic-ddp launch`` (what ``scripts/run.sh`` runs) on one work directory, launched again after it failed,
after it was stopped, after it finished, and after it was already complete."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import REPO, child_env, events, run

pytestmark = pytest.mark.integration


def command(workdir: Path, max_steps: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "elastic_ddp.cli", "launch", "--nodes", "1:2", "--nproc-per-node", "1",
            "--workdir", str(workdir), *more, "--", str(REPO / "examples" / "train.py"), "--max-steps", str(max_steps),
            "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "10", "--log-dir", str(workdir / "logs"),
            "--log-every", "10"]


def rank0(workdir: Path, kind: str) -> list[dict]:
    return [event for event in events(workdir / "logs", kind) if event["rank"] == 0]


def stop_after(workdir: Path, max_steps: int, step: int) -> int:
    """Launch, SIGTERM the launcher (Ctrl-C's twin) once rank 0 committed ``step``, and return its status."""
    launcher = subprocess.Popen(command(workdir, max_steps), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(event["step"] >= step for event in rank0(workdir, "committed") if (workdir / "logs").exists()):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        return launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def newest_commit(workdir: Path) -> int:
    return max((event["step"] for event in rank0(workdir, "committed")), default=0)


def test_a_launch_goes_on_from_its_work_directory_after_a_failure_a_stop_and_the_end(tmp_path: Path) -> None:
    """Each launch finds what the previous one left (its embedded etcd's data with the rendezvous it closed,
    its node logs, its checkpoints) and trains on from the newest checkpoint; a run already complete resumes
    at its last step, trains nothing and exits 0; each summary shows its own launch only."""
    failed = run(command(tmp_path, 150, "--max-restarts", "0"), env={"ELASTIC_DDP_FAULT": "crash:1:25"}, timeout=300)
    assert failed.returncode != 0, failed.output[-3000:]
    for launch in ("stopped", "finished", "again", "longer"):
        resumes, committed = len(rank0(tmp_path, "resumed")), newest_commit(tmp_path)
        if launch == "stopped":
            stop_after(tmp_path, 150, committed + 20)
        else:
            result = run(command(tmp_path, {"finished": 150, "again": 150, "longer": 170}[launch]), timeout=300)
            assert result.returncode == 0, f"{launch}: {result.output[-3000:]}"
        # where the previous launch left it: its newest checkpoint, or a newer replica it left in node memory
        assert rank0(tmp_path, "resumed")[resumes]["step"] >= committed, launch
    assert [event["step"] for event in rank0(tmp_path, "done")][-3:] == [150, 150, 170]
    assert newest_commit(tmp_path) == 170
    summary = result.output[result.output.rindex("node0: exit"):]
    assert "step=170 " in summary and "step=150 " not in summary, summary
