"""Checkpoint speed: elastic_ddp against its peers, measured side by side in one run.

How to run:
  .venv/bin/python benchmarks/checkpoint.py                 # local disk + S3 (moto on 127.0.0.1)
  .venv/bin/python benchmarks/checkpoint.py --no-s3 --repeats 5

State: an MLP of 4 x Linear(4096, 4096) with AdamW state after one step — 805 MB of model
plus optimizer state (the S3 part uses a 1/4-size state: moto holds objects in memory at
several times their size). Every figure is the median of --repeats runs, in the same process,
with the peers interleaved:

  blocking time of an async save   ours (stage into reused buffers) vs DCP async_save
                                   (default stager; reused stager) vs copy_ / clone floors
  sync save to local disk          ours (checksums included) vs f.write+fsync of the same
                                   bytes vs torch.save+fsync vs DCP save, each into new files
                                   (what is replaced or deleted is removed before the timing),
                                   in rotating order (max(repeats, 4) rounds); our retention
                                   runs behind the save, so the timing leaves it out
  restore                          ours (verify checksums + load) vs torch.load(weights_only)
  S3 save                          ours vs s3fs pipe_file of the same bytes, same endpoint
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.checkpoint.format import encode_chunks, flatten
from elastic_ddp.config import TrainConfig, fingerprint
from elastic_ddp.data import ElasticSampler
from elastic_ddp.state import TrainState

GB = 1e9


def make_state(width: int, layers: int) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = ElasticSampler(1024, global_batch_size=8, seed=0, rank=0, world_size=1)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=None, sampler=sampler,
                      fingerprint=fingerprint(TrainConfig()), seed=0)


def state_bytes(state: TrainState) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state.replicated_state_dict()).tensors)


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rotated_times(contenders: dict[str, tuple[Callable[[], object], Callable[[], object] | None]],
                  rounds: int) -> dict[str, float]:
    """Median seconds of each contender over ``rounds`` rounds, the order rotated by one each round.

    A large fsynced write slows the one that follows it on this virtio disk (the host is still
    writing back: a plain write takes 1.5 s first and 3 s right after another), so every
    contender takes every place in the order equally often. ``setup`` (untimed) removes what
    the contender's previous round wrote, so that each write goes into new files on blocks
    that were freed just before (as a job's own retention frees them): writing blocks that the
    disk image never held costs almost twice as much here.
    """
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run, setup = contenders[name]
            if setup:
                setup()
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def fsync_write(path: str, chunks) -> None:
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())


def row(label: str, seconds: float, nbytes: int, note: str = "") -> None:
    print(f"  {label:44s} {seconds:7.3f} s  {seconds / (nbytes / GB):6.3f} s/GB  {nbytes / GB / seconds:6.2f} GB/s  {note}")


def local_benchmarks(args: argparse.Namespace, work: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    state = make_state(4096, 4)
    nbytes = state_bytes(state)
    tensors = flatten(state.replicated_state_dict()).tensors
    print(f"state: {nbytes / 1e6:.0f} MB (model + AdamW), {len(tensors)} tensors; repeats={args.repeats}")
    ckpt_root = work / "ours"

    def fresh_manager() -> CheckpointManager:
        shutil.rmtree(ckpt_root, ignore_errors=True)
        return CheckpointManager(str(ckpt_root), rank=0, world_size=1, run_id="bench", keep=2)

    print("\nblocking time of an asynchronous save (lower is better; target <= 0.15 s/GB):")
    buffers = [torch.empty_like(t) for t in tensors]
    row("copy_ into preallocated buffers (floor)", median_time(lambda: [b.copy_(t) for b, t in zip(buffers, tensors)], args.repeats), nbytes)
    row("clone() into fresh memory", median_time(lambda: [t.clone() for t in tensors], args.repeats), nbytes)
    manager = fresh_manager()
    saver = AsyncCheckpointer(manager)
    blocked = []
    for _ in range(args.repeats + 1):  # the first save allocates the staging buffers
        state.counters.step += 1
        blocked.append(saver.save(state))
        saver.wait()
    row("elastic_ddp AsyncCheckpointer.save (reused)", statistics.median(blocked[1:]), nbytes)
    row("elastic_ddp first save (allocates buffers)", blocked[0], nbytes)
    saver.close()
    sd = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}
    for label, make_stager in (("DCP async_save, default stager", lambda: None),
                               ("DCP async_save, reused stager", lambda: reused)):
        reused = DefaultStager(StagingOptions(False, False, False, False))
        returns = []
        for index in range(args.repeats + 1):
            target = work / f"dcp-async-{index}"
            started = time.perf_counter()
            future = dcp.async_save(sd, checkpoint_id=str(target), async_stager=make_stager(), no_dist=True)
            returns.append(time.perf_counter() - started)
            future.result()
            shutil.rmtree(target)
        reused.close()
        row(label, statistics.median(returns[1:]), nbytes)

    print("\nsynchronous save to local disk, each into a new file, in rotating order "
          "(target >= 1.0 GB/s and >= 0.8x f.write+fsync):")
    flat = flatten(state.replicated_state_dict())
    plain_file, torch_file = str(work / "plain.bin"), str(work / "torch.pt")
    manager = fresh_manager()
    keep_all = CheckpointManager(str(work / "ours-keep-all"), rank=0, world_size=1, run_id="bench", keep=1000)
    for _ in range(2):  # what the restore below reads
        state.counters.step += 1
        manager.save(state)

    def saving(into: CheckpointManager) -> Callable[[], object]:
        def save() -> None:
            state.counters.step += 1
            into.save(state)
        return save

    def torch_save() -> None:
        with open(torch_file, "wb") as handle:
            torch.save(sd, handle)
            handle.flush()
            os.fsync(handle.fileno())

    def remove(path: str) -> Callable[[], None]:
        return lambda: shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)

    contenders = {
        "plain": (lambda: fsync_write(plain_file, encode_chunks(flat)), remove(plain_file)),
        "ours": (saving(keep_all), lambda: [shutil.rmtree(info.path) for info in keep_all.list()]),
        "torch": (torch_save, remove(torch_file)),
        "dcp": (lambda: dcp.save(sd, checkpoint_id=str(work / "dcp-sync"), no_dist=True), remove(str(work / "dcp-sync"))),
    }
    times = rotated_times(contenders, max(args.repeats, len(contenders)))
    t_plain, t_ours = times["plain"], times["ours"]
    row("plain f.write + fsync of the same bytes", t_plain, nbytes)
    row("elastic_ddp save (sha256 + manifest commit)", t_ours, nbytes, f"{t_plain / t_ours:.2f}x plain")
    row("torch.save + fsync", times["torch"], nbytes)
    row("DCP save (sync)", times["dcp"], nbytes)
    shutil.rmtree(work / "ours-keep-all", ignore_errors=True)

    print("\nrestore, page cache warm for both (target <= 1.3x torch.load):")
    t_load = median_time(lambda: torch.load(torch_file, weights_only=True), args.repeats)
    row("torch.load(weights_only=True)", t_load, nbytes)
    target_state = make_state(4096, 4)
    t_restore = median_time(lambda: manager.restore(target_state), args.repeats)
    row("elastic_ddp restore (verify sha256 + load)", t_restore, nbytes, f"{t_restore / t_load:.2f}x torch.load")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_benchmarks(args: argparse.Namespace) -> None:
    import s3fs

    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        options = {"endpoint_url": f"http://127.0.0.1:{port}"}
        fs = s3fs.S3FileSystem(**options)
        deadline = time.monotonic() + 30
        while True:
            try:
                fs.mkdir("bench")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        state = make_state(4096, 1)
        nbytes = state_bytes(state)
        print(f"\nS3 save to moto on 127.0.0.1 ({nbytes / 1e6:.0f} MB state; target >= 0.9x pipe_file):")
        blob = b"".join(bytes(c) for c in encode_chunks(flatten(state.replicated_state_dict())))
        t_pipe = median_time(lambda: fs.pipe_file("bench/plain.bin", blob), args.repeats)
        row("s3fs pipe_file of the same bytes", t_pipe, nbytes)
        manager = CheckpointManager("s3://bench/ours", rank=0, world_size=1, run_id="bench", keep=2, storage_options=options)

        def ours() -> None:
            state.counters.step += 1
            manager.save(state)

        t_ours = median_time(ours, args.repeats)
        row("elastic_ddp save to s3://", t_ours, nbytes, f"{t_pipe / t_ours:.2f}x pipe_file")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    parser.add_argument("--no-local", action="store_true", help="skip the local parts (async, sync, restore)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized():  # DCP's stagers and planners expect a process group to exist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not args.no_local:
        with tempfile.TemporaryDirectory(dir=args.dir) as work:
            local_benchmarks(args, Path(work))
    if not args.no_s3:
        s3_benchmarks(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
