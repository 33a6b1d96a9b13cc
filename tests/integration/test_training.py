"""The example pipeline under torchrun on gloo: learning, bitwise resume, world-size changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.jobs import (
    WORLD_CHANGE_ATOL,
    WORLD_CHANGE_RTOL,
    assert_opens_with_safetensors,
    events,
    export_model,
    import_example,
    inspect,
    load_model_state,
    metrics,
    resumed_steps,
    tensorboard_scalars,
    train,
    train_ok,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("training")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict:
    """Run A: 40 uninterrupted steps at world size 2, checkpoint every 10."""
    ckpt, logs = workdir / "ref", workdir / "ref-logs"
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--log-dir", str(logs),
              "--log-tensorboard"], nproc=2)
    return {"ckpt": str(ckpt), "logs": str(logs), "facts": inspect(str(ckpt))}


@pytest.fixture(scope="module")
def split_run_first_half(workdir: Path) -> Path:
    """Run B's first launch: 20 steps at world size 2 (kept pristine; tests copy it)."""
    ckpt = workdir / "half"
    train_ok(["--max-steps", "20", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"], nproc=2)
    return ckpt


def _resume_copy(first_half: Path, target: Path, extra: list[str], nproc: int) -> dict:
    shutil.copytree(first_half, target)
    logs = target.with_name(target.name + "-logs")
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(target), "--checkpoint-every", "10", "--log-dir", str(logs),
              "--log-tensorboard", *extra], nproc=nproc)
    assert resumed_steps(logs) == dict.fromkeys(range(nproc), 20)
    return inspect(str(target))


def test_two_ranks_learn_loss_decreases(reference: dict) -> None:
    losses = {m["step"]: m["loss"] for m in metrics(reference["logs"]) if "loss" in m}
    assert set(range(1, 41)) <= set(losses)
    assert losses[40] < losses[1]
    assert reference["facts"]["step"] == 40 and reference["facts"]["world_size"] == 2
    assert tensorboard_scalars(reference["logs"], "loss") == pytest.approx(losses)
    assert tensorboard_scalars(reference["logs"], "membership/world_size") == {0: 2}  # started fresh


def test_checkpoints_open_with_safetensors_and_the_exported_model_has_the_inspected_digest(
    reference: dict, workdir: Path
) -> None:
    assert_opens_with_safetensors(reference["ckpt"])
    model = import_example("model").build_model(import_example("config").ModelConfig())
    assert export_model(reference["ckpt"], model, workdir / "mlp.safetensors") == reference["facts"]["model_digest"]


def test_resume_at_same_world_size_is_bitwise_identical(reference: dict, split_run_first_half: Path, workdir: Path) -> None:
    resumed = _resume_copy(split_run_first_half, workdir / "resume-plain", [], nproc=2)
    assert resumed["model_digest"] == reference["facts"]["model_digest"]
    assert resumed["data_digest"] == reference["facts"]["data_digest"]


@pytest.mark.slow  # CI time: .ci/run runs it in its third part (SLOW_SET)
def test_resume_from_a_checkpoint_committed_in_the_background_is_bitwise_identical(reference: dict, workdir: Path) -> None:
    """The newest commit is the asynchronous save of step 20, whose parameters and optimizer state
    were copied while step 21 ran: it must hold step 20's state exactly."""
    ckpt = workdir / "async-only"
    train_ok(["--max-steps", "25", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--no-checkpoint-save-final"],
             nproc=2)
    assert inspect(str(ckpt))["step"] == 20
    logs = workdir / "async-only-logs"
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--log-dir", str(logs),
              "--log-tensorboard"], nproc=2)
    assert resumed_steps(logs) == {0: 20, 1: 20}
    facts = inspect(str(ckpt))
    assert facts["model_digest"] == reference["facts"]["model_digest"]
    assert facts["data_digest"] == reference["facts"]["data_digest"]


@pytest.mark.slow  # 27 s; CI time. CI keeps the bitwise resume of the plain configuration
def test_resume_with_two_loader_workers_is_bitwise_identical(reference: dict, workdir: Path) -> None:
    ckpt = workdir / "workers"
    train_ok(["--max-steps", "20", "--checkpoint-dir", str(ckpt), "--loader-num-workers", "2"], nproc=2)
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(ckpt), "--loader-num-workers", "2"], nproc=2)
    facts = inspect(str(ckpt))
    assert facts["model_digest"] == reference["facts"]["model_digest"]
    assert facts["data_digest"] == reference["facts"]["data_digest"]


@pytest.mark.slow  # 42 s; CI time. CI keeps the bitwise resume of the plain configuration
def test_resume_with_gradient_accumulation_is_bitwise_identical(workdir: Path) -> None:
    accum = ["--grad-accum-steps", "2"]
    straight, split = workdir / "accum-straight", workdir / "accum-split"
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(straight), *accum], nproc=2)
    train_ok(["--max-steps", "20", "--checkpoint-dir", str(split), *accum], nproc=2)
    train_ok(["--max-steps", "40", "--checkpoint-dir", str(split), *accum], nproc=2)
    a, b = inspect(str(straight)), inspect(str(split))
    assert (a["model_digest"], a["data_digest"]) == (b["model_digest"], b["data_digest"])


@pytest.mark.parametrize("new_world_size", [pytest.param(3, marks=pytest.mark.slow), 1])  # 3: CI time; 1 changes it too
def test_world_size_change_keeps_data_exact_and_weights_close(
    new_world_size: int, reference: dict, split_run_first_half: Path, workdir: Path
) -> None:
    resumed = _resume_copy(split_run_first_half, workdir / f"to-{new_world_size}", [], nproc=new_world_size)
    assert resumed["world_size"] == new_world_size
    assert tensorboard_scalars(workdir / f"to-{new_world_size}-logs", "membership/world_size") == {20: new_world_size}
    assert resumed["data_digest"] == reference["facts"]["data_digest"]
    assert (resumed["epoch"], resumed["cursor"]) == (reference["facts"]["epoch"], reference["facts"]["cursor"])
    ours, theirs = load_model_state(str(workdir / f"to-{new_world_size}")), load_model_state(reference["ckpt"])
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=WORLD_CHANGE_RTOL, atol=WORLD_CHANGE_ATOL), name


@pytest.mark.slow  # 4 launches; the in-process ZeRO round trip in tests/unit/test_checkpoint_local.py runs by default
def test_sharded_optimizer_state_round_trips_bitwise_and_refuses_another_world_size(workdir: Path) -> None:
    zero = ["--optim-zero"]
    straight, split = workdir / "zero-straight", workdir / "zero-split"
    train_ok(["--max-steps", "30", "--checkpoint-dir", str(straight), *zero], nproc=2)
    train_ok(["--max-steps", "15", "--checkpoint-dir", str(split), *zero], nproc=2)
    train_ok(["--max-steps", "30", "--checkpoint-dir", str(split), *zero], nproc=2)
    a, b = inspect(str(straight)), inspect(str(split))
    assert (a["model_digest"], a["data_digest"]) == (b["model_digest"], b["data_digest"])
    refused = train(["--max-steps", "40", "--checkpoint-dir", str(split), *zero], nproc=3)
    assert refused.returncode != 0
    assert "sharded over another world size" in refused.output


@pytest.mark.slow  # CI time; a warning, with unit tests of the schedule
def test_a_resume_that_moves_the_lr_horizon_says_so_naming_both_steps_and_the_flag(tmp_path: Path) -> None:
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    common = ["--checkpoint-dir", ckpt, "--log-dir", logs, "--optim-decay-steps", "0"]
    train_ok(["--max-steps", "6", *common])
    resumed = train_ok(["--max-steps", "12", *common])
    changed = events(logs, "lr_horizon_changed")
    assert [(e["rank"], e["step"], e["saved"], e["now"]) for e in changed] == [(0, 6, 6, 12)]
    warning = [line for line in resumed.output.splitlines() if "learning-rate schedule changes" in line]
    assert len(warning) == 1 and "step 6" in warning[0] and "step 12" in warning[0] and "--optim-decay-steps 6" in warning[0]
    pinned = train_ok(["--max-steps", "14", *common[:4], "--optim-decay-steps", "12"])  # as step 12 recorded it
    assert "learning-rate schedule changes" not in pinned.output
    assert len(events(logs, "lr_horizon_changed")) == 1


def test_consistency_checks_and_background_saves_at_every_step_do_not_cross(tmp_path: Path) -> None:
    """The consistency check's all-gather and a background save's commit ran on one group from two
    threads: their collectives crossed and a healthy run stopped as diverged."""
    train_ok(["--max-steps", "12", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
              "--resilience-consistency-every", "1"], nproc=2)
