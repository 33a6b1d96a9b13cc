"""The CUDA/NCCL path on one GPU, in a few minutes: run it on a machine with a GPU after setup.

    .venv/bin/python scripts/gpu_check.py [--workdir DIR]

Checks, each printed PASS or FAIL with what was compared:

1. trainer path on one GPU with float16 autocast and the grad scaler: the process group is NCCL and the
   run reaches ``done``;
2. a resume on the GPU (CUDA RNG streams, dropout on, the scaler's state, an asynchronous save staged
   from device memory) gives bitwise the model and data digests of the same run without the stop;
3. the newest checkpoint, saved in the background from device memory, holds the model the run ended with;
4. the rescue's rule for a GPU: a state with work still queued on the device's stream is not kept,
   the same state once the stream is idle is;
5. in-process re-formation: one NCCL rank abandons its group (abort where torch has it) and forms a new one
   (``elastic_ddp.distributed.reform_group``) with the CUDA context, the model and the optimizer state on the
   device kept, under the in-process mode's NCCL settings (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, non-blocking
   communicators); the two halves timed;
6. torchrun's elastic agent with the etcd-v3 rendezvous on a real etcd: the worker crashes at step 25, the
   agent restarts it, the NCCL group forms again, and the run ends with the straight run's digests
   (skipped when no etcd binary is found).

Without a CUDA device it prints why and exits 0 (skipped): the CPU suite covers the rest.
Exit status: 0 all passed or skipped, 1 a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
COMMON = ["--use-amp", "--amp-dtype", "float16", "--model-dropout", "0.1", "--log-every", "5", "--log-progress", "off",
          "--optim-decay-steps", "60", "--checkpoint-every", "10"]


def run_train(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TRAIN), *COMMON, *args], cwd=REPO, text=True, capture_output=True,
                          timeout=600, check=False)


def events(log_dir: Path, kind: str) -> list[dict]:
    with open(log_dir / "events.jsonl", encoding="utf-8") as handle:
        return [event for event in map(json.loads, handle) if event["event"] == kind]


def newest_checkpoint(uri: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.cli", "ckpt", "inspect", str(uri), "--json"],
                            cwd=REPO, text=True, capture_output=True, timeout=120, check=True)
    return json.loads(result.stdout)


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        self.failed += not ok


def trainer_path(work: Path, checks: Checks) -> None:
    straight, split = work / "straight", work / "split"
    first = run_train(["--max-steps", "60", "--checkpoint-dir", str(straight / "ckpt"), "--log-dir", str(straight / "logs")])
    ok = first.returncode == 0
    checks.check("one GPU, float16 + scaler, runs to done", ok, f"exit {first.returncode}")
    if not ok:
        print(first.stdout[-3000:], first.stderr[-3000:], sep="\n")
        return
    formed = events(straight / "logs", "process_group_formed")[0]
    checks.check("NCCL chosen for a CUDA device", formed["backend"] == "nccl", f"backend {formed['backend']}")
    part = run_train(["--max-steps", "30", "--checkpoint-dir", str(split / "ckpt"), "--log-dir", str(split / "one")])
    rest = run_train(["--max-steps", "60", "--checkpoint-dir", str(split / "ckpt"), "--log-dir", str(split / "two")])
    if part.returncode or rest.returncode:
        checks.check("resume on the GPU", False, f"exits {part.returncode}, {rest.returncode}\n{rest.stderr[-3000:]}")
        return
    whole, resumed = events(straight / "logs", "done")[-1], events(split / "two", "done")[-1]
    same = (whole["model_digest"], whole["data_digest"]) == (resumed["model_digest"], resumed["data_digest"])
    checks.check("resume at step 30 is bitwise the straight run (CUDA RNG, scaler, async save)", same,
                 f"model {whole['model_digest'][:12]} vs {resumed['model_digest'][:12]}")
    saved = newest_checkpoint(straight / "ckpt")
    checks.check("the background save from device memory holds the final model",
                 saved["step"] == 60 and saved["model_digest"] == whole["model_digest"],
                 f"step {saved['step']}, digest {saved['model_digest'][:12]}")


def torchrun_restart(work: Path, checks: Checks) -> None:
    sys.path.insert(0, str(REPO))
    from chaos.etcd import EtcdProcessError, EtcdServer, find_etcd_binary

    try:
        binary = find_etcd_binary()
    except EtcdProcessError as exc:
        print(f"SKIP  torchrun + etcd-v3 restart on the GPU: {exc}")
        return
    server = EtcdServer.create(binary, work / "etcd")
    server.start()
    try:
        run = work / "torchrun"
        env = {**os.environ, "ELASTIC_DDP_FAULT": "crash:0:25"}
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
             "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={server.endpoint}", "--rdzv-id=gpu-check", str(TRAIN),
             *COMMON, "--max-steps", "60", "--checkpoint-dir", str(run / "ckpt"), "--log-dir", str(run / "logs")],
            cwd=REPO, text=True, capture_output=True, timeout=600, check=False, env=env)
    finally:
        server.stop()
    if result.returncode:
        checks.check("torchrun + etcd-v3: crash, restart, resume on the GPU", False,
                     f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        return
    whole, resumed = events(work / "straight" / "logs", "done")[-1], events(run / "logs", "done")[-1]
    formed = events(run / "logs", "process_group_formed")
    restored = events(run / "logs", "resumed")
    same = (whole["model_digest"], whole["data_digest"]) == (resumed["model_digest"], resumed["data_digest"])
    checks.check("torchrun + etcd-v3: crash at step 25, restart, NCCL group formed again, straight run's digests",
                 same and len(formed) >= 2 and all(event["backend"] == "nccl" for event in formed),
                 f"{len(formed)} groups formed ({', '.join(e['backend'] for e in formed)}), restored "
                 f"{[(e.get('step'), e.get('source')) for e in restored]}, model {resumed['model_digest'][:12]}")


def rescue_rule(checks: Checks) -> None:
    from elastic_ddp.resilience.rescue import LiveState, StepPhase, why_not_kept

    device = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(device)

    def live(busy: bool) -> LiveState:
        return LiveState(phase=StepPhase.BETWEEN, forward_changes_state=False, sharded_optimizer=False,
                         rank_objects=False, device_busy=busy)

    big = torch.randn(8192, 8192, device=device)
    for _ in range(50):  # seconds of queued work: the stream is still busy when queried
        big = torch.tanh(big @ big)
    busy = not stream.query()
    refused = why_not_kept(live(busy))
    torch.cuda.synchronize(device)
    kept = why_not_kept(live(not stream.query()))
    checks.check("rescue refuses a state with queued GPU work and keeps it once idle",
                 busy and refused is not None and kept is None, f"busy={busy}, refused={refused!r}, then kept={kept is None}")


def reform_in_process(checks: Checks) -> None:
    """One NCCL rank gives up its group and forms a new one in the same process: the CUDA context, the model on
    the device and its optimizer state stay; timed (abandon, then form up to the first barrier)."""
    import torch.distributed as dist

    from elastic_ddp.distributed import KEEP_THE_PROCESS, NCCL_ERROR_HANDLING, reform_group
    from elastic_ddp.errors import DistributedInitError

    device = torch.device("cuda", 0)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=dist.PrefixStore("elastic_ddp/membership-0/", store), rank=0, world_size=1,
                            device_id=device)
    model = torch.nn.Linear(1024, 1024, device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(64, 1024, device=device)).sum().backward()
    optimizer.step()
    grads = torch.ones(1024, device=device)
    dist.all_reduce(grads)
    torch.cuda.synchronize(device)
    pointers = [parameter.data_ptr() for parameter in model.parameters()]
    digest = [parameter.detach().clone() for parameter in model.parameters()]
    try:
        reformed = reform_group(store, rank=0, world_size=1, generation=1, backend="nccl", device=device, timeout_s=60)
        dist.all_reduce(grads)
        torch.cuda.synchronize(device)
        same = pointers == [parameter.data_ptr() for parameter in model.parameters()] and all(
            torch.equal(old, parameter) for old, parameter in zip(digest, model.parameters(), strict=True))
        optimizer.step()  # its state on the device is still usable
        ok = same and dist.get_backend() == "nccl" and float(grads[0]) == 1.0
        handling = os.environ.get(NCCL_ERROR_HANDLING)
        checks.check("NCCL group abandoned and formed again in-process, CUDA context and model on the device kept",
                     ok and handling == KEEP_THE_PROCESS,
                     f"{reformed.abandoned} {reformed.abandon_s:.3f} s + form {reformed.form_s:.3f} s, "
                     f"parameters kept={same}, backend {dist.get_backend()}, {NCCL_ERROR_HANDLING}={handling}, "
                     "non-blocking communicators")
    except (DistributedInitError, RuntimeError, ValueError, OSError) as exc:  # print why, run the other checks
        checks.check("NCCL group abandoned and formed again in-process", False, f"{type(exc).__name__}: {exc}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="", help="where the runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as temporary:
        work = Path(args.workdir or temporary)
        trainer_path(work, checks)
        rescue_rule(checks)
        reform_in_process(checks)
        torchrun_restart(work, checks)
    print(f"gpu_check: {'all passed' if not checks.failed else f'{checks.failed} failed'}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
