"""What a lost worker costs the survivors: the restart path against in-process re-formation, side by side.

How to run:
  .venv/bin/python benchmarks/inprocess.py [--repeats 3] [--build-s 0,10] [--steps 70] [--dies-at 60]
      [--parts fault,join,torchrun] [--join-build-s 10] [--overhead-rounds 6] [--torchrun-step-s 0.05]
      [--torchrun-build-s 0]

Three gloo workers on this machine train the same hand-written DDP loop on the runtime (an MLP, replicas in node
memory every step, no checkpoints) and meet on a TCPStore this script hosts (it outlives every worker, as etcd
does). Before the loop each worker spends ``--build-s`` seconds building (a sleep standing for a model build,
moving it to a device, or ``torch.compile``). Rank 2 kills itself (``os._exit``) at step ``--dies-at``; the time
it dies is the start of the fault. Then:

  restart     the survivors' step fails; each keeps its live state in node memory (the rescue) and exits
              peer-lost, as under the torchrun agent; this script then starts two new workers (a world of 2),
              which build, form a group, restore from the rescue and train on;
  in-process  the survivors agree on the next membership on the store (elastic_ddp.membership), re-form the
              group in their own process (Runtime.reform) and train on with their live state.

For each arm and build time: the fault to the survivors' next completed step (the later of the two), steps
redone, whether both survivors' process ids are those of the start, and the median step time before the fault
(the in-process arm's includes its membership watcher, which polls the store). Medians over the repeats with
min-max; arms alternate in each repeat, so drift of the machine hits both. Every worker of both arms is a fork
of one process that imported torch and the runtime already, as the fork server's are under torchrun
(``-m elastic_ddp.prefork``). This is not torchrun: the restart arm leaves out the agents' rendezvous round and
their polling (see the restart rows in docs/performance.md), so it is a lower bound of what the restart path
costs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic_ddp.prefork import PRELOAD  # noqa: E402  (imports no torch)
from elastic_ddp.resilience.exits import ExitReason  # noqa: E402

SAMPLES, BATCH = 960, 48
ARMS = ("restart", "in-process")


def worker(arm: str, rank: int, world_size: int, attempt: int, port: int, work: str, build_s: float, dies_at: int,
           steps: int) -> None:
    """One worker's run (a child of the warm fork server); writes ``report-<attempt>-<rank>.json`` to ``work``: its
    pid, the steps it trained with their end times and the step it went on from after the fault (or resumed from,
    after a restart); exits with the runtime's exit status."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic_ddp.config import CheckpointConfig
    from elastic_ddp.data import ElasticSampler
    from elastic_ddp.events import EventLog
    from elastic_ddp.membership import Generations
    from elastic_ddp.runtime import Runtime

    started_at = time.time()
    time.sleep(build_s)  # the build: a model moved to a device, compiled graphs
    torch.manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, 64), torch.randn(SAMPLES, 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60))
    generations = None
    if arm == "in-process":
        generations = Generations(store, f"worker{rank}", timeout_s=60)
        generations.first(rank, world_size)
        generations.start_watch()
    joining_at = time.time()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"elastic_ddp/membership-{attempt * 100}/", store),
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    joined_at = time.time()
    sampler = ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=0, rank=rank, world_size=world_size)
    events = EventLog(os.path.join(work, "logs"), run_id="inprocess-bench", rank=rank)
    config = CheckpointConfig(dir=os.path.join(work, "ckpt"), every=0, replica_every=1, replica_budget=0,
                              replica_dir=os.path.join(work, f"node{rank}"), save_final=False)  # a node each
    trained: list[tuple[int, float]] = []
    failed_at = agreed_at = reformed_at = wrapped_at = None
    after_fault: list[float] = []  # end times of the steps trained in the membership after the fault
    went_on_from = None
    with Runtime.for_loop(model=model, optimizer=optimizer, sampler=sampler, events=events, seed=1,
                          checkpoint=config) as runtime:
        step = runtime.restore()
        restored_at = time.time()
        if attempt:
            went_on_from = step
        ddp = DistributedDataParallel(model)
        while step < steps:
            if rank == 2 and step == dies_at:
                Path(work, "died").write_text(repr(time.time()))
                os._exit(9)
            try:
                plan = sampler.plan()
                (ids,) = sampler.local_micro_batches(plan)
                loss = (ddp(inputs[ids]) - targets[ids]).pow(2).sum() * sampler.loss_scale(plan)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                sampler.commit(plan)
                step += 1
                runtime.after_step(step)
                trained.append((step, time.time()))
                if went_on_from is not None:
                    after_fault.append(trained[-1][1])
            except RuntimeError:
                if generations is None:
                    raise  # the runtime keeps the live state and ends the process peer-lost
                optimizer.zero_grad()
                failed_at = time.time()
                agreed = generations.next("a collective failed")
                agreed_at = time.time()
                runtime.reform(store, rank=agreed.rank, world_size=agreed.world_size, generation=agreed.generation,
                               backend="gloo", device=torch.device("cpu"), timeout_s=60)
                reformed_at = time.time()
                ddp = DistributedDataParallel(model)
                wrapped_at = time.time()
                step = went_on_from = runtime.state.counters.step
    if generations is not None:
        generations.close()
    Path(work, f"report-{attempt}-{rank}.json").write_text(json.dumps(
        {"pid": os.getpid(), "trained": trained, "went_on_from": went_on_from, "started_at": started_at,
         "restored_at": restored_at, "ended_at": time.time(), "joining_at": joining_at, "joined_at": joined_at,
         "after_fault": after_fault, "failed_at": failed_at, "agreed_at": agreed_at, "reformed_at": reformed_at,
         "wrapped_at": wrapped_at}))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(runtime.exit_status or 0)


READY = "benchmark/members-reached-the-join-step"


def join_worker(role: str, rank: int, port: int, work: str, build_s: float, steps: int, join_after: int) -> None:
    """A member of two ("member", or "alone" without a membership watcher) or the newcomer that builds while
    they train and joins at a step boundary ("newcomer"); writes ``report-join-<rank>.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic_ddp.config import CheckpointConfig
    from elastic_ddp.data import ElasticSampler
    from elastic_ddp.distributed import form_membership_group
    from elastic_ddp.events import EventLog
    from elastic_ddp.membership import Generations
    from elastic_ddp.runtime import Runtime

    started_at = time.time()
    store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=120))
    generations = Generations(store, f"worker{rank}", timeout_s=120)
    if role == "newcomer":
        store.wait([READY])
        started_at = time.time()
        time.sleep(build_s)  # built while the members train
    torch.manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, 64), torch.randn(SAMPLES, 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if role == "newcomer":  # warm up (as a compiled model would be) before the members wait on it
        (model(inputs[:BATCH]) - targets[:BATCH]).pow(2).sum().backward()
        model.zero_grad(set_to_none=True)
    marks = {"built": time.time()}
    if role == "newcomer":
        membership = generations.join()
        marks["agreed"] = time.time()
        form_membership_group(store, rank=membership.rank, world_size=membership.world_size,
                              generation=membership.generation, backend="gloo", device=torch.device("cpu"),
                              timeout_s=120, abandoned="none")
    else:
        membership = generations.first(rank, 2)
        dist.init_process_group("gloo", store=dist.PrefixStore("elastic_ddp/membership-0/", store), rank=rank,
                                world_size=2, timeout=timedelta(seconds=120))
    if role != "alone":
        generations.start_watch()
    sampler = ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=0, rank=membership.rank,
                             world_size=membership.world_size)
    config = CheckpointConfig(dir=os.path.join(work, "ckpt"), every=0, replica_every=1, replica_budget=0,
                              replica_dir=os.path.join(work, f"node{rank}"), save_final=False)
    trained: list[tuple[int, float]] = []
    with Runtime.for_loop(model=model, optimizer=optimizer, sampler=sampler, seed=1, checkpoint=config,
                          events=EventLog(os.path.join(work, "logs"), run_id="join-bench", rank=rank)) as runtime:
        if role != "alone":
            runtime.follow(generations.news)
        marks["formed"] = time.time()
        step = runtime.join() if role == "newcomer" else runtime.restore()
        marks["restored"] = time.time()
        ddp = DistributedDataParallel(model)
        while step < steps:
            plan = sampler.plan()
            (ids,) = sampler.local_micro_batches(plan)
            loss = (ddp(inputs[ids]) - targets[ids]).pow(2).sum() * sampler.loss_scale(plan)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sampler.commit(plan)
            step += 1
            decision = runtime.after_step(step)
            trained.append((step, time.time()))
            if rank == 0 and step == join_after:
                store.set(READY, "1")
            if decision.membership and step < steps:
                agreed = generations.next("a worker joined")
                runtime.reform(store, rank=agreed.rank, world_size=agreed.world_size, generation=agreed.generation,
                               backend="gloo", device=torch.device("cpu"), timeout_s=120, joined=True)
                ddp = DistributedDataParallel(model)
    generations.close()
    Path(work, f"report-join-{rank}.json").write_text(json.dumps({"trained": trained, "started_at": started_at,
                                                                  "marks": marks}))
    if dist.is_initialized():
        dist.destroy_process_group()


def join_run(context: BaseContext, args: argparse.Namespace, build_s: float, roles: tuple[str, ...]) -> list[dict]:
    """One run of ``join_worker`` per role (rank = position); their reports."""
    import torch.distributed as dist

    work = Path(tempfile.mkdtemp(prefix="elastic-ddp-join-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    try:
        processes = [context.Process(target=join_worker, args=(role, rank, store.port, str(work), build_s,
                                                               args.join_steps, args.join_after))
                     for rank, role in enumerate(roles)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
        if any(process.exitcode != 0 for process in processes):
            raise SystemExit(f"join run {roles}: exits {[process.exitcode for process in processes]}")
        return [json.loads((work / f"report-join-{rank}.json").read_text()) for rank in range(len(roles))]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def step_times(trained: list[list[float]]) -> list[float]:
    return [b - a for (_, a), (_, b) in zip(trained, trained[1:], strict=False)]


def join_part(context: BaseContext, args: argparse.Namespace) -> None:
    """A newcomer that builds for --join-build-s joins two members: the members' longest step (its start to its
    end, the re-formation included) against their median step, the newcomer's start to its first step, steps
    redone; and, without a join, two members with their membership watcher against two without (step time)."""
    rows = []
    for repeat in range(args.repeats):
        members = join_run(context, args, args.join_build_s, ("member", "member", "newcomer"))
        first_step = members[2]["trained"][0][1] - members[2]["started_at"]
        gaps = [step_times(report["trained"]) for report in members[:2]]
        redone = max(len(r["trained"]) - len({step for step, _ in r["trained"]}) for r in members)
        rows.append({"longest_steps": max(max(g) / statistics.median(g) for g in gaps),
                     "longest_s": max(max(g) for g in gaps), "median_s": statistics.median(gaps[0]),
                     "newcomer_first_step_s": first_step, "redone": redone,
                     **{f"newcomer_{name}_s": at - members[2]["started_at"] for name, at in members[2]["marks"].items()}})
        print(f"join repeat {repeat + 1}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(f"\njoin of a newcomer that builds {args.join_build_s:g} s, {args.repeats} runs:")
    print(f"  members' longest step: {spread([r['longest_s'] * 1000 for r in rows], 1)} ms = "
          f"{spread([r['longest_steps'] for r in rows])} median steps (median step "
          f"{spread([r['median_s'] * 1000 for r in rows], 1)} ms)")
    print(f"  newcomer, start to first step: {spread([r['newcomer_first_step_s'] for r in rows])} s; steps redone "
          f"{spread([r['redone'] for r in rows], 0)}")
    ratios: list[float] = []
    for repeat in range(args.overhead_rounds):
        pair = {}
        for role in (("member", "alone") if repeat % 2 == 0 else ("alone", "member")):
            reports = join_run(context, args, 0, (role, role))
            pair[role] = statistics.median(step_times(reports[0]["trained"])[5:])
        ratios.append(pair["member"] / pair["alone"])
        print(f"overhead round {repeat + 1}: {json.dumps(pair)}", file=sys.stderr, flush=True)
    if not ratios:
        return
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"  step time with the membership watcher / without: {statistics.median(ratios):.3f}x "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, {len(ratios)} rounds)")


TORCHRUN_FIXTURE = REPO / "tests" / "fixtures" / "inprocess_torchrun.py"
TORCHRUN_STEPS = 80
TORCHRUN_DIES_AT = 10


def torchrun_part(args: argparse.Namespace) -> None:
    """Both arms under torchrun on the etcd-v3 handler, warm workers (``-m elastic_ddp.prefork``): two one-worker
    nodes train tests/fixtures/inprocess_torchrun.py with the same command line but for ``--rdzv-conf``; node 1's
    worker exits at step 10. restart: both agents start new workers and re-form (node 0's worker keeps its state
    in node memory for its successor); in-process (``in_process=true``): node 0's worker goes on alone in its
    process, and node 1's agent restarts its worker, which joins node 0's at a step boundary (its longest step
    after the fault, the join included, is reported)."""
    from tests.fixtures.etcd_proc import EtcdServer, find_etcd_binary

    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="elastic-ddp-inprocess-torchrun-") as tmp:
        etcd = EtcdServer.create(find_etcd_binary(), Path(tmp) / "etcd")
        etcd.start()
        try:
            for repeat in range(args.repeats):
                for arm in ARMS if repeat % 2 == 0 else tuple(reversed(ARMS)):
                    result = one_torchrun(etcd.endpoint, Path(tmp) / f"{arm}-{repeat}", arm, args)
                    results[arm].append(result)
                    print(f"torchrun repeat {repeat + 1}, {arm}: {json.dumps(result)}", file=sys.stderr, flush=True)
        finally:
            etcd.stop()
    print(f"\nunder torchrun (etcd-v3, prefork), kill of node 1's worker, {args.torchrun_step_s * 1000:g} ms steps, "
          f"a build of {args.torchrun_build_s:g} s, {args.repeats} runs each:")
    print("| arm | fault → survivor's next step (s) | steps redone | survivor's pid kept | survivor's longest step "
          "after the fault (s) |")
    print("|---|---|---|---|---|")
    for arm in ARMS:
        runs = results[arm]
        print(f"| {arm} | {spread([run['next_step_s'] for run in runs])} | {spread([run['redone'] for run in runs], 0)} "
              f"| {sum(run['pid_kept'] for run in runs)}/{len(runs)} | {spread([run['longest_step_s'] for run in runs])} |")


def one_torchrun(endpoint: str, work: Path, arm: str, args: argparse.Namespace) -> dict:
    work.mkdir(parents=True)
    conf = "last_call_timeout=1,join_timeout=120,read_timeout=30" + (",in_process=true" if arm == "in-process" else "")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ELASTIC_DDP_TEST_DIES=f"1:{TORCHRUN_DIES_AT}", ELASTIC_DDP_TEST_STEP_S=str(args.torchrun_step_s),
               ELASTIC_DDP_TEST_BUILD_S=str(args.torchrun_build_s),
               ELASTIC_DDP_TEST_STEPS=str(TORCHRUN_STEPS))  # long enough for node 1's restarted worker to join
    run_id = uuid.uuid4().hex[:8]
    agents = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                   "--max-restarts=3", "--monitor-interval=0.1", "--rdzv-backend=etcd-v3",
                   f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf}",
                   "--local-addr=127.0.0.1", "-m", "elastic_ddp.prefork", str(TORCHRUN_FIXTURE), str(work)]
        with open(work / f"agent-{node}.log", "wb") as log:
            agents.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True,
                                           env=dict(env, ELASTIC_DDP_REPLICA_DIR=str(work / f"node{node}"))))
    try:
        for agent in agents:
            agent.wait(timeout=300)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    if agents[0].returncode != 0:
        raise SystemExit(f"torchrun {arm}: node 0's agent exited {agents[0].returncode}; see {work}/agent-0.log")
    died_at = float((work / "died").read_text())
    (report,) = [json.loads(path.read_text()) for path in work.glob("rank-0-*.json")]
    pids = (work / "pids-0.txt").read_text().split()
    steps = [step for step, _ in report["trained"]]
    if len(pids) == 1:  # in-process: the steps after the fault are those the lost worker did not reach
        first_step, first_at = next((step, at) for step, at in report["trained"] if step > TORCHRUN_DIES_AT)
        redone = len(steps) - len(set(steps))
    else:  # restarted: the report is the new worker's, every step of it after the fault
        first_step, first_at = report["trained"][0]
        redone = TORCHRUN_DIES_AT - (first_step - 1)
    after = [at for step, at in report["trained"] if step >= first_step]
    longest = max((later - earlier for earlier, later in zip(after, after[1:])), default=0.0)
    return {"next_step_s": first_at - died_at, "redone": redone, "pid_kept": len(pids) == 1, "longest_step_s": longest}


def start(context: BaseContext, arm: str, rank: int, world_size: int, attempt: int, port: int, work: Path,
          args: argparse.Namespace, build_s: float) -> BaseProcess:
    process = context.Process(target=worker, args=(arm, rank, world_size, attempt, port, str(work), build_s,
                                                   args.dies_at, args.steps))
    process.start()
    return process


def finish(process: BaseProcess, work: Path, attempt: int, rank: int, timeout: float) -> tuple[int | None, dict | None]:
    process.join(timeout)
    report = work / f"report-{attempt}-{rank}.json"
    return process.exitcode, (json.loads(report.read_text()) if report.exists() else None)


def one_run(context: BaseContext, arm: str, build_s: float, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    work = Path(tempfile.mkdtemp(prefix="elastic-ddp-inprocess-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    try:
        first = [start(context, arm, rank, 3, 0, store.port, work, args, build_s) for rank in range(3)]
        ends = [finish(process, work, 0, rank, 300 + 2 * build_s) for rank, process in enumerate(first)]
        died_at = float((work / "died").read_text())
        expected = ExitReason.PEER_LOST.status if arm == "restart" else 0
        if [status for status, _ in ends] != [expected, expected, 9] or any(r is None for _, r in ends[:2]):
            raise SystemExit(f"{arm} arm: the workers' exits were {[status for status, _ in ends]} (see their log)")
        survivors = [report for _, report in ends[:2]]
        if arm == "restart":
            second = [start(context, arm, rank, 2, 1, store.port, work, args, build_s) for rank in range(2)]
            ends = [finish(process, work, 1, rank, 300 + 2 * build_s) for rank, process in enumerate(second)]
            if [status for status, _ in ends] != [0, 0]:
                raise SystemExit(f"restart arm: the restarted workers' exits were {[status for status, _ in ends]}")
            after = [report for _, report in ends]
            traces = [a["trained"] + b["trained"] for a, b in zip(survivors, after, strict=False)]
        else:
            after = survivors
            traces = [report["trained"] for report in survivors]
        pids = [report["pid"] for report in after]
        next_step = max(report["after_fault"][0] for report in after) - died_at
        redone = max(len(trace) - len({step for step, _ in trace}) for trace in traces)
        before = sorted(b - a for report in survivors for (_, a), (_, b) in
                        zip(report["trained"], report["trained"][1:], strict=False) if b < died_at)
        phases = {"survivors_ended": max(report["ended_at"] for report in survivors) - died_at,
                  "restarted": min(report["started_at"] for report in after) - died_at,
                  "joining": max(report["joining_at"] for report in after) - died_at,
                  "joined": max(report["joined_at"] for report in after) - died_at,
                  "restored": max(report["restored_at"] for report in after) - died_at} if arm == "restart" else {
                      name: max(report[f"{name}_at"] for report in after) - died_at
                      for name in ("failed", "agreed", "reformed", "wrapped")}
        return {"next_step_s": next_step, "redone": redone, **phases,
                "pids_kept": pids == [process.pid for process in first[:2]],
                "step_s": statistics.median(before[2:]) if len(before) > 2 else float("nan")}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-s", default="0,10", help="comma-separated build times to run (seconds)")
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--dies-at", type=int, default=60)
    parser.add_argument("--parts", default="fault,join,torchrun",
                        help="fault (a lost worker), join (a newcomer; overhead), torchrun (a lost worker, torchrun)")
    parser.add_argument("--torchrun-step-s", type=float, default=0.05)
    parser.add_argument("--torchrun-build-s", type=float, default=0.0, help="each worker's build time (seconds)")
    parser.add_argument("--join-build-s", type=float, default=10.0)
    parser.add_argument("--join-steps", type=int, default=300)
    parser.add_argument("--join-after", type=int, default=20)
    parser.add_argument("--overhead-rounds", type=int, default=6)
    args = parser.parse_args()
    if args.repeats < 1 or not 2 < args.dies_at < args.steps:
        parser.error("need --repeats >= 1 and 2 < --dies-at < --steps")
    builds = [float(value) for value in args.build_s.split(",")]
    # every worker is a fork of one process that imported torch and the runtime already (as the fork server
    # does under torchrun), so neither arm pays the imports
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", *PRELOAD, "elastic_ddp.membership"])
    parts = set(args.parts.split(","))
    if not parts <= {"fault", "join", "torchrun"}:
        parser.error(f"--parts: unknown part(s) {sorted(parts - {'fault', 'join', 'torchrun'})}")
    if "fault" in parts:
        fault_part(context, args, builds)
    if "join" in parts:
        join_part(context, args)
    if "torchrun" in parts:
        torchrun_part(args)


def fault_part(context: BaseContext, args: argparse.Namespace, builds: list[float]) -> None:
    results: dict[tuple[str, float], list[dict]] = {}
    for repeat in range(args.repeats):
        for build_s in builds:
            for arm in ARMS if repeat % 2 == 0 else reversed(ARMS):
                result = one_run(context, arm, build_s, args)
                results.setdefault((arm, build_s), []).append(result)
                print(f"repeat {repeat + 1}, build {build_s:g} s, {arm}: {json.dumps(result)}", file=sys.stderr,
                      flush=True)
    print("| build (s) | arm | fault → survivors' next step (s) | steps redone | survivors' pids kept | step before (ms) |")
    print("|---|---|---|---|---|---|")
    for build_s in builds:
        for arm in ARMS:
            runs = results[(arm, build_s)]
            print(f"| {build_s:g} | {arm} | {spread([run['next_step_s'] for run in runs])} | "
                  f"{spread([run['redone'] for run in runs], 0)} | {sum(run['pids_kept'] for run in runs)}/{len(runs)} | "
                  f"{spread([1000 * run['step_s'] for run in runs], 1)} |")
    for build_s in builds:
        restart, inproc = results[("restart", build_s)], results[("in-process", build_s)]
        ratio = [b["step_s"] / a["step_s"] for a, b in zip(restart, inproc, strict=False)]
        faster = statistics.median(b["next_step_s"] for b in inproc) / statistics.median(a["next_step_s"] for a in restart)
        print(f"build {build_s:g} s: next step in-process/restart {faster:.3f}x; "
              f"step time before the fault in-process/restart {spread(ratio, 3)}x")


if __name__ == "__main__":
    main()
