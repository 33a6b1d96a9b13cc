"""A user's mistake is caught at the first step or before: one line naming the fix, the status of its
kind (2: configuration, 1: runtime), no traceback, and no checkpoint of a step trained on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chaos.etcd import free_ports
from tests.jobs import BASE_ARGS, REPO, TORCHRUN, child_env, events, metrics, run

pytestmark = pytest.mark.integration

TRAIN = str(REPO / "tests" / "fixtures" / "mistaken_train.py")
LOOP = str(REPO / "tests" / "fixtures" / "mistaken_loop.py")


def _one_line_exit(output: str, log_dir: Path, status: int, *named: str) -> None:
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if " ERROR " in line or line.startswith("ERROR")]
    lines = [line for line in errors if all(text in line for text in named)]
    assert lines, f"no error line names {named}:\n{output[-3000:]}"
    exits = {(e["rank"], e["reason"], e["status"]) for e in events(log_dir, "exit")}
    assert {s for _, _, s in exits} == {status}, exits
    assert all(e["step"] <= 1 for e in events(log_dir, "committed")), "a checkpoint was committed after the mistake"


@pytest.mark.parametrize(
    ("mistake", "named"),
    [  # refused at the first step; as the parts are made (slow set); tests/unit/test_parts.py has every kind
        ("scalar-loss", ('reduction="none"', "WeightedLoss")),
        pytest.param("optimizer-none", ("optimizer", "NoneType", "torch.optim.Optimizer"), marks=pytest.mark.slow),
    ],
)
def test_a_trainer_path_mistake_exits_2_in_one_line_before_training(mistake: str, named: tuple[str, ...],
                                                                     tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run([sys.executable, TRAIN, *BASE_ARGS, "--max-steps", "4", "--global-batch-size", "4",
                  "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--log-dir", str(logs)],
                 env={"MISTAKE": mistake}, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    _one_line_exit(result.output, logs, 2, *named)


def test_a_parameter_the_loss_does_not_use_ends_the_run_as_config_naming_it_and_the_flag(tmp_path: Path) -> None:
    """Without the flag DDP would fail the second step with advice about a constructor the user never calls."""
    logs = tmp_path / "logs"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node=2", TRAIN, *BASE_ARGS, "--max-steps", "4",
               "--global-batch-size", "8", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
               "--log-dir", str(logs)]
    result = run(command, env={"MISTAKE": "unused-parameter"}, timeout=180)
    assert result.returncode != 0
    # torchrun's own agent ends with its summary and traceback (ChildFailedError); the workers' part is one line
    workers = "\n".join(line for line in result.output.splitlines() if "ChildFailedError" not in line
                        and not line.startswith(("  ", "Traceback", "torch.distributed")) and "=====" not in line)
    _one_line_exit(workers, logs, 2, "probe.weight", "probe.bias", "--ddp-find-unused-parameters")
    assert not [line for line in result.output.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert {e["rank"] for e in events(logs, "exit")} == {0, 1}

    flagged = tmp_path / "flagged-logs"
    result = run([*command[:-2], "--log-dir", str(flagged), "--checkpoint-dir", str(tmp_path / "flagged"),
                  "--ddp-find-unused-parameters"], env={"MISTAKE": "unused-parameter"}, timeout=180)
    assert result.returncode == 0, result.output[-3000:]
    assert {(e["rank"], e["reason"]) for e in events(flagged, "exit")} == {(0, "done"), (1, "done")}


def test_the_documented_step_to_multiplier_scheduler_is_accepted(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run([sys.executable, TRAIN, *BASE_ARGS, "--max-steps", "6", "--log-dir", str(logs)],
                 env={"MISTAKE": "multiplier-scheduler"}, timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    lrs = [m["lr"] for m in metrics(str(logs)) if "lr" in m]
    assert len(lrs) == 6 and lrs[0] == pytest.approx(2 * lrs[-1]), lrs  # 0.5 ** (step // 5): halved at step 5


@pytest.mark.parametrize(
    ("mistake", "world_size", "status", "named"),
    [
        ("forgot-commit", 1, 1, ("sampler.commit(plan)", "step 1")),
        ("save-before-restore", 1, 1, ("restore()",)),
        ("small-batch", 2, 2, ("global_batch_size 1", "world size 2")),
    ],
)
def test_a_library_path_mistake_ends_in_one_line_at_step_1_or_before(mistake: str, world_size: int, status: int,
                                                                     named: tuple[str, ...], tmp_path: Path) -> None:
    """The ranks are started as a launcher would (env://), so that each one's own exit status is seen."""
    logs, (port,) = tmp_path / "logs", free_ports(1)
    ranks = [subprocess.Popen([sys.executable, LOOP, str(tmp_path / "ckpt"), str(logs)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=child_env({"MISTAKE": mistake, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                             "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port)}))
             for rank in range(world_size)]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, output in zip(ranks, outputs):
        assert rank.returncode == status, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert sum(all(text in line for text in named) for line in output.splitlines()) == 1, output[-3000:]
    if logs.exists():  # the events, when the mistake came after they were opened
        assert {e["status"] for e in events(logs, "exit")} == {status}
        assert events(logs, "committed") == [], "a checkpoint was committed after the mistake"
