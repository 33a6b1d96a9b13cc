"""``elastic-ddp launch`` (what ``scripts/run.sh`` runs) on one work directory, launched again after it finished."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.jobs import REPO, events, run

pytestmark = pytest.mark.integration


def launch(workdir: Path, max_steps: int) -> tuple[int, str]:
    result = run([sys.executable, "-m", "elastic_ddp.cli", "launch", "--nodes", "1:2", "--nproc-per-node", "1",
                  "--workdir", str(workdir), "--", str(REPO / "examples" / "train.py"), "--max-steps", str(max_steps),
                  "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "10", "--log-dir",
                  str(workdir / "logs"), "--log-every", "10"], timeout=300)
    return result.returncode, result.output


def test_a_finished_launch_resumes_when_launched_again_on_its_work_directory(tmp_path: Path) -> None:
    """The second launch finds the first one's embedded etcd data (a closed rendezvous of the same run id) and
    its node logs; it must train on from the first one's last checkpoint, and report only its own outcome."""
    code, output = launch(tmp_path, 20)
    assert code == 0, output[-3000:]
    code, output = launch(tmp_path, 40)
    assert code == 0, output[-3000:]
    resumed = [event for event in events(tmp_path / "logs", "resumed") if event["rank"] == 0]
    assert [event["step"] for event in resumed] == [20], resumed
    done = [event["step"] for event in events(tmp_path / "logs", "done") if event["rank"] == 0]
    assert done == [20, 40], done
    summary = output[output.rindex("node0: exit"):]
    assert "step=20 " not in summary and "step=40 " in summary, summary
