"""Launching the example job as a user would (python or torchrun), for integration tests.

Every launch runs in its own process session and is killed as a group on timeout, so a
hung test never leaves workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "examples" / "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Tolerance for weights after a world-size change: the same samples are summed in a different
# order (per-rank partial sums, then the all-reduce), so weights differ by floating-point
# reassociation only. Measured after 40 steps, 2 -> 3 ranks: max |diff| 3e-8 on weights ~0.1.
WORLD_CHANGE_RTOL = 1e-4
WORLD_CHANGE_ATOL = 1e-6

# Small and fast, but with everything a real run has: decaying LR, clipping, dropout off.
BASE_ARGS = ["--log-every", "1", "--optim-decay-steps", "40", "--optim-warmup-steps", "5"]


def import_example(module: str) -> Any:
    """Import one of examples/'s modules the way its scripts see each other (examples/ on sys.path)."""
    import importlib

    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    return importlib.import_module(module)


def import_script(path: Path) -> Any:
    """Import a training script by path, under a name of its own, with its directory on sys.path."""
    import importlib.util

    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@dataclass
class JobResult:
    returncode: int
    output: str


AS_A_USER_RUNS_IT = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",)
"""``unset=`` for a command run as a user types it, without the variable the project's launch scripts set."""


def child_env(extra: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as the project's launch scripts set it (RESTARTS.md)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *unset):
        env.pop(name, None)
    env.update(extra or {})
    return env


def run(command: list[str], timeout: float = 240, env: dict[str, str] | None = None,
        unset: tuple[str, ...] = ()) -> JobResult:
    process = subprocess.Popen(
        command, cwd=REPO, env=child_env(env, unset), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{' '.join(command)} did not finish in {timeout}s:\n{output[-3000:]}") from None
    finally:
        try:  # whatever of the launch is left in its session (workers its launcher left behind included)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return JobResult(process.returncode, output)


def train(args: list[str], nproc: int = 0, timeout: float = 240) -> JobResult:
    """Run examples/train.py: as one process when nproc == 0, else under torchrun --standalone."""
    if nproc:
        command = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", TRAIN]
    else:
        command = [sys.executable, TRAIN]
    return run(command + BASE_ARGS + args, timeout=timeout)


def train_ok(args: list[str], nproc: int = 0) -> JobResult:
    result = train(args, nproc)
    assert result.returncode == 0, result.output[-4000:]
    return result


def inspect(uri: str) -> dict[str, Any]:
    result = run([sys.executable, "-m", "elastic_ddp.cli", "ckpt", "inspect", uri, "--json"], timeout=60)
    assert result.returncode == 0, result.output
    return json.loads(result.output)


def export_model(uri: str, model: torch.nn.Module, to: Path, *extra: str) -> str:
    """``elastic-ddp ckpt export`` of the newest committed checkpoint's model to ``to`` (.safetensors or .pt),
    loaded strictly into ``model`` (freshly built) as a user would; the model_digest of what it loaded."""
    from elastic_ddp.state import model_digest

    result = run([sys.executable, "-m", "elastic_ddp.cli", "ckpt", "export", uri, "--to", str(to), *extra], timeout=60)
    assert result.returncode == 0, result.output
    if to.suffix == ".safetensors":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(to)))
    else:
        model.load_state_dict(torch.load(to, weights_only=True))
    return model_digest(model.state_dict())


def assert_opens_with_safetensors(ckpt: str | Path) -> None:
    """Every data file of the newest committed checkpoint under a local root opens with ``safetensors.safe_open``,
    and the replicated file names the model's tensors ``model.<parameter name>``."""
    from safetensors import safe_open

    from elastic_ddp.checkpoint import CheckpointManager

    manager = CheckpointManager(str(ckpt), rank=0, world_size=1, run_id="test")
    newest = next(info for info in manager.list() if info.committed)
    assert newest.manifest is not None
    for name in newest.manifest.files:
        with safe_open(str(Path(newest.path) / name), framework="pt") as handle:
            names = list(handle.keys())
            for tensor_name in names:
                handle.get_tensor(tensor_name)
        if name == newest.manifest.replicated_file:
            model = load_model_state(str(ckpt))
            assert {f"model.{key}" for key in model} <= set(names)


def load_model_state(uri: str) -> dict[str, torch.Tensor]:
    from elastic_ddp.checkpoint import CheckpointManager
    from elastic_ddp.checkpoint.manager import deserialize

    manager = CheckpointManager(uri, rank=0, world_size=1, run_id="test")
    newest = next(info for info in manager.list() if info.committed)
    return deserialize(manager.verify(newest)[newest.manifest.replicated_file], newest.path)["model"]


def metrics(log_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def tensorboard_scalars(log_dir: str | Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar in the run's TensorBoard directory, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastic_ddp.metrics import TENSORBOARD_DIR

    accumulator = EventAccumulator(os.path.join(log_dir, TENSORBOARD_DIR), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def events(log_dir: str | Path, kind: str = "") -> list[dict[str, Any]]:
    """The run's events (every line must be a valid event), or only those of ``kind``."""
    from elastic_ddp.events import Event, read_events

    records, problems = read_events(log_dir)
    assert not problems, problems
    return [record for record in records if not kind or record["event"] == Event(kind)]


def done_event(log_dir: str | Path) -> dict[str, Any]:
    """Rank 0's last ``done`` event: step, epoch, model_digest, data_digest, loss, accuracy, metrics."""
    done = [record for record in events(log_dir, "done") if record["rank"] == 0]
    assert done, f"no rank 0 'done' event under {log_dir}"
    return done[-1]


def resumed_steps(log_dir: str | Path) -> dict[int, int]:
    """Rank -> the step it resumed from, by the ``resumed`` events (the last resume of each rank)."""
    return {record["rank"]: record["step"] for record in events(log_dir, "resumed")}
