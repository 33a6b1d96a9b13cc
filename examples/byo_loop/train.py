"""A hand-written DDP loop in the seed pipeline's style, made elastic with elastic_ddp's library path.

``plain.py`` beside it is the same loop without elastic_ddp; ``diff -u plain.py train.py`` shows
every line the library path adds or changes: the global-cursor sampler instead of
DistributedSampler, and the runtime, entered around the loop and asked once per step, instead of
torch.save.

How to run:
  one node, 2 processes:  torchrun --standalone --nproc-per-node=2 examples/byo_loop/train.py --max-steps 100 \
                            --checkpoint-dir /tmp/byo --checkpoint-every 20
  elastic, etcd v3:       torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 \
                            --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 examples/byo_loop/train.py \
                            --checkpoint-dir /tmp/byo --checkpoint-every 20
  add --rdzv-conf in_process=true (a preview): the survivors of a lost or preempted node keep their processes,
  and a restarted or added node's workers join at a step boundary (the loop wraps the model and makes its loader
  iterator again where the runtime says it re-formed)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from elastic_ddp.loop import (
    CheckpointConfig,
    ElasticSampler,
    MetricsWriter,
    ResilienceConfig,
    Runtime,
    entrypoint,
    init_process_group,
    open_events,
    shutdown_process_group,
)


@dataclass
class TrainingConfig:
    batch_size: int = 128  # global, over all ranks
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    use_amp: bool = False
    grad_accum_steps: int = 1
    max_steps: int = 200
    seed: int = 0
    num_samples: int = 8192
    hidden: int = 128
    num_workers: int = 0
    log_every: int = 20
    checkpoint_dir: str = ""  # a path, or s3://bucket/prefix
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    checkpoint_storage_options: str = ""  # JSON for s3:// (fsspec options: endpoint_url, key, ...)
    checkpoint_replica_every: int = 1  # keep a replica of the state in node memory every N steps (0: off)
    resilience_spot_notice_url: str = ""  # poll this (or 'aws', 'gcp') for a spot notice; one stops the job at an agreed step
    resilience_spot_poll_interval_s: float = 5.0
    log_dir: str = ""  # events.jsonl (resumed, committed, stop agreed, exit...) and metrics.jsonl go here
    log_sample_ledger: bool = False  # rank 0 appends each committed step's sample ids to <log-dir>/samples.jsonl
    lr_decay_every: int = 100  # StepLR: the learning rate drops 0.3x every this many steps


def parse_args(argv: list[str] | None = None) -> TrainingConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainingConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return TrainingConfig(**vars(parser.parse_args(argv)))


class Spirals(Dataset):
    """Two interleaved noisy spirals (generated from a seed, no download)."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        radius = torch.rand(count, generator=generator) * 2 * math.pi
        self.labels = torch.randint(0, 2, (count,), generator=generator)
        angle = radius + math.pi * self.labels
        points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1) / (2 * math.pi)
        self.points = points + 0.02 * torch.randn(count, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.points[index], self.labels[index], index


def build_model(config: TrainingConfig) -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, config.hidden), nn.LayerNorm(config.hidden), nn.SiLU(),
        nn.Linear(config.hidden, config.hidden), nn.SiLU(), nn.Linear(config.hidden, 2),
    )


@entrypoint
def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    context = init_process_group()  # NCCL on GPUs, else gloo; a restart's ranks meet at once
    rank, world_size, device = context.rank, context.world_size, context.device
    torch.manual_seed(config.seed)
    model = build_model(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, nesterov=True,
                                weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_decay_every, gamma=0.3)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=config.use_amp and amp_dtype == torch.float16)
    dataset = Spirals(config.num_samples, config.seed)
    sampler = ElasticSampler(len(dataset), global_batch_size=config.batch_size, seed=config.seed, rank=rank,
                             world_size=world_size, grad_accum_steps=config.grad_accum_steps)
    # its own generator: the workers' seeds do not depend on what the global RNG drew before
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=config.num_workers,
                        generator=torch.Generator().manual_seed(config.seed))
    events = open_events(config.log_dir)
    metrics = MetricsWriter(config.log_dir, enabled=rank == 0)
    runtime = Runtime.for_loop(
        model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler,
        scaler=scaler if scaler.is_enabled() else None, seed=config.seed, events=events,
        sample_ledger=config.log_sample_ledger, membership=context.membership,
        checkpoint=CheckpointConfig(dir=config.checkpoint_dir, every=config.checkpoint_every, keep=config.checkpoint_keep,
                                    storage_options=config.checkpoint_storage_options,
                                    replica_every=config.checkpoint_replica_every),
        resilience=ResilienceConfig(spot_notice_url=config.resilience_spot_notice_url,
                                    spot_poll_interval_s=config.resilience_spot_poll_interval_s),
        fingerprint={name: getattr(config, name) for name in ("seed", "batch_size", "num_samples", "hidden", "lr_decay_every")})
    with runtime:
        step = runtime.restore()
        ddp = DistributedDataParallel(model)  # after the restore: a joining worker's first collective is the runtime's
        if rank == 0 and step:
            print(f"resumed at step {step}")
        batches = iter(loader)
        logged_at = time.perf_counter()
        while step < config.max_steps:
            try:
                plan = sampler.plan()
                micro_batches = sampler.local_micro_batches(plan)
                for index in range(len(micro_batches)):
                    inputs, targets, _ = next(batches)
                    inputs, targets = inputs.to(device), targets.to(device)
                    with nullcontext() if index == len(micro_batches) - 1 else ddp.no_sync():
                        with torch.autocast(device.type, dtype=amp_dtype, enabled=config.use_amp):
                            loss = F.cross_entropy(ddp(inputs).float(), targets, reduction="sum") * sampler.loss_scale(plan)
                        scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                sampler.commit(plan)
                step += 1
                if rank == 0 and step % config.log_every == 0:
                    mean_loss = loss.item() / sampler.loss_scale(plan) / len(inputs)
                    step_time, logged_at = (time.perf_counter() - logged_at) / config.log_every, time.perf_counter()
                    print(f"step {step} loss {mean_loss:.4f} lr {scheduler.get_last_lr()[0]:.2e}")
                    metrics.write({"step": step, "loss": mean_loss, "world_size": world_size, "time": time.time(),
                                   "step_time_s": step_time})
                decision = runtime.after_step(step)  # checkpoints, replicas and stops, every rank alike
                if decision.stop:
                    break
                reformed = decision.reformed  # in-process mode: a node left or joined at this step
            except RuntimeError as exc:
                reformed = runtime.recover(exc)  # in-process mode: a peer was lost; else the error ends the worker
                if not reformed:
                    raise
            if reformed:  # the same process, in a new membership: wrap the model and start the loader again
                step, rank, world_size = runtime.state.counters.step, runtime.rank, runtime.world_size
                ddp, batches = DistributedDataParallel(model), iter(loader)
                if rank == 0 and not metrics.path:  # rank 0 was lost: this rank writes the metrics from here
                    metrics.close()
                    metrics = MetricsWriter(config.log_dir, enabled=True)
    shutdown_process_group()
    metrics.close()
    events.close()
    return runtime.exit_status or 0


if __name__ == "__main__":
    sys.exit(main())
