"""Other people's training: the trainer path with a script's own optimizer, schedule, loss, evaluation
and state, and the library path in a hand-written loop (examples/byo_loop). Both resume bitwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.jobs import (
    REPO,
    TORCHRUN,
    WORLD_CHANGE_ATOL,
    WORLD_CHANGE_RTOL,
    assert_opens_with_safetensors,
    events,
    export_model,
    import_script,
    inspect,
    load_model_state,
    metrics,
    resumed_steps,
    run,
)

pytestmark = pytest.mark.integration

CUSTOM = str(REPO / "tests" / "fixtures" / "custom_train.py")
BYO = str(REPO / "examples" / "byo_loop" / "train.py")


def launch(script: str, args: list[str], nproc: int = 2) -> str:
    result = run(TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", script, *args], timeout=180)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


def replicated_entry(uri: str, name: str) -> dict:
    from elastic_ddp.checkpoint import CheckpointManager
    from elastic_ddp.checkpoint.manager import deserialize

    manager = CheckpointManager(uri, rank=0, world_size=1, run_id="test")
    newest = next(info for info in manager.list() if info.committed)
    return deserialize(manager.verify(newest)[newest.manifest.replicated_file], newest.path)[name]


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The custom-parts script: 24 steps straight, and a first half of 12, both at world size 2."""
    root = tmp_path_factory.mktemp("custom")
    common = ["--checkpoint-every", "6", "--log-every", "4", "--global-batch-size", "60"]
    launch(CUSTOM, ["--max-steps", "24", "--checkpoint-dir", str(root / "straight"), "--log-dir", str(root / "logs"), *common])
    launch(CUSTOM, ["--max-steps", "12", "--checkpoint-dir", str(root / "half"), *common])
    return {"root": root, "common": common}  # type: ignore[dict-item]


def _resume(custom: dict, name: str, nproc: int) -> str:
    target = custom["root"] / name
    shutil.copytree(custom["root"] / "half", target)
    logs = custom["root"] / f"{name}-logs"
    launch(CUSTOM, ["--max-steps", "24", "--checkpoint-dir", str(target), "--log-dir", str(logs), *custom["common"]],
           nproc=nproc)
    assert resumed_steps(logs) == dict.fromkeys(range(nproc), 12)
    return str(target)


def test_own_optimizer_schedule_loss_and_state_resume_bitwise(custom: dict) -> None:
    straight = str(custom["root"] / "straight")
    resumed = _resume(custom, "resumed", nproc=2)
    ours, reference = inspect(resumed), inspect(straight)
    assert (ours["step"], ours["model_digest"], ours["data_digest"]) == (24, reference["model_digest"], reference["data_digest"])
    assert replicated_entry(resumed, "counter") == replicated_entry(straight, "counter") == {"calls": 24}
    sgd = replicated_entry(straight, "optimizer")
    assert [group["weight_decay"] for group in sgd["param_groups"]] == [1e-3, 0.0] and "momentum_buffer" in sgd["state"][0]
    evaluated = [m for m in metrics(str(custom["root"] / "logs")) if "eval_mean_loss" in m]
    assert evaluated and evaluated[-1]["step"] == 24


@pytest.mark.slow  # CI time: a world-size change end to end; CI runs the weighted loss at one world size
def test_a_weighted_loss_stays_the_global_mean_when_the_world_size_changes(custom: dict) -> None:
    """Samples weigh 1 + label units, so ranks hold unequal weight; at 3 ranks (60 samples, 20 each) the
    gradient must still be the mean over all units of the global batch, as at 2 ranks."""
    resumed = _resume(custom, "three", nproc=3)
    straight = str(custom["root"] / "straight")
    assert inspect(resumed)["data_digest"] == inspect(straight)["data_digest"]
    ours, reference = load_model_state(resumed), load_model_state(straight)
    for name, tensor in reference.items():
        assert torch.allclose(ours[name], tensor, rtol=WORLD_CHANGE_RTOL, atol=WORLD_CHANGE_ATOL), name


@pytest.mark.slow  # CI time: .ci/run runs it in its third part (SLOW_SET)
def test_a_hand_written_loop_resumes_bitwise_through_the_library(tmp_path: Path) -> None:
    common = ["--checkpoint-every", "10", "--log-every", "10"]
    launch(BYO, ["--max-steps", "30", "--checkpoint-dir", str(tmp_path / "straight"), *common])
    launch(BYO, ["--max-steps", "15", "--checkpoint-dir", str(tmp_path / "split"), *common, "--log-dir", str(tmp_path / "first")])
    logs = tmp_path / "second"
    launch(BYO, ["--max-steps", "30", "--checkpoint-dir", str(tmp_path / "split"), *common, "--log-dir", str(logs)])
    first = [(e["rank"], e["event"], e.get("step")) for e in events(tmp_path / "first")
             if e["event"] in ("started_fresh", "done", "exit")]
    assert sorted(first) == [(0, "done", 15), (0, "exit", 15), (0, "started_fresh", None),
                             (1, "done", 15), (1, "exit", 15), (1, "started_fresh", None)]
    assert resumed_steps(logs) == {0: 15, 1: 15}
    assert [e["step"] for e in events(logs, "committed")] == [20, 30]  # the library path's saves, committed by rank 0
    assert {(e["rank"], e["reason"], e["status"]) for e in events(logs, "exit")} == {(0, "done", 0), (1, "done", 0)}
    ours, reference = inspect(str(tmp_path / "split")), inspect(str(tmp_path / "straight"))
    assert ours["step"] == 30 and ours["world_size"] == 2
    assert (ours["model_digest"], ours["data_digest"]) == (reference["model_digest"], reference["data_digest"])
    assert_opens_with_safetensors(tmp_path / "split")
    script = import_script(Path(BYO))
    model = script.build_model(script.parse_args([]))
    assert export_model(str(tmp_path / "split"), model, tmp_path / "byo.pt") == ours["model_digest"]
