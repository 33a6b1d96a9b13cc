"""Data wait of the LM example on token shards in S3, side by side with the local map-style corpus, in one run.

How to run:
  .venv/bin/python benchmarks/data.py [--steps 80] [--repeats 2] [--latency-s 0.02] [--workdir DIR]

Starts moto's S3 server on 127.0.0.1 behind the chaos harness's storage proxy, which holds every request
``--latency-s`` (object storage answers in tens of milliseconds; moto on loopback in about one), and writes
examples/lm's corpus there as token shards (examples/lm/shards.py: 64 KiB shards in 16 KiB pieces). Then, for
each repeat, the LM example (its default GPT: 4 layers, d_model 256) under ``torchrun --standalone
--nproc-per-node 2`` with ``--loader-num-workers 2``, for ``--steps`` steps, three ways:

- ``local``: the map-style corpus in memory: the reference;
- ``s3``: the shards on S3 through a node cache of 1 MiB, a third of the corpus, so pieces are evicted and
  fetched again all run long and every step depends on the plan-driven prefetch;
- ``s3, no prefetch``: the same with ``--data-shards-prefetch-steps 0``: the DataLoader workers fetch on demand.

Steady state is every step after the first 10: data wait (time the step waited for its batches, rank 0's
``metrics.jsonl``) as a share of step time.

Then a join: two nodes of one process each (two torchrun agents, c10d rendezvous on 127.0.0.1) start a job
together; node0's cache holds the whole corpus, node1's is empty, as for a spot node that joins a running job
(a join restarts every worker, so everyone's first step is after the join). The figure is node1's first-step
data wait minus node0's (each rank's ``first_step`` event), in steady-state step times.

The S3 server and the proxy run on the same cores as the job; the CPU they use per step is printed beside
each way's step time. Prints medians with their range over repeats. Exit status 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chaos.s3 import BUCKET, StorageProxy, client_env, start_on_free_port  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LM = str(REPO / "examples" / "lm" / "train.py")
WARMUP_STEPS = 10
CACHE_BYTES = 1 << 20


def job_env(endpoint: str, cache: Path) -> dict[str, str]:
    env = {**os.environ, **client_env(endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "ELASTIC_DDP_SHARD_CACHE_DIR": str(cache)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run(command: list[str], env: dict[str, str], timeout: float = 900) -> None:
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")


def records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if kind is None or line.get("event") == kind]


def steady_share(logs: Path) -> tuple[float, float]:
    """Data wait / step time over the steps after the warm-up, and the median step time (rank 0's metrics)."""
    steps = [r for r in records(logs / "metrics.jsonl") if "step_time_s" in r and r["step"] > WARMUP_STEPS]
    wait, total = sum(r["data_wait_s"] for r in steps), sum(r["step_time_s"] for r in steps)
    return wait / total, statistics.median(r["step_time_s"] for r in steps)


def storage_cpu(moto_pid: int) -> float:
    """CPU seconds used so far by the S3 server and this process (the proxy's threads): the harness's share of the
    machine, which the training processes do not have."""
    import psutil

    total = 0.0
    for pid in (moto_pid, os.getpid()):
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def train(way: str, steps: int, data_uri: str, endpoint: str, work: Path) -> tuple[float, float]:
    logs = work / f"{way}-logs"
    args = [LM, "--max-steps", str(steps), "--log-every", "1", "--log-dir", str(logs), "--loader-num-workers", "2",
            "--data-eval-batches", "1", "--eval-every", "0"]
    if way != "local":
        args += ["--data-shards-uri", data_uri, "--data-shards-cache-bytes", str(CACHE_BYTES)]
    if way == "s3, no prefetch":
        args += ["--data-shards-prefetch-steps", "0"]
    cache = work / f"{way.replace(' ', '_').replace(',', '')}-cache"
    run(TORCHRUN + ["--standalone", "--nproc-per-node=2", *args], job_env(endpoint, cache))
    return steady_share(logs)


def join(steps: int, data_uri: str, endpoint: str, work: Path) -> float:
    """Node1's first-step data wait minus node0's, in seconds (node0's cache warm, node1's empty)."""
    warm, cold = work / "join-warm-cache", work / "join-cold-cache"
    logs = work / "join-logs"
    common = [LM, "--max-steps", "12", "--log-every", "1", "--log-dir", str(logs), "--loader-num-workers", "2",
              "--data-eval-batches", "1", "--eval-every", "0", "--data-shards-uri", data_uri]
    run(TORCHRUN + ["--standalone", "--nproc-per-node=1", *common, "--max-steps", "1", "--log-dir", str(work / "fill")],
        job_env(endpoint, warm))  # fills node0's cache: the default budget holds the whole corpus
    for piece in ("train", "val"):  # and the rest of the corpus, as a node that trained an epoch holds it
        run([sys.executable, "-c", "import sys; from elastic_ddp.shards import ShardReader; r = ShardReader(sys.argv[1]); "
             "[r.ensure(s, p) for s, e in enumerate(r.index.shards) for p in range(len(e.pieces))]",
             f"{data_uri}/{piece}"], job_env(endpoint, warm))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = []
    for cache in (warm, cold):
        command = TORCHRUN + ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=join", *common]
        nodes.append(subprocess.Popen(command, cwd=REPO, env=job_env(endpoint, cache), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    for node in nodes:
        if node.wait(timeout=600):
            raise RuntimeError("a node of the join run failed")
    firsts = records(logs / "events.jsonl", "first_step")
    by_pid = {r["agent_pid"]: r["data_wait_s"] for r in firsts}
    return by_pid[nodes[1].pid] - by_pid[nodes[0].pid]


def spread(values: list[float], scale: float = 1.0, unit: str = "", digits: int = 2) -> str:
    median = statistics.median(values) * scale
    return f"{median:.{digits}f}{unit} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="steps of each training run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way (alternating order)")
    parser.add_argument("--latency-s", type=float, default=0.02, help="added to every request to S3")
    parser.add_argument("--workdir", default="", help="keep the runs' files here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS + 5:
        parser.error(f"--steps must be > {WARMUP_STEPS + 5}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="data-bench-"))
    ways = ("local", "s3", "s3, no prefetch")
    shares: dict[str, list[float]] = {way: [] for way in ways}
    step_times: dict[str, list[float]] = {way: [] for way in ways}
    harness: dict[str, list[float]] = {way: [] for way in ways}
    joins: list[float] = []
    with ExitStack() as stack:
        moto = start_on_free_port(root / "moto.log", stack=stack)
        proxy = StorageProxy(moto.port).start()
        stack.callback(proxy.close)
        proxy.set_delay(args.latency_s)
        data_uri = f"s3://{BUCKET}/data-bench"
        run([sys.executable, str(REPO / "examples" / "lm" / "shards.py"), data_uri, "--shard-bytes", "65536",
             "--piece-bytes", "16384"], job_env(moto.endpoint, root / "unused"))
        for repeat in range(args.repeats):
            order = ways if repeat % 2 == 0 else tuple(reversed(ways))
            for way in order:
                work = root / f"r{repeat}"
                cpu = storage_cpu(moto.pid or 0)
                share, step = train(way, args.steps, data_uri, proxy.endpoint, work)
                harness[way].append((storage_cpu(moto.pid or 0) - cpu) / args.steps)
                shares[way].append(share)
                step_times[way].append(step)
                print(f"repeat {repeat}: {way}: data wait {100 * share:.2f}% of step time, step {1e3 * step:.0f} ms, "
                      f"S3 server and proxy {1e3 * harness[way][-1]:.0f} ms of CPU a step", flush=True)
            wait = join(args.steps, data_uri, proxy.endpoint, root / f"r{repeat}")
            joins.append(wait)
            print(f"repeat {repeat}: join: the cold node's first step waited {wait:+.3f} s more than the warm node's",
                  flush=True)
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nLM example, 2 ranks, 2 loader workers each, {args.steps} steps, S3 latency {1e3 * args.latency_s:.0f} ms "
          f"per request, {args.repeats} repeats: median (range)")
    print(f"{'way':18} {'data wait / step time':>24} {'step time':>22} {'S3 server + proxy CPU a step':>30}")
    for way in ways:
        print(f"{way:18} {spread(shares[way], 100, '%'):>24} {spread(step_times[way], 1e3, ' ms', 0):>22} "
              f"{spread(harness[way], 1e3, ' ms', 0):>30}")
    typical = statistics.median(step_times["s3"])
    print(f"join: cold node's first-step data wait minus the warm node's: {spread(joins, 1, ' s', 3)} = "
          f"{statistics.median(joins) / typical:.2f} steady step times (target <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
