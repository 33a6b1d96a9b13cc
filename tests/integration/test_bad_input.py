"""Bad input is refused with a message naming what is wrong, and nothing is overwritten."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import events, import_example, resumed_steps, train, train_ok

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-steps", "-1"),
        ("--global-batch-size", "0"),
        ("--grad-accum-steps", "0"),
        ("--gc-every", "-1"),
        ("--optim-lr", "-0.1"),
        ("--optim-lr", "fast"),
        ("--checkpoint-keep", "1"),
        ("--dist-init-timeout-s", "0"),
        ("--dist-collective-timeout-s", "1e300"),
        ("--resilience-watchdog-timeout-s", "1e300"),
        ("--checkpoint-every", "2"),
        ("--checkpoint-every-seconds", "30"),
        ("--optim-weight-decay", "inf"),
        ("--loader-num-workers", "-2"),
        ("--model-dropout", "1.5"),
        ("--resilience-spot-notice-url", "ftp://x"),
        ("--resilience-agreement-interval-s", "-1"),
        ("--checkpoint-storage-options", "[1, 2]"),
        ("--ddp-bucket-cap-mb", "0"),
        ("--ddp-bucket-cap-mb", "nan"),
        ("--compile-mode", "max-autotune"),
        ("--compile-mode", "fastest"),
    ],
)
def test_invalid_value_exits_with_status_2_naming_the_flag(flag: str, value: str, capsys) -> None:
    """The training script's own parser (in-process: the subprocess path is covered below)."""
    from elastic_ddp.config import config_from_args

    with pytest.raises(SystemExit) as exit_info:
        config_from_args([flag, value], prog="train.py", config_class=import_example("config").MLPConfig)
    assert exit_info.value.code == 2
    assert f"{flag}:" in capsys.readouterr().err


def test_several_invalid_values_are_reported_together_without_a_traceback() -> None:
    result = train(["--max-steps", "-1", "--optim-lr", "0", "--checkpoint-keep", "1"])
    assert result.returncode == 2
    assert "Traceback" not in result.output
    for flag in ("--max-steps:", "--optim-lr:", "--checkpoint-keep:"):
        assert flag in result.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("bad-input") / "ckpt"
    train_ok(["--max-steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"])
    return ckpt


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--model-hidden-dim", "64"], "--model-hidden-dim"),
        (["--global-batch-size", "32"], "--global-batch-size"),
        (["--seed", "7"], "--seed"),
    ],
)
def test_resume_with_incompatible_config_is_refused_naming_the_field(saved: Path, change: list[str], named: str) -> None:
    """A configuration mistake: status 2 (``config``), which ends a job instead of restarting it."""
    before = _tree_digest(saved)
    result = train(["--max-steps", "8", "--checkpoint-dir", str(saved), *change])
    assert result.returncode == 2
    assert "cannot be resumed" in result.output and named in result.output
    assert "Traceback" not in result.output
    assert _tree_digest(saved) == before


def test_resume_may_change_max_steps_and_cadence(saved: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    train_ok(["--max-steps", "6", "--checkpoint-dir", str(copy), "--checkpoint-every", "3", "--log-every", "2",
              "--log-dir", str(tmp_path / "logs")])
    assert resumed_steps(tmp_path / "logs") == {0: 4}
    assert [e["step"] for e in events(tmp_path / "logs", "done")] == [6]


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_checkpoints_give_a_clear_error_and_are_not_overwritten(saved: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    for step_dir in copy.glob("step-*"):
        target = next(step_dir.glob("replicated-*.eddp"))
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x80garbage" * 100)
    before = _tree_digest(copy)
    result = train(["--max-steps", "8", "--checkpoint-dir", str(copy)])
    assert result.returncode == 1
    assert "no valid checkpoint" in result.output and "replicated-" in result.output
    assert "--checkpoint-allow-fresh-start" in result.output
    assert "Traceback" not in result.output
    assert _tree_digest(copy) == before


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    newest = sorted(copy.glob("step-*"))[-1]
    next(newest.glob("replicated-*.eddp")).write_bytes(b"not a checkpoint")
    logs = tmp_path / "logs"
    train_ok(["--max-steps", "6", "--checkpoint-dir", str(copy), "--checkpoint-every", "2", "--log-dir", str(logs)])
    restore = [(e["event"], e.get("step")) for e in events(logs) if e["event"] != "process_group_formed"][:3]
    assert restore == [("checkpoint_skipped", 4), ("uncommitted", 4), ("resumed", 2)]
    assert events(logs, "committed")[0]["step"] == 4  # the un-committed step was committed again
    assert [e["step"] for e in events(logs, "done")] == [6]


def test_unreachable_peers_fail_naming_rank_address_and_timeout() -> None:
    import socket

    from tests.jobs import TRAIN, run

    with socket.socket() as sock:  # a port nobody listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = run([sys.executable, TRAIN, "--dist-init-timeout-s", "2", "--max-steps", "2"], timeout=60, env=env)
    assert result.returncode == 1
    assert f"rank 1: cannot reach the store at 127.0.0.1:{port} within --dist-init-timeout-s=2" in result.output


def test_a_log_dir_that_is_a_file_exits_2_naming_the_flag(tmp_path: Path, capsys) -> None:
    from elastic_ddp.config import config_from_args

    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--log-dir", str(afile)], prog="train.py")
    assert exit_info.value.code == 2 and f"--log-dir: {afile} exists and is not a directory" in capsys.readouterr().err


def test_a_checkpoint_dir_that_is_a_file_fails_before_the_first_step_naming_it(tmp_path: Path) -> None:
    afile = tmp_path / "ckpt"
    afile.write_text("not a directory")
    started = time.monotonic()
    result = train(["--max-steps", "5", "--checkpoint-dir", str(afile), "--log-dir", str(tmp_path / "logs")])
    assert time.monotonic() - started < 10
    assert result.returncode == 1 and "Traceback" not in result.output
    assert f"checkpoint location {afile} is not usable" in result.output
    assert [e["event"] for e in events(tmp_path / "logs")] == ["process_group_formed", "exit"]  # no start, no step


def test_a_fresh_start_over_damaged_checkpoints_keeps_every_new_checkpoint(tmp_path: Path) -> None:
    """Before: the damaged steps 10-30 stayed committed, retention removed each new checkpoint right
    after its commit, and `latest` pointed at a deleted step."""
    from tests.jobs import inspect, run

    ckpt = tmp_path / "ckpt"
    train_ok(["--max-steps", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"])
    for path in ckpt.glob("step-*/replicated-*.eddp"):
        os.truncate(path, 100)
    logs = tmp_path / "logs"
    train_ok(["--max-steps", "9", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--checkpoint-allow-fresh-start",
              "--log-dir", str(logs)])
    assert sorted(e["step"] for e in events(logs, "uncommitted")) == [10, 20, 30]
    assert [e["reason"] for e in events(logs, "started_fresh")] == ["no-valid-checkpoint"]
    listing = run([sys.executable, "-m", "elastic_ddp.cli", "ckpt", "ls", str(ckpt)], timeout=60).output
    valid = sorted(int(line.split()[0]) for line in listing.splitlines()[1:] if line.rstrip().endswith("yes"))
    assert valid == [3, 6, 9], listing
    assert (ckpt / "latest").read_text() == "step-00000009" and inspect(str(ckpt))["step"] == 9
    assert all((ckpt / f"step-{step:08d}" / "manifest.rejected.json").exists() for step in (10, 20, 30))


def test_a_run_that_does_not_resume_refuses_a_directory_with_committed_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train_ok(["--max-steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"])
    before = _tree_digest(ckpt)
    result = train(["--max-steps", "9", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--no-checkpoint-resume"])
    assert result.returncode == 1 and "Traceback" not in result.output
    assert f"--no-checkpoint-resume: {ckpt} already holds committed checkpoints (newest: step 6)" in result.output
    assert _tree_digest(ckpt) == before
