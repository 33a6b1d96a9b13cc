"""Checkpoint speed: elastic_ddp against its peers, measured side by side in one run.

How to run:
  .venv/bin/python benchmarks/checkpoint.py                 # local disk + S3 (moto on 127.0.0.1)
  .venv/bin/python benchmarks/checkpoint.py --no-s3 --repeats 5

State: an MLP of 4 x Linear(4096, 4096) with AdamW state after one step — 805 MB of model
plus optimizer state (the S3 part uses a 1/4-size state: moto holds objects in memory at
several times their size). Every figure is the median of --repeats runs, in the same process,
with the peers interleaved:

  blocking time of an async save   what a save adds to the training step that takes it (a
                                   forward + backward + AdamW step of the model, --batch): ours
                                   vs DCP async_save (default stager; reused stager; reused
                                   stager with async staging, waited for before the optimizer
                                   step as DCP asks), next to the copy_ / clone floors of a
                                   blocking copy
  sync save to local disk          ours (checksums included) vs f.write+fsync of the same
                                   bytes vs torch.save+fsync vs safetensors save_file+fsync vs
                                   DCP save, each into new files
                                   (what is replaced or deleted is removed before the timing),
                                   in rotating order (max(repeats, 4) rounds); our retention
                                   runs behind the save, so the timing leaves it out; then
                                   --pairs adjacent pairs of the plain write and ours alone,
                                   the order alternating: the median of the per-pair ratios
  restore                          ours (verify checksums + load into the model and optimizer) vs
                                   torch.load(weights_only) vs safetensors load_file, in rotating
                                   order; the ratio of the medians and the range of the per-round
                                   ratios
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
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

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


def step_stall(step: Callable[[], None], save: Callable[[], float], waited: Callable[[], float],
               finish: Callable[[], object], repeats: int) -> dict[str, float]:
    """Medians of a step's seconds ("step"), how long a save blocked the loop ("blocked": the save
    call plus any wait of the next optimizer step for its copy), and how much longer the step that
    took the save was than a step alone ("added": blocking plus the interference of the save's
    background work with that step's compute).

    Each repeat times a step alone, then a save followed by a step, after the previous save has
    finished (untimed). The first repeat warms up (staging buffers, allocator) and is discarded.
    """
    alone, added, blocked = [], [], []
    for _ in range(repeats + 1):
        finish()
        started = time.perf_counter()
        step()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        returned = save()
        step()
        added.append(time.perf_counter() - started - alone[-1])
        blocked.append(returned + waited())
    finish()
    return {"step": statistics.median(alone[1:]), "added": statistics.median(added[1:]),
            "blocked": statistics.median(blocked[1:])}


def rotated_times(contenders: dict[str, tuple[Callable[[], object], Callable[[], object] | None]],
                  rounds: int, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds of each contender in each of ``rounds`` rounds, the order rotated by one each round
    (and the process's CPU seconds of each run into ``cpu``, when given).

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
            started, cpu_started = time.perf_counter(), time.process_time()
            result = run()
            times[name].append(time.perf_counter() - started)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - cpu_started)
            del result  # freeing what a reader returned is not part of its time
    return times


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f} s"


def ratio_spread(ours: list[float], peer: list[float]) -> str:
    """The ratio of the medians, and the range of the per-round ratios (same round, adjacent runs)."""
    ratios = [a / b for a, b in zip(ours, peer)]
    return f"{statistics.median(ours) / statistics.median(peer):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"


def fsync_write(path: str, chunks) -> None:
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())


def head_to_head(plain: tuple[Callable[[], object], Callable[[], object] | None],
                 ours: tuple[Callable[[], object], Callable[[], object] | None], pairs: int, nbytes: int) -> None:
    """``pairs`` adjacent runs of a plain write and our save, the one that goes first alternating: on this disk one
    write's time varies 4x from round to round (the host's writeback of the writes before it), so a ratio of two
    medians over a few rounds can land anywhere; the ratio within each pair, of two writes made under the same
    conditions, is the figure, given as the median and quartiles over the pairs."""
    if pairs < 2:
        return
    contenders = {"plain": plain, "ours": ours}
    ratios: list[float] = []
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for index in range(pairs):
        order = ["plain", "ours"] if index % 2 == 0 else ["ours", "plain"]
        pair = rotated_times({name: contenders[name] for name in order}, 1)
        for name in order:
            times[name] += pair[name]
        ratios.append(pair["plain"][0] / pair["ours"][0])
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"  head to head, {pairs} adjacent pairs, the order alternating: elastic_ddp save at "
          f"{statistics.median(ratios):.2f}x plain speed (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, "
          f"pairs {min(ratios):.2f}-{max(ratios):.2f}); medians {statistics.median(times['ours']):.3f} s "
          f"({nbytes / GB / statistics.median(times['ours']):.2f} GB/s) and {statistics.median(times['plain']):.3f} s "
          f"({nbytes / GB / statistics.median(times['plain']):.2f} GB/s)")
    print("    pairs, plain / ours s: " + ", ".join(f"{p:.2f}/{o:.2f}" for p, o in zip(times["plain"], times["ours"])))


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

    batch = torch.randn(args.batch, 4096)

    def train_step() -> None:
        state.model(batch).square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)

    print(f"\nblocking time of an asynchronous save: what it adds to the training step that takes it (forward + "
          f"backward of a batch of {args.batch}, AdamW step); lower is better; target <= 0.15 s/GB:")
    buffers = [torch.empty_like(t) for t in tensors]
    copy_time = median_time(lambda: [b.copy_(t) for b, t in zip(buffers, tensors)], args.repeats)
    row("copy_ into preallocated buffers (floor of a blocking copy)", copy_time, nbytes)
    row("clone() into fresh memory", median_time(lambda: [t.clone() for t in tensors], args.repeats), nbytes)
    print("  ('blocked' = the save call + the next optimizer step's wait for the copy; 'step +' = how much longer the "
          "step that takes the save is than a step alone: blocking plus the background work's interference)")
    for label, overlap in (("elastic_ddp AsyncCheckpointer.save", True),
                           ("elastic_ddp, all copied before save returns", False)):
        saver = AsyncCheckpointer(fresh_manager(), overlap=overlap)

        def ours() -> float:
            state.counters.step += 1
            return saver.save(state)

        timed = step_stall(train_step, ours, lambda: saver.last_step_wait, saver.wait, args.repeats)
        row(f"{label}, blocked", timed["blocked"], nbytes, f"step + {timed['added']:.3f} s (alone {timed['step']:.3f} s)")
        saver.close()
        saver.manager.wait_for_retention()
    dcp_state = lambda: {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}  # noqa: E731
    for label, options in (("DCP async_save, default stager", None),
                           ("DCP async_save, reused stager", StagingOptions(False, False, False, False)),
                           ("DCP async_save, reused stager, async staging", StagingOptions(False, False, True, False))):
        stager = DefaultStager(options) if options is not None else None
        response: list = []
        step_wait = [0.0]
        targets = iter(range(10**6))

        def dcp_save() -> float:
            started = time.perf_counter()
            step_wait[0] = 0.0
            response[:] = [dcp.async_save(dcp_state(), checkpoint_id=str(work / f"dcp-async-{next(targets)}"),
                                          async_stager=stager, no_dist=True)]
            return time.perf_counter() - started

        def dcp_finish() -> None:
            if response:
                result = response.pop()
                (result.upload_completion if hasattr(result, "upload_completion") else result).result()
            for path in work.glob("dcp-async-*"):
                shutil.rmtree(path)

        def staged_before_step(*_: object) -> None:  # what DCP's async staging asks of the caller
            if response and hasattr(response[0], "staging_completion"):
                started = time.perf_counter()
                response[0].staging_completion.result()
                step_wait[0] = time.perf_counter() - started

        hook = state.optimizer.register_step_pre_hook(staged_before_step)
        timed = step_stall(train_step, dcp_save, lambda: step_wait[0], dcp_finish, args.repeats)
        hook.remove()
        row(f"{label}, blocked", timed["blocked"], nbytes, f"step + {timed['added']:.3f} s (alone {timed['step']:.3f} s)")
        if stager is not None:
            stager.close()

    print("\nsynchronous save to local disk, each into a new file, in rotating order "
          "(target >= 1.0 GB/s and >= 0.8x f.write+fsync):")
    flat = flatten(state.replicated_state_dict())
    sd = dcp_state()
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

    safetensors_file = str(work / "plain.safetensors")
    named = dict(zip(flat.names, flat.tensors))

    def safetensors_save() -> None:
        save_file(named, safetensors_file)
        with open(safetensors_file, "rb") as handle:  # save_file does not sync: the same durability as the others
            os.fsync(handle.fileno())

    contenders = {
        "plain": (lambda: fsync_write(plain_file, encode_chunks(flat)), remove(plain_file)),
        "ours": (saving(keep_all), lambda: [shutil.rmtree(info.path) for info in keep_all.list()]),
        "torch": (torch_save, remove(torch_file)),
        "safetensors": (safetensors_save, remove(safetensors_file)),
        "dcp": (lambda: dcp.save(sd, checkpoint_id=str(work / "dcp-sync"), no_dist=True), remove(str(work / "dcp-sync"))),
    }
    times = rotated_times(contenders, max(args.repeats, len(contenders)))
    t = {name: statistics.median(values) for name, values in times.items()}
    row("plain f.write + fsync of the same bytes", t["plain"], nbytes, spread(times["plain"]))
    row("elastic_ddp save (sha256-tree-4m + commit)", t["ours"], nbytes,
        f"{ratio_spread(times['plain'], times['ours'])} plain speed; {spread(times['ours'])}")
    row("torch.save + fsync", t["torch"], nbytes, spread(times["torch"]))
    row("safetensors save_file + fsync", t["safetensors"], nbytes, spread(times["safetensors"]))
    row("DCP save (sync)", t["dcp"], nbytes, spread(times["dcp"]))
    head_to_head(contenders["plain"], contenders["ours"], args.pairs, nbytes)
    shutil.rmtree(work / "ours-keep-all", ignore_errors=True)

    print("\nrestore, page cache warm for all, in rotating order (target <= 1.2x torch.load):")
    target_state = make_state(4096, 4)

    def forget_restored_state() -> None:  # a restoring job starts with no optimizer state (untimed)
        target_state.optimizer.state.clear()

    def torch_load_into_state() -> None:  # what a hand-written restore does: read, then load into model and optimizer
        loaded = torch.load(torch_file, weights_only=True)
        target_state.model.load_state_dict(loaded["model"])
        target_state.optimizer.load_state_dict(loaded["optim"])

    readers = {
        "torch": (lambda: torch.load(torch_file, weights_only=True), None),
        "torch-into-state": (torch_load_into_state, forget_restored_state),
        "safetensors": (lambda: load_file(safetensors_file, backend="pread"), None),
        "safetensors-mmap": (lambda: load_file(safetensors_file), None),
        "ours": (lambda: manager.restore(target_state), forget_restored_state),
    }
    cpu: dict[str, list[float]] = {}
    times = rotated_times(readers, max(args.repeats, len(readers)), cpu)
    t = {name: statistics.median(values) for name, values in times.items()}

    def cpu_note(name: str) -> str:
        return f"CPU {statistics.median(cpu[name]):.3f} s"

    row("torch.load(weights_only=True)", t["torch"], nbytes, f"{spread(times['torch'])}; {cpu_note('torch')}")
    row("safetensors load_file(backend='pread')", t["safetensors"], nbytes,
        f"{ratio_spread(times['safetensors'], times['torch'])} torch.load; {spread(times['safetensors'])}; "
        f"{cpu_note('safetensors')}")
    row("safetensors load_file (mmap: reads on first use)", t["safetensors-mmap"], nbytes, spread(times["safetensors-mmap"]))
    row("torch.load + load_state_dict into model and optimizer", t["torch-into-state"], nbytes,
        f"{ratio_spread(times['torch-into-state'], times['torch'])} torch.load; {spread(times['torch-into-state'])}; "
        f"{cpu_note('torch-into-state')}")
    row("elastic_ddp restore (verify sha256-tree-4m + load)", t["ours"], nbytes,
        f"{ratio_spread(times['ours'], times['torch'])} torch.load; "
        f"{ratio_spread(times['ours'], times['torch-into-state'])} torch.load + load_state_dict; "
        f"{spread(times['ours'])}; {cpu_note('ours')}")
    print("  (CPU: seconds of CPU time of the process, all threads; saves and restores hash pieces on helper threads)")


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

        # deletions behind the previous save are not part of this one
        t_ours = median_time(ours, args.repeats, setup=manager.wait_for_retention)
        row("elastic_ddp save to s3://", t_ours, nbytes, f"{t_pipe / t_ours:.2f}x pipe_file")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=12,
                        help="adjacent pairs of a plain write and our sync save, measured head to head (default 12)")
    parser.add_argument("--batch", type=int, default=16, help="batch of the training step that takes the save (default 16)")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    parser.add_argument("--no-local", action="store_true", help="skip the local parts (async, sync, restore)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP with no_dist=True says so on every save
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
