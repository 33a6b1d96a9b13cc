"""Per-step cost of the elastic_ddp trainer against a plain hand-written DDP loop.

How to run (it launches torchrun with 2 ranks on gloo itself):
  .venv/bin/python benchmarks/step_overhead.py [--rounds 15] [--steps 40]

Both loops train the same MLP on the same data with AdamW, LR schedule and clipping, with
checkpointing off. Each round runs both loops, plain first in even rounds and the trainer first
in odd ones, so drift of the machine hits both and neither always runs second; each round's
per-step time is its wall time over its steps (loader start-up included for both). On a shared
2-core machine single rounds scatter by +-10%, so the headline figure is the median of the
rounds' trainer/plain ratios, printed with its quartiles.
Prints both medians, the ratio, and the trainer's data-wait share of a step.

The trainer runs Python's garbage collector at fixed steps (``--gc-every``, default 50) instead of
automatically; the time each loop spent in collections is printed, and ``--plain-gc-schedule``
gives the plain loop the same schedule, to see what the trainer costs apart from that.

It also isolates the two per-step costs of the resilience layer (both are inside the trainer's
figure already): the stop-flag agreement (one all-reduce of three int32 every step, or every few
steps when steps are shorter than --resilience-agreement-interval-s) and the
watchdog's phase marks (five per step), each as a fraction of the plain loop's step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

MODEL_ARGS = [
    "--model-input-dim", "256", "--model-hidden-dim", "1024", "--model-num-layers", "3", "--model-num-classes", "16",
    "--data-num-samples", "65536", "--data-eval-samples", "0", "--global-batch-size", "512",
    "--optim-schedule", "cosine", "--optim-decay-steps", "1000", "--log-progress", "off",
]


def plain_loop(config, context, model, data, steps: int, start_step: int, gc_every: int = 0) -> tuple[float, float]:
    """A hand-written DDP loop doing the same work as the trainer; returns (wall, CPU) seconds.
    ``gc_every`` > 0 gives it the trainer's garbage-collection schedule."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from elastic_ddp.collection import StepCollection
    from elastic_ddp.data import epoch_permutation

    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    per_rank = config.global_batch_size // context.world_size
    order = epoch_permutation(config.seed, 0, len(data), True)
    indices = [
        order[(start_step + s) * config.global_batch_size + context.rank * per_rank :][:per_rank].tolist()
        for s in range(steps)
    ]
    loader = DataLoader(data, batch_sampler=indices, num_workers=config.loader.num_workers)
    started, cpu_started = time.perf_counter(), time.process_time()
    collection = StepCollection(gc_every).start()
    for step, (inputs, targets, _) in enumerate(loader, 1):
        loss = F.cross_entropy(ddp(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        collection.step(step)
    collection.stop()
    return time.perf_counter() - started, time.process_time() - cpu_started


def trainer_loop(config, context, model, data, steps: int, log_dir: str) -> tuple[float, float, dict]:
    """The trainer over the same work (built outside the timing); returns (wall, CPU) seconds and the
    last metrics record."""
    import dataclasses

    from elastic_ddp.build import Built
    from elastic_ddp.trainer import Trainer

    config = dataclasses.replace(config, max_steps=steps, log=dataclasses.replace(config.log, every=steps, dir=log_dir))
    trainer = Trainer(config, context, Built(model, data))
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.run()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    trainer.close()
    summary = {}
    if context.is_main:
        with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as handle:
            summary = [r for r in map(json.loads, handle) if "data_wait_s" in r][-1]
    return elapsed, cpu, summary


class CollectorTime:
    """Seconds Python's garbage collector ran while each loop was timed (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.loop: str | None = None
        self.seconds: dict[str, float] = {"plain": 0.0, "trainer": 0.0}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if self.loop is None:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[self.loop] += time.perf_counter() - self._started


def resilience_costs(context, repeats: int = 2000) -> tuple[float, float]:
    """Seconds per step of the stop-flag all-reduce and of the watchdog's five phase marks."""
    import torch
    import torch.distributed as dist

    from elastic_ddp.resilience.watchdog import PhaseLimit, Watchdog

    flags = torch.zeros(3, dtype=torch.int32)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        flags.zero_()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bool(flags[0])
    agreement = (time.perf_counter() - started) / repeats
    watchdog = Watchdog({"step": PhaseLimit(300, "hang")}).start()
    started = time.perf_counter()
    for _ in range(repeats):
        for phase in ("data", "step", "collective", "step", "data"):
            watchdog.enter(phase)
    marks = (time.perf_counter() - started) / repeats
    watchdog.close()
    return agreement, marks


def worker(args: argparse.Namespace) -> None:
    import torch

    from config import MLPConfig
    from dataset import make_datasets
    from elastic_ddp.config import config_from_args
    from elastic_ddp.distributed import distributed
    from elastic_ddp.resilience.agreement import agreement_interval
    from model import build_model

    config = config_from_args(MODEL_ARGS + ["--max-steps", str(args.steps)], config_class=MLPConfig)
    data, _ = make_datasets(config.data, config.model)
    plain, ours, wait_share = [], [], []
    cpu: dict[str, list[float]] = {"plain": [], "trainer": []}
    collector = CollectorTime()
    plain_gc_every = config.gc_every if args.plain_gc_schedule else 0
    with distributed(config.dist) as context, tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds + 1):  # round 0 warms up both paths and is discarded
            t_plain = t_ours = c_plain = c_ours = 0.0
            summary: dict = {}
            # Alternate which loop goes first (ABBA...), so that neither always inherits the other's
            # allocator and cache state.
            for which in ("plain", "trainer") if round_index % 2 == 0 else ("trainer", "plain"):
                torch.manual_seed(0)
                gc.collect()  # the previous loop's objects (a trainer is freed by the cyclic collector) are gone
                collector.loop = which if round_index else None
                if which == "plain":
                    t_plain, c_plain = plain_loop(config, context, build_model(config.model), data, args.steps, 0,
                                                  plain_gc_every)
                else:
                    t_ours, c_ours, summary = trainer_loop(config, context, build_model(config.model), data, args.steps,
                                                   os.path.join(tmp, str(round_index)))
                collector.loop = None
            if round_index:
                plain.append(t_plain / args.steps)
                ours.append(t_ours / args.steps)
                cpu["plain"].append(c_plain / args.steps)
                cpu["trainer"].append(c_ours / args.steps)
                if summary:
                    wait_share.append(summary["data_wait_s"] / summary["step_time_s"])
        agreement, marks = resilience_costs(context)
        if context.is_main:
            p, o = statistics.median(plain), statistics.median(ours)
            print(f"rounds={args.rounds} steps/round={args.steps} ranks={context.world_size} backend={context.backend}")
            print(f"plain DDP loop   median step {1e3 * p:8.2f} ms   (all: {', '.join(f'{1e3 * x:.1f}' for x in plain)})")
            print(f"elastic_ddp      median step {1e3 * o:8.2f} ms   (all: {', '.join(f'{1e3 * x:.1f}' for x in ours)})")
            ratios = sorted(x / y for x, y in zip(ours, plain))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            print(f"ratio trainer/plain: {quartiles[1]:.3f} (median of the rounds' ratios; quartiles {quartiles[0]:.3f}"
                  f"-{quartiles[2]:.3f}), {o / p:.3f} of the medians   (target <= 1.03)")
            c_plain, c_ours = statistics.median(cpu["plain"]), statistics.median(cpu["trainer"])
            print(f"CPU time per step (rank 0, all its threads): plain {1e3 * c_plain:.1f} ms, "
                  f"elastic_ddp {1e3 * c_ours:.1f} ms, ratio {c_ours / c_plain:.3f}")
            total_steps = args.rounds * args.steps
            plain_schedule = "the trainer's schedule" if plain_gc_every else "automatic"
            print(f"garbage collection per step (rank 0): plain {1e3 * collector.seconds['plain'] / total_steps:.2f} ms "
                  f"({plain_schedule}), elastic_ddp "
                  f"{1e3 * collector.seconds['trainer'] / total_steps:.2f} ms (every {config.gc_every} steps)")
            print(f"trainer data-wait share of step time: median {100 * statistics.median(wait_share):.2f}%   (target < 5%)")
            every = agreement_interval(p, config.resilience.agreement_interval_s)
            per_step = agreement / every
            print(f"stop-flag agreement: {1e6 * agreement:.0f} us each, one every {every} step(s) at this step time: "
                  f"{1e6 * per_step:.0f} us/step = {100 * per_step / p:.2f}% of a plain step")
            print(f"watchdog phase marks: {1e6 * marks:.1f} us/step = {100 * marks / p:.3f}% of a plain step")
            print(f"together: {100 * (per_step + marks) / p:.2f}%   (target <= 1%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--plain-gc-schedule", action="store_true",
                        help="give the plain loop the trainer's garbage-collection schedule")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    command += ["--plain-gc-schedule"] if args.plain_gc_schedule else []
    sys.exit(subprocess.call(command, env=env, cwd=REPO))


if __name__ == "__main__":
    main()
