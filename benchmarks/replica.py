"""What replicas in node memory cost a training step: the trainer with replicas off, every 10 steps and every step.

How to run (it starts --nodes torchrun agents on 127.0.0.1, one worker each, so that every rank is its
node's first worker and writes a replica, as on a cluster of single-GPU nodes):
  .venv/bin/python benchmarks/replica.py [--rounds 10] [--steps 100] [--nodes 2] [--hidden 512] [--batch 1024]

The model and data are the chaos scenario fault-a-minute's (the example MLP, hidden 512, a global batch of
1024 from 65,536 samples); ``--hidden`` and ``--batch`` change them. Each round runs the trainer four
times over the same steps: replicas off, every 10 steps, every step (``--checkpoint-replica-budget 0``),
and the default (every step within a 3% budget), in a rotating order so that each setting takes each
place equally often. Checkpoints go to a temporary directory but
none is committed during the timed steps (``--checkpoint-every 0``, no final save), so the difference
between the loops is the replicas alone. Round 0 warms up and is discarded.

Prints each setting's median step time (per-step wall time of a round, rank 0), its ratio to replicas off
(median of the rounds' ratios with quartiles), and from the replica layer's own counters: the time the
training thread spent in each replica (the copy of the state and the exchange of the ranks' own state),
the background write's time, and how many due replicas were skipped because the previous write was still
running. The figure before the in-place two-slot layout was 1.4 ms blocking and 9 ms of background write
for 5 MB of state.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

SETTINGS = ((0, 0.0), (10, 0.0), (1, 0.0), (1, 0.03))
"""(--checkpoint-replica-every, --checkpoint-replica-budget): off, every 10 and every step without a budget,
and the default (every step within 3% of the training time)."""
ORDERS = [SETTINGS[shift:] + SETTINGS[:shift] for shift in range(len(SETTINGS))]


def worker(args: argparse.Namespace) -> None:
    import torch
    from config import MLPConfig
    from dataset import make_datasets
    from model import build_model
    from step_overhead import ratio_summary

    from elastic_ddp.build import Built
    from elastic_ddp.checkpoint.format import flatten
    from elastic_ddp.config import config_from_args
    from elastic_ddp.distributed import distributed
    from elastic_ddp.trainer import Trainer

    argv = ["--model-hidden-dim", str(args.hidden), "--global-batch-size", str(args.batch),
            "--data-num-samples", "65536", "--data-eval-samples", "0", "--optim-eps", "1e-5",
            "--log-progress", "off", "--max-steps", str(args.steps), "--checkpoint-every", "0",
            "--no-checkpoint-save-final", "--checkpoint-replica-dir", args.replica_dir]
    config = config_from_args(argv, config_class=MLPConfig)
    data, _ = make_datasets(config.data, config.model)
    times: dict[tuple[int, float], list[float]] = {setting: [] for setting in SETTINGS}
    blocking: dict[tuple[int, float], list[float]] = {setting: [] for setting in SETTINGS}
    writing: dict[tuple[int, float], list[float]] = {setting: [] for setting in SETTINGS}
    cpu: dict[tuple[int, float], list[float]] = {setting: [] for setting in SETTINGS}
    saves: dict[tuple[int, float], int] = {setting: 0 for setting in SETTINGS}
    skipped: dict[tuple[int, float], int] = {setting: 0 for setting in SETTINGS}
    state_bytes = 0
    with distributed(config.dist) as context:
        for round_index in range(args.rounds + 1):
            for setting in ORDERS[round_index % len(ORDERS)]:
                every, budget = setting
                torch.manual_seed(0)
                gc.collect()
                run_dir = os.path.join(args.work, f"r{round_index}-e{every}-b{budget}")
                checkpoint = dataclasses.replace(config.checkpoint, dir=run_dir, replica_every=every,
                                                 replica_budget=budget)
                log = dataclasses.replace(config.log, every=args.steps, dir=os.path.join(run_dir, "logs"))
                trainer = Trainer(dataclasses.replace(config, checkpoint=checkpoint, log=log), context,
                                  Built(build_model(config.model), data))
                with trainer.make_runtime() as runtime:
                    started = time.perf_counter()
                    trainer.run(runtime)
                    elapsed = time.perf_counter() - started
                    assert runtime.world is not None
                    replicas = runtime.world.replicas  # closed with the runtime; its figures stay
                if replicas is not None:
                    replicas.wait()
                    if round_index:
                        blocking[setting].append(replicas.stats.blocking_s / max(replicas.stats.saves, 1))
                        writing[setting].append(replicas.stats.write_s / max(replicas.stats.written, 1))
                        cpu[setting].append(replicas.stats.blocking_cpu_s / max(replicas.stats.saves, 1)
                                            + replicas.stats.write_cpu_s / max(replicas.stats.written, 1))
                        saves[setting] += replicas.stats.saves
                        skipped[setting] += replicas.stats.skipped
                    replicas.discard()
                state_bytes = sum(t.numel() * t.element_size()
                                  for t in flatten(trainer.state.replicated_state_dict()).tensors)
                if round_index:
                    times[setting].append(elapsed / args.steps)
        if context.is_main:
            print(f"rounds={args.rounds} steps/round={args.steps} nodes={context.world_size} (one worker each) "
                  f"backend={context.backend}; MLP hidden {args.hidden}, global batch {args.batch}; replicated state "
                  f"{state_bytes / 2**20:.1f} MiB; replicas under /dev/shm")
            off = times[SETTINGS[0]]
            for setting in SETTINGS:
                every, budget = setting
                label = "replicas off" if every == 0 else \
                    f"every {every}, budget {f'{100 * budget:g}%' if budget else 'none'}"
                line = (f"{label:<24} median step {1e3 * statistics.median(times[setting]):7.2f} ms "
                        f"(all: {', '.join(f'{1e3 * x:.1f}' for x in times[setting])})")
                if every:
                    line += f"\n    vs off: {ratio_summary(times[setting], off)}"
                    line += (f"\n    rank 0: {saves[setting]} replicas in {args.rounds * args.steps} steps "
                             f"(one every {args.rounds * args.steps / max(saves[setting], 1):.1f}); per replica "
                             f"training thread {1e3 * statistics.median(blocking[setting]):.2f} ms, background write "
                             f"{1e3 * statistics.median(writing[setting]):.2f} ms; CPU (both threads) "
                             f"{1e3 * statistics.median(cpu[setting]):.2f} ms; due but skipped (previous write "
                             f"still running): {skipped[setting]}")
                print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=2, help="torchrun agents, one worker each")
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=1024, help="global batch size")
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--replica-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    work = tempfile.mkdtemp(prefix="replica-bench-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    replica_root = tempfile.mkdtemp(prefix="replica-bench-", dir=shm)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = []
    try:
        for node in range(args.nodes):
            # each agent its own replica directory: node memory that the other node does not see
            command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}", f"--node-rank={node}",
                       "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", __file__,
                       "--rounds", str(args.rounds), "--steps", str(args.steps), "--hidden", str(args.hidden),
                       "--batch", str(args.batch), "--work", work,
                       "--replica-dir", os.path.join(replica_root, f"node{node}")]
            agents.append(subprocess.Popen(command, env=env, cwd=REPO))
        codes = [agent.wait() for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(replica_root, ignore_errors=True)
    sys.exit(max(codes, default=0))


if __name__ == "__main__":
    main()
