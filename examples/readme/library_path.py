"""Your loop on the library path: keep the loop, elastic_ddp runs around it.

  torchrun --standalone --nproc-per-node=2 examples/readme/library_path.py \
      --max-steps 200 --checkpoint-dir /tmp/library-ckpt --checkpoint-every 50 --log-dir /tmp/library-logs
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from elastic_ddp import (
    CheckpointConfig,
    ElasticSampler,
    Runtime,
    entrypoint,
    init_process_group,
    open_events,
    shutdown_process_group,
)


@entrypoint
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)  # global: over all ranks, at any world size
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="")  # a path or s3://bucket/prefix; empty: no checkpoints
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--log-dir", default="")  # events.jsonl goes here
    args = parser.parse_args(argv)
    context = init_process_group()  # NCCL on GPUs, else gloo; a restart's ranks meet at once
    rank, world_size, device = context.rank, context.world_size, context.device
    torch.manual_seed(args.seed)
    inputs = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(inputs, (inputs[:, :8].sum(1) > inputs[:, 8:].sum(1)).long())
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    sampler = ElasticSampler(len(dataset), global_batch_size=args.batch_size, seed=args.seed, rank=rank,
                             world_size=world_size)  # replaces DistributedSampler
    loader = DataLoader(dataset, batch_sampler=sampler, generator=torch.Generator().manual_seed(args.seed))
    events = open_events(args.log_dir)
    runtime = Runtime.for_loop(
        model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler, seed=args.seed, events=events,
        fingerprint={"batch_size": args.batch_size, "seed": args.seed},  # a resume must match these
        checkpoint=CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every))
    with runtime:
        step = runtime.restore()  # 0 on a fresh start
        batches = iter(loader)  # after restore()
        while step < args.max_steps:
            plan = sampler.plan()  # this step's global batch: the same samples at any world size
            micro_batches = sampler.local_micro_batches(plan)
            for index in range(len(micro_batches)):
                x, y = (t.to(device) for t in next(batches))
                with nullcontext() if index == len(micro_batches) - 1 else ddp.no_sync():
                    loss = F.cross_entropy(ddp(x), y, reduction="sum") * sampler.loss_scale(plan)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            sampler.commit(plan)
            step += 1
            if runtime.after_step(step).stop:  # checkpoints, replicas, stop requests: every rank alike
                break
    events.close()
    shutdown_process_group()
    return runtime.exit_status or 0


if __name__ == "__main__":
    sys.exit(main())
