"""Per-step cost of the elastic_ddp trainer against a plain hand-written DDP loop.

How to run (it launches torchrun with --nproc ranks, default 2, on gloo itself):
  .venv/bin/python benchmarks/step_overhead.py [--rounds 15] [--steps 40] [--nproc 2]
  .venv/bin/python benchmarks/step_overhead.py --model lm [--rounds 15] [--steps 40] [--nproc 2]

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
steps when steps are shorter than --resilience-agreement-interval-s), the
watchdog's phase marks (five per step) and the RNG streams keyed to each step, each as a fraction of
the plain loop's step.

``--model lm`` times three loops over the byte-level GPT of examples/lm (its GPTConfig, corpus
windows, AdamW param groups, warmup + cosine schedule, autocast and clipping; LM_ARGS below, a
global batch of 16 sequences instead of the example's 32 so that a step takes 0.1-0.3 s):
  plain    a hand-written DDP loop: a DataLoader over the same windows with a plain list of index
           batches, per-sequence mean cross-entropy (the example's lm_loss), no elastic_ddp in the step;
  trainer  elastic_ddp's Trainer with the example's Built (its evaluation left out: the other loops
           have none; checkpointing off);
  library  the plain loop plus the library path's per-step additions (examples/byo_loop/train.py):
           ElasticSampler as the batch sampler (plan, local_micro_batches, loss_scale, commit) and
           StepGuard.after_step every step; no Checkpointer, as checkpointing is off in all three.
Each round runs the three in one of the six orders, going through them so that every loop is first,
second and third equally often (every 3 rounds) and follows each other loop equally often (every 6).
Prints the three medians, trainer/plain and library/plain (median of the rounds' ratios with
quartiles) and the global tokens/s of each loop; ``--nproc 1`` gives the world-size-1 figures.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib.util
import json
import os
import random
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

LM_ARGS = [
    # examples/lm's GPT shape, corpus, optimizer, schedule and autocast defaults, spelled out so they are printed and
    # stay put; a global batch of 16 sequences (the example's is 32) for 0.1-0.3 s steps on 2 CPU ranks.
    "--model-n-layer", "4", "--model-d-model", "256", "--model-n-head", "4", "--model-context", "128",
    "--data-budget-bytes", "3000000", "--global-batch-size", "16",
    "--optim-decay-steps", "1000", "--log-progress", "off",
]
LM_LOOPS = ("plain", "trainer", "library")
LM_ORDERS = [
    ("plain", "trainer", "library"), ("trainer", "library", "plain"), ("library", "plain", "trainer"),
    ("plain", "library", "trainer"), ("library", "trainer", "plain"), ("trainer", "plain", "library"),
]
"""Timed round r (1, 2, ...) runs LM_ORDERS[(r - 1) % 6]: each 3 rounds put every loop in every position
once, each 6 also have every loop follow each of the other two equally often."""


def step_indices(config, context, dataset_len: int, steps: int, start_step: int = 0) -> list[list[int]]:
    """This rank's sample indices of each step: the global cursor's epoch-0 order (the ElasticSampler's,
    so every loop sees the same samples), cut into global batches and split evenly among the ranks."""
    from elastic_ddp.data import epoch_permutation

    per_rank = config.global_batch_size // context.world_size
    order = epoch_permutation(config.seed, 0, dataset_len, config.loader.shuffle)
    return [
        order[(start_step + s) * config.global_batch_size + context.rank * per_rank :][:per_rank].tolist()
        for s in range(steps)
    ]


def plain_loop(config, context, model, data, steps: int, start_step: int, gc_every: int = 0) -> tuple[float, float]:
    """A hand-written DDP loop doing the same work as the trainer; returns (wall, CPU) seconds.
    ``gc_every`` > 0 gives it the trainer's garbage-collection schedule."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from elastic_ddp.collection import StepCollection

    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    indices = step_indices(config, context, len(data), steps, start_step)
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


def trainer_loop(config, context, built, steps: int, log_dir: str) -> tuple[float, float, dict]:
    """The trainer over the same work (``built``: an elastic_ddp Built; the trainer is built outside the
    timing); returns (wall, CPU) seconds and the last metrics record."""
    import dataclasses

    from elastic_ddp.trainer import Trainer

    config = dataclasses.replace(config, max_steps=steps, log=dataclasses.replace(config.log, every=steps, dir=log_dir))
    trainer = Trainer(config, context, built)
    with trainer.make_runtime() as runtime:  # its groups formed outside the timing, as the plain loop's group is
        started, cpu_started = time.perf_counter(), time.process_time()
        trainer.run(runtime)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    summary = {}
    if context.is_main:
        with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as handle:
            summary = [r for r in map(json.loads, handle) if "data_wait_s" in r][-1]
    return elapsed, cpu, summary


class CollectorTime:
    """Seconds Python's garbage collector ran while each loop was timed (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.loop: str | None = None
        self.seconds: dict[str, float] = {"plain": 0.0, "trainer": 0.0, "library": 0.0}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if self.loop is None:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[self.loop] += time.perf_counter() - self._started


def resilience_costs(context, repeats: int = 2000) -> tuple[float, float, float]:
    """Seconds per step of the stop-flag all-reduce, of the watchdog's five phase marks and of keying the RNG
    streams to the step (at the step's plan)."""
    import torch
    import torch.distributed as dist

    from elastic_ddp.resilience.watchdog import PhaseLimit, Watchdog
    from elastic_ddp.state import key_rng_streams

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
    state = (torch.get_rng_state(), random.getstate())
    started = time.perf_counter()
    for step in range(repeats):
        key_rng_streams(0, step, context.rank)
    keying = (time.perf_counter() - started) / repeats
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    return agreement, marks, keying


def ratio_summary(numerators: list[float], denominators: list[float]) -> str:
    """The median of the rounds' ratios with its quartiles, then the ratio of the two medians."""
    ratios = sorted(x / y for x, y in zip(numerators, denominators))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return (f"{quartiles[1]:.3f} (median of the rounds' ratios; quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}), "
            f"{statistics.median(numerators) / statistics.median(denominators):.3f} of the medians")


def print_resilience_costs(config, context, plain_step: float, agreement: float, marks: float, keying: float) -> None:
    from elastic_ddp.resilience.agreement import agreement_interval

    p = plain_step
    every = agreement_interval(p, config.resilience.agreement_interval_s)
    per_step = agreement / every
    if context.world_size == 1:
        per_step = 0.0
        print(f"stop-flag agreement: none at world size 1 (a one-rank all-reduce would take {1e6 * agreement:.0f} us)")
    else:
        print(f"stop-flag agreement: {1e6 * agreement:.0f} us each, one every {every} step(s) at this step time: "
              f"{1e6 * per_step:.0f} us/step = {100 * per_step / p:.2f}% of a plain step")
    print(f"watchdog phase marks: {1e6 * marks:.1f} us/step = {100 * marks / p:.3f}% of a plain step")
    print(f"RNG streams keyed to the step: {1e6 * keying:.1f} us/step = {100 * keying / p:.3f}% of a plain step")
    print(f"together: {100 * (per_step + marks + keying) / p:.2f}%   (target <= 1%)")


def worker(args: argparse.Namespace) -> None:
    import torch
    from config import MLPConfig
    from dataset import make_datasets
    from model import build_model

    from elastic_ddp.build import Built
    from elastic_ddp.config import config_from_args
    from elastic_ddp.distributed import distributed

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
                    t_ours, c_ours, summary = trainer_loop(config, context, Built(build_model(config.model), data),
                                                           args.steps, os.path.join(tmp, str(round_index)))
                collector.loop = None
            if round_index:
                plain.append(t_plain / args.steps)
                ours.append(t_ours / args.steps)
                cpu["plain"].append(c_plain / args.steps)
                cpu["trainer"].append(c_ours / args.steps)
                if summary:
                    wait_share.append(summary["data_wait_s"] / summary["step_time_s"])
        agreement, marks, keying = resilience_costs(context)
        if context.is_main:
            p, o = statistics.median(plain), statistics.median(ours)
            print(f"rounds={args.rounds} steps/round={args.steps} ranks={context.world_size} backend={context.backend}")
            print(f"plain DDP loop   median step {1e3 * p:8.2f} ms   (all: {', '.join(f'{1e3 * x:.1f}' for x in plain)})")
            print(f"elastic_ddp      median step {1e3 * o:8.2f} ms   (all: {', '.join(f'{1e3 * x:.1f}' for x in ours)})")
            print(f"ratio trainer/plain: {ratio_summary(ours, plain)}   (target <= 1.03)")
            c_plain, c_ours = statistics.median(cpu["plain"]), statistics.median(cpu["trainer"])
            print(f"CPU time per step (rank 0, all its threads): plain {1e3 * c_plain:.1f} ms, "
                  f"elastic_ddp {1e3 * c_ours:.1f} ms, ratio {c_ours / c_plain:.3f}")
            total_steps = args.rounds * args.steps
            plain_schedule = "the trainer's schedule" if plain_gc_every else "automatic"
            print(f"garbage collection per step (rank 0): plain {1e3 * collector.seconds['plain'] / total_steps:.2f} ms "
                  f"({plain_schedule}), elastic_ddp "
                  f"{1e3 * collector.seconds['trainer'] / total_steps:.2f} ms (every {config.gc_every} steps)")
            print(f"trainer data-wait share of step time: median {100 * statistics.median(wait_share):.2f}%   (target < 5%)")
            print_resilience_costs(config, context, p, agreement, marks, keying)


# -- --model lm: examples/lm's GPT, three loops ---------------------------------------------------


def load_lm_example():
    """examples/lm/train.py as module ``lm_train`` (its own name, ``train``, is examples/train.py's), with
    examples/lm on the path for its ``corpus`` and ``gpt`` imports."""
    if "lm_train" in sys.modules:
        return sys.modules["lm_train"]
    sys.path.insert(0, str(REPO / "examples" / "lm"))
    spec = importlib.util.spec_from_file_location("lm_train", REPO / "examples" / "lm" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lm_train"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def lm_training_parts(config, model):
    """What every LM loop steps with, made as the example and the trainer make them: AdamW over the
    example's param groups (decay on the 2-D Linear weights only), the runtime's warmup + decay
    multiplier in a LambdaLR, the autocast context and a gradient scaler (float16 autocast only)."""
    import torch
    from gpt import parameter_groups

    from elastic_ddp.parts import lr_multiplier

    optim = config.optim
    optimizer = torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                  betas=(optim.beta1, optim.beta2), eps=optim.eps)
    schedule = functools.partial(lr_multiplier, warmup=optim.warmup_steps, decay_steps=config.decay_steps,
                                 schedule=optim.schedule, min_ratio=optim.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    device_type = next(model.parameters()).device.type
    dtype = getattr(torch, config.amp_dtype)
    autocast = functools.partial(torch.autocast, device_type, dtype=dtype, enabled=config.use_amp)
    scaler = torch.amp.GradScaler(device_type) if config.use_amp and config.amp_dtype == "float16" else None
    return optimizer, scheduler, autocast, scaler


def lm_optimizer_step(config, model, optimizer, scheduler, scaler) -> None:
    """Unscale, clip, step, zero, schedule: the trainer's order."""
    import torch

    if scaler is not None:
        scaler.unscale_(optimizer)
    if config.optim.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def lm_plain_loop(config, context, model, data, steps: int, gc_every: int = 0) -> tuple[float, float]:
    """A hand-written DDP loop over the LM; returns (wall, CPU) seconds. ``gc_every`` > 0: the trainer's
    garbage-collection schedule."""
    from lm_train import lm_loss
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from elastic_ddp.collection import StepCollection

    device = context.device
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, scheduler, autocast, scaler = lm_training_parts(config, model)
    loader = DataLoader(data, batch_sampler=step_indices(config, context, len(data), steps),
                        num_workers=config.loader.num_workers, pin_memory=device.type == "cuda")
    started, cpu_started = time.perf_counter(), time.process_time()
    collection = StepCollection(gc_every).start()
    for step, (inputs, targets, _) in enumerate(loader, 1):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast():
            loss = lm_loss(ddp(inputs), targets).mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        lm_optimizer_step(config, model, optimizer, scheduler, scaler)
        collection.step(step)
    collection.stop()
    return time.perf_counter() - started, time.process_time() - cpu_started


def lm_library_loop(config, context, model, data, steps: int, gc_every: int = 0) -> tuple[float, float]:
    """The plain loop plus the library path's per-step additions (as in examples/byo_loop/train.py):
    the ElasticSampler as batch sampler, its plan, micro-batches, loss scale and commit, and
    Runtime.after_step every step (no checkpoint directory); returns (wall, CPU) seconds."""
    from contextlib import nullcontext

    from lm_train import lm_loss
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from elastic_ddp.collection import StepCollection
    from elastic_ddp.loop import ElasticSampler, ResilienceConfig, Runtime

    device = context.device
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, scheduler, autocast, scaler = lm_training_parts(config, model)
    sampler = ElasticSampler(len(data), global_batch_size=config.global_batch_size, seed=config.seed,
                             rank=context.rank, world_size=context.world_size, grad_accum_steps=config.grad_accum_steps,
                             shuffle=config.loader.shuffle, drop_last=config.loader.drop_last)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=config.loader.num_workers,
                        pin_memory=device.type == "cuda")
    resilience = config.resilience
    runtime = Runtime.for_loop(model=model, optimizer=optimizer, sampler=sampler, seed=config.seed,
                               resilience=ResilienceConfig(watchdog_timeout_s=resilience.watchdog_timeout_s,
                                                           agreement_interval_s=resilience.agreement_interval_s,
                                                           handle_signals=resilience.handle_signals),
                               collective_timeout_s=config.dist.collective_timeout_s).__enter__()
    runtime.restore()  # no checkpoint directory: starts fresh (and marks the start of training)
    started, cpu_started = time.perf_counter(), time.process_time()
    collection = StepCollection(gc_every).start()
    batches = iter(loader)
    step = 0
    while step < steps:
        plan = sampler.plan()
        micro_batches = sampler.local_micro_batches(plan)
        scale = sampler.loss_scale(plan)
        for index in range(len(micro_batches)):
            inputs, targets, _ = next(batches)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with nullcontext() if index == len(micro_batches) - 1 else ddp.no_sync():
                with autocast():
                    loss = lm_loss(ddp(inputs), targets).sum() * scale
                (scaler.scale(loss) if scaler is not None else loss).backward()
        lm_optimizer_step(config, model, optimizer, scheduler, scaler)
        sampler.commit(plan)
        step += 1
        if runtime.after_step(step).stop:
            break
        collection.step(step)
    runtime.agreement.settle()  # completes the agreement still in flight, as the trainer's run does before it returns
    runtime.close()
    collection.stop()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    del batches
    return elapsed, cpu


def lm_worker(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    from elastic_ddp.config import config_from_args
    from elastic_ddp.distributed import distributed
    from elastic_ddp.state import seed_rng_streams

    lm = load_lm_example()
    from gpt import parameter_count

    config = config_from_args(LM_ARGS + ["--max-steps", str(args.steps)], prog="step_overhead.py --model lm",
                              config_class=lm.LMConfig)
    if config.grad_accum_steps != 1 or config.global_batch_size % int(os.environ["WORLD_SIZE"]):
        raise SystemExit("the plain loop splits each global batch evenly into one micro-batch per rank")
    times: dict[str, list[float]] = {name: [] for name in LM_LOOPS}
    cpu: dict[str, list[float]] = {name: [] for name in LM_LOOPS}
    wait_share: list[float] = []
    collector = CollectorTime()
    plain_gc_every = config.gc_every if args.plain_gc_schedule else 0
    with distributed(config.dist) as context, tempfile.TemporaryDirectory() as tmp:
        seed_rng_streams(config.seed)  # as run_training does before build: the same weights on every rank
        # The example's Built, minus its evaluation (the trainer would run it at the end of every timed run;
        # the other loops evaluate nothing) and its fault-injection wrapper around lm_loss.
        built = dataclasses.replace(lm.build(config), evaluate=None, eval_data=None, loss_fn=lm.lm_loss)
        initial = built.model  # never trained: every loop of every round starts from a copy of these weights
        for round_index in range(args.rounds + 1):  # round 0 warms up the three paths and is discarded
            seconds: dict[str, tuple[float, float]] = {}
            summary: dict = {}
            for which in LM_ORDERS[(round_index - 1) % len(LM_ORDERS)]:
                torch.manual_seed(0)
                model = copy.deepcopy(initial)
                gc.collect()  # the previous loop's objects (a trainer is freed by the cyclic collector) are gone
                collector.loop = which if round_index else None
                if which == "plain":
                    seconds[which] = lm_plain_loop(config, context, model, built.train_data, args.steps, plain_gc_every)
                elif which == "library":
                    seconds[which] = lm_library_loop(config, context, model, built.train_data, args.steps,
                                                     plain_gc_every)
                else:
                    wall, cpu_s, summary = trainer_loop(config, context, dataclasses.replace(built, model=model),
                                                        args.steps, os.path.join(tmp, str(round_index)))
                    seconds[which] = wall, cpu_s
                collector.loop = None
                del model
            if round_index:
                for name, (wall, cpu_s) in seconds.items():
                    times[name].append(wall / args.steps)
                    cpu[name].append(cpu_s / args.steps)
                if summary:
                    wait_share.append(summary["data_wait_s"] / summary["step_time_s"])
        agreement, marks, keying = resilience_costs(context)
        if context.is_main:
            shape = config.model
            tokens = config.global_batch_size * shape.context
            print(f"model=lm: GPT n_layer={shape.n_layer} d_model={shape.d_model} n_head={shape.n_head} "
                  f"context={shape.context} ({parameter_count(built.model):,} parameters); corpus "
                  f"{config.data.budget_bytes:,} bytes, {len(built.train_data):,} training windows; global batch "
                  f"{config.global_batch_size} sequences = {tokens:,} tokens/step; autocast "
                  f"{config.amp_dtype if config.use_amp else 'off'}; AdamW lr {config.optim.lr:g} "
                  f"betas {config.optim.beta1:g}/{config.optim.beta2:g} wd {config.optim.weight_decay:g}, "
                  f"{config.optim.warmup_steps} warmup + {config.optim.schedule} to step {config.decay_steps}; "
                  f"clip {config.optim.grad_clip_norm:g}")
            print(f"rounds={args.rounds} steps/round={args.steps} ranks={context.world_size} backend={context.backend} "
                  f"threads/rank={torch.get_num_threads()} orders: "
                  + " ".join("".join(name[0].upper() for name in order) for order in LM_ORDERS) + " (P plain, "
                  "T trainer, L library)")
            labels = {"plain": "plain DDP loop  ", "trainer": "elastic_ddp     ", "library": "library path    "}
            medians = {name: statistics.median(times[name]) for name in LM_LOOPS}
            for name in LM_LOOPS:
                print(f"{labels[name]} median step {1e3 * medians[name]:8.2f} ms = "
                      f"{tokens / medians[name]:8.0f} tokens/s"
                      f"   (all: {', '.join(f'{1e3 * x:.1f}' for x in times[name])})")
            print(f"ratio trainer/plain: {ratio_summary(times['trainer'], times['plain'])}   (target <= 1.02)")
            print(f"ratio library/plain: {ratio_summary(times['library'], times['plain'])}   (target <= 1.02)")
            c = {name: statistics.median(cpu[name]) for name in LM_LOOPS}
            print(f"CPU time per step (rank 0, all its threads): plain {1e3 * c['plain']:.1f} ms, "
                  f"elastic_ddp {1e3 * c['trainer']:.1f} ms, library {1e3 * c['library']:.1f} ms; "
                  f"ratios trainer {c['trainer'] / c['plain']:.3f}, library {c['library'] / c['plain']:.3f}")
            total_steps = args.rounds * args.steps
            plain_schedule = "the trainer's schedule" if plain_gc_every else "automatic"
            gc_ms = {name: 1e3 * collector.seconds[name] / total_steps for name in LM_LOOPS}
            print(f"garbage collection per step (rank 0): plain {gc_ms['plain']:.2f} ms, "
                  f"library {gc_ms['library']:.2f} ms ({plain_schedule}), elastic_ddp "
                  f"{gc_ms['trainer']:.2f} ms (every {config.gc_every} steps)")
            print(f"trainer data-wait share of step time: median {100 * statistics.median(wait_share):.2f}%   (target < 5%)")
            print_resilience_costs(config, context, medians["plain"], agreement, marks, keying)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp",
                        help="mlp: the trainer against a plain loop on the MLP (MODEL_ARGS); lm: plain, trainer and "
                             "library-path loops on examples/lm's GPT (LM_ARGS)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--plain-gc-schedule", action="store_true",
                        help="give the plain loop (and with --model lm the library loop) the trainer's "
                             "garbage-collection schedule")
    args = parser.parse_args()
    if "RANK" in os.environ:
        (lm_worker if args.model == "lm" else worker)(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--rounds", str(args.rounds), "--steps", str(args.steps), "--model", args.model]
    command += ["--plain-gc-schedule"] if args.plain_gc_schedule else []
    sys.exit(subprocess.call(command, env=env, cwd=REPO))


if __name__ == "__main__":
    main()
