"""Rendezvous benchmarks: ``etcd-v3`` against torch's ``c10d``, side by side.

How to run (starts its own etcd and jobs on 127.0.0.1; stops everything it started)::

    .venv/bin/python benchmarks/rendezvous.py                          # all three parts
    .venv/bin/python benchmarks/rendezvous.py --parts scale --agents 16,64
    .venv/bin/python benchmarks/rendezvous.py --parts restarts --kills 10 --recovery-kills 5

Parts:

``restarts``
    A job of two one-worker nodes (the example trainer, gloo, checkpoint every 10 steps,
    ``last_call_timeout=1``) is hit by ``kill -9`` of a random worker, again and again; after
    each kill the next comes once the restarted attempt completed a step and committed a newer
    checkpoint. Five loops, in this order:

    - ``etcd-v3``: the agents' environment does not set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``
      (the handler's own default applies: a fresh worker store per attempt);
    - ``c10d fresh store``: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (what the launch scripts set);
    - ``etcd-v3 + prefork`` and ``c10d fresh store + prefork``: the same, workers started through
      ``-m elastic_ddp.prefork`` (a per-node fork server that imported torch once);
    - ``etcd-v3 + prefork, no store probe``: as ``etcd-v3 + prefork``, with the workers' wait for
      rank 0's store to listen turned off (``ELASTIC_DDP_STORE_PROBE=0``): torch's client backoff;
    - ``etcd-v3 + prefork, no reach check``: as ``etcd-v3 + prefork``, with ``--rdzv-conf
      reach_check=false``: what the rendezvous's reachability check costs each re-formation;
    - ``c10d torch default``: the variable unset, i.e. torch's shared agent store.

    Per kill: recovery time (kill -> first step completed by the new attempt, from the wall-clock
    ``time`` of rank 0's metrics.jsonl records) and whether the first restart worked (``ok``),
    needed further worker generations (``retried``), or completed no step within 90 s (``hung``;
    the harness then SIGKILLs the workers to go on), or whether the job died (``lost``: every agent
    exited, which ends that loop). Targets: etcd-v3 median recovery <= 1.1x
    c10d's and <= 5 s; 30 of 30 restarts ok.

``scale``
    N simulated agents (threads in this process, each with its own handler and connection) call
    ``next_rendezvous()`` at once with ``--nnodes=N``; the time from the start until every one
    has a rank. ``etcd-v3``: :func:`elastic_ddp.rendezvous.create_rdzv_handler` on one etcd;
    ``c10d``: torch's ``C10dRendezvousBackend`` on one TCPStore (what ``--rdzv-backend=c10d``
    builds). Both with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. Target: etcd-v3 <= 2x c10d at 64.
    ``c10d-lean``: the same c10d handler with torch's event naming made as cheap as the
    etcd-v3 handler's (torch names every rendezvous event with two ``inspect.stack()`` calls,
    even when no event handler is set; the etcd-v3 handler skips that), so that the backends
    themselves are compared too.

Measured on this machine (2 vCPUs, idle otherwise; torch 2.13 CPU; etcd 3.5.1), 2026-11-30,
``--parts restarts --kills 30 --recovery-kills 10 --default-kills 1`` (10.4 min)::

                                 kills  ok  recovery s: median / min / max   of which rendezvous
    etcd-v3                         30  30   8.53 / 7.65 /  9.62              1.76
    c10d fresh store                10  10   9.02 / 8.09 / 10.08              2.36
    etcd-v3 + prefork               10  10   1.87 / 1.73 /  2.44              1.35
    c10d fresh store + prefork      10  10   2.28 / 1.94 /  2.96              1.52
    c10d torch default               1   0   (hung; no step in 5 forced restarts of 90 s; stopped)

``--parts scale --agents 16,64,256`` (seconds until all agents have a rank; etcd-v3 / c10d /
c10d-lean)::

    16 agents:  1.31 / 1.29 / 1.30 s
    64 agents:  2.31 / 4.82 / 1.31 s (etcd-v3 was 9.0 s before its handler stopped naming
                unrecorded events with inspect.stack())
    256 agents: 38.6 / 49.5 / 7.55 s (etcd-v3 51.8 s in a run of its own; once, with the CPU
                shared with a test run, not within the 600 s join timeout)

etcd-v3 / c10d: 0.95x (0.82x with prefork). Without prefork most of a recovery is starting the
new workers (Python importing torch, the first optimizer importing ``torch._dynamo``: about
5 s on two shared cores); with it, the rendezvous is most of what is left.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chaos.cluster import LocalCluster, wait_for  # noqa: E402
from elastic_ddp.distributed import STORE_PROBE_ENV  # noqa: E402
from tests.fixtures.etcd_jobs import (  # noqa: E402
    AGENT_INFO,
    ETCD_CONF,
    FRESH_STORE_ENV,
    committed_step,
    job_args,
    kill_worker,
    make_job,
    rounds,
    wait_for_restart,
    worker_pids,
)
from tests.fixtures.etcd_proc import EtcdServer, find_etcd_binary, start_with_port_retries  # noqa: E402

NODES = 2
HUNG_AFTER_S = 90.0
FOREVER_STEPS = 10**7  # the loops end the job themselves
SCALE_TIMEOUT_S = 600
"""join_timeout of the simulated agents; a rendezvous that takes longer is reported as not completed."""
LEAN_C10D = "c10d-lean"
"""The scale part's third loop: c10d with torch's event naming made as cheap as etcd-v3's."""
SCALE_KEEP_ALIVE_S = 30
"""Heartbeat interval of the simulated agents. Every heartbeat is a compare-and-swap of the whole
state, competing with the joins; with torch's 5 s (dead after 3 missed, 15 s) a few hundred
agents in one process on two cores miss their heartbeats, drop each other from the round and
never finish, under either backend (seen at 64 agents on etcd-v3 before its one-call writes,
and at 256 on c10d)."""


# -- restarts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """One restart loop's setup."""

    label: str
    backend: str
    env: dict[str, str]
    unset: tuple[str, ...]
    prefork: bool = False
    conf: tuple[tuple[str, str], ...] = ()
    """``--rdzv-conf`` keys added to the tests' etcd-v3 settings."""


@dataclass(frozen=True)
class KillOutcome:
    """What one kill -9 led to."""

    recovery_s: float | None
    """Kill -> first step of a new attempt; ``None`` when none came within HUNG_AFTER_S."""
    rendezvous_s: float | None
    """Kill -> the re-rendezvous completed on every node (torchrun's "Rendezvous complete" lines);
    the rest of the recovery is starting the workers and their first step."""
    attempts: int
    """Complete worker generations started until one completed a step."""
    job_lost: bool = False
    """Every agent exited (e.g. out of restarts after hung attempts); the loop ends there."""

    @property
    def verdict(self) -> str:
        if self.job_lost:
            return "lost"
        if self.recovery_s is None:
            return "hung"
        return "ok" if self.attempts == 1 else "retried"


def run_loop(loop: Loop, kills: int, endpoint: str, workdir: Path, rng: random.Random) -> list[KillOutcome]:
    """``kills`` consecutive kill -9s of a random worker in one job; one outcome per kill."""
    job = make_job(workdir, job_args(workdir, FOREVER_STEPS, checkpoint_every=10), backend=loop.backend,
                   endpoint=endpoint, nnodes=str(NODES), nproc=1, max_restarts=3 * kills + 10,
                   env={**AGENT_INFO, **loop.env}, unset=loop.unset, prefork=loop.prefork,
                   conf={**ETCD_CONF, **dict(loop.conf)} if loop.conf else None)
    outcomes: list[KillOutcome] = []
    with job:
        job.start(NODES)
        wait_for(lambda: committed_step(workdir) > 0, 300, "%s: the first checkpoint" % loop.label)
        for index in range(kills):
            try:
                outcome, step = one_kill(job, workdir, rng)
            except RuntimeError as exc:  # every agent exited: nothing left to restart
                outcome, step = KillOutcome(None, None, 0, job_lost=True), 0
                print("  %-26s kill %2d/%d: job lost (%s)" % (loop.label, index + 1, kills, exc), flush=True)
                outcomes.append(outcome)
                break
            outcomes.append(outcome)
            print("  %-26s kill %2d/%d: %-7s %s" % (loop.label, index + 1, kills, outcome.verdict, _times(outcome)),
                  flush=True)
            wait_for(lambda: committed_step(workdir) >= step, 120, "a checkpoint of step %d" % step)
    return outcomes


def one_kill(job: LocalCluster, workdir: Path, rng: random.Random) -> tuple[KillOutcome, int]:
    """Kill a worker and wait for the job to train again; a hung restart is SIGKILLed until it does."""
    _, killed_at, old = kill_worker(job, rng)
    try:
        restart = wait_for_restart(job, workdir, killed_at, old, NODES, HUNG_AFTER_S)
    except TimeoutError:
        return KillOutcome(None, None, 0), unstick(job, workdir)
    return KillOutcome(restart.recovery_s, rendezvous_time(job, killed_at), restart.attempts), restart.step


def rendezvous_time(job: LocalCluster, killed_at: float) -> float | None:
    """Seconds from the kill until the last node completed its first rendezvous after it."""
    done = [min((completed for _, completed, _ in rounds(node) if completed > killed_at), default=None)
            for node in job.nodes]
    return None if None in done else max(done) - killed_at


def unstick(job: LocalCluster, workdir: Path) -> int:
    """SIGKILL every worker of a hung attempt until an attempt trains; the step it reached."""
    for _ in range(5):
        stuck = worker_pids(job)
        for pid in stuck:
            _kill_quietly(pid)
        try:
            return wait_for_restart(job, workdir, time.time(), stuck, NODES, HUNG_AFTER_S).step
        except TimeoutError:
            continue
    raise RuntimeError("the job did not train again after 5 forced restarts")


def _times(outcome: KillOutcome) -> str:
    if outcome.recovery_s is None:
        return ""
    rendezvous = "?" if outcome.rendezvous_s is None else "%.1f" % outcome.rendezvous_s
    return "recovered in %.1f s (rendezvous done after %s s)" % (outcome.recovery_s, rendezvous)


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def restart_loops(kills: int, recovery_kills: int, default_kills: int, endpoint: str, workdir: Path,
                  seed: int) -> dict[str, list[KillOutcome]]:
    loops = [
        (Loop("etcd-v3", "etcd-v3", {}, (FRESH_STORE_ENV,)), kills),
        (Loop("c10d fresh store", "c10d", {FRESH_STORE_ENV: "1"}, ()), recovery_kills),
        (Loop("etcd-v3 + prefork", "etcd-v3", {}, (FRESH_STORE_ENV,), prefork=True), recovery_kills),
        (Loop("etcd-v3 + prefork, no store probe", "etcd-v3", {STORE_PROBE_ENV: "0"}, (FRESH_STORE_ENV,), prefork=True),
         recovery_kills),
        (Loop("etcd-v3 + prefork, no reach check", "etcd-v3", {}, (FRESH_STORE_ENV,), prefork=True,
              conf=(("reach_check", "false"),)), recovery_kills),
        (Loop("c10d fresh store + prefork", "c10d", {FRESH_STORE_ENV: "1"}, (), prefork=True), recovery_kills),
        (Loop("c10d torch default", "c10d", {}, (FRESH_STORE_ENV,)), default_kills),
    ]
    results = {}
    for loop, count in loops:
        if count:
            results[loop.label] = run_loop(loop, count, endpoint if loop.backend == "etcd-v3" else "",
                                           workdir / loop.label.replace(" ", "-"), random.Random(seed))
    return results


def report_restarts(results: dict[str, list[KillOutcome]]) -> None:
    print("\nrestarts after kill -9 of a random worker (2 nodes x 1 worker, last_call_timeout=1)")
    print("  %-26s %5s %4s %8s %5s %5s  %-32s %s" % ("", "kills", "ok", "retried", "hung", "lost",
                                                    "recovery s: median / min / max", "of which rendezvous: median"))
    for label, outcomes in results.items():
        good = [o for o in outcomes if o.verdict == "ok"]
        times = [o.recovery_s for o in good]
        rendezvous = [o.rendezvous_s for o in good if o.rendezvous_s is not None]
        verdicts = [o.verdict for o in outcomes]
        spread = "%.2f / %.2f / %.2f" % (statistics.median(times), min(times), max(times)) if times else "-"
        print("  %-26s %5d %4d %8d %5d %5d  %-32s %s" % (
            label, len(outcomes), verdicts.count("ok"), verdicts.count("retried"), verdicts.count("hung"),
            verdicts.count("lost"), spread,
            "%.2f" % statistics.median(rendezvous) if rendezvous else "-"))
    for suffix in ("", " + prefork"):
        etcd, c10d = (results.get(k + suffix) for k in ("etcd-v3", "c10d fresh store"))
        if etcd and c10d and _median_ok(etcd) and _median_ok(c10d):
            print("  etcd-v3%s / c10d fresh store%s median recovery: %.2fx"
                  % (suffix, suffix, _median_ok(etcd) / _median_ok(c10d)))


def _median_ok(outcomes: list[KillOutcome]) -> float | None:
    times = [o.recovery_s for o in outcomes if o.verdict == "ok"]
    return statistics.median(times) if times else None


# -- scale ----------------------------------------------------------------------------------


def scale_run(backend: str, endpoint: str, run_id: str, count: int, per_process: int) -> float:
    """Seconds from the common start until all ``count`` agents (threads in processes of
    ``per_process``) returned from ``next_rendezvous``."""
    sizes = [min(per_process, count - start) for start in range(0, count, per_process)]
    procs = [subprocess.Popen([sys.executable, __file__, "_agents", backend, endpoint, run_id, str(count), str(size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for size in sizes]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("an agent process failed to start (exit %s)" % proc.wait())
        began = time.time()
        _tell(procs, "go")
        lines = [proc.stdout.readline() for proc, size in zip(procs, sizes) for _ in range(size)]
        _tell(procs, "stop")  # only now may anyone close the rendezvous: the others must see it complete
        for proc in procs:
            proc.wait(timeout=SCALE_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finished = [float(line.split()[1]) for line in lines if line.startswith("done ")]
    errors = [line for line in lines if line.startswith("error ")]
    if errors or len(finished) != count:
        raise RuntimeError("%d of %d agents got no rank; first error: %s" % (count - len(finished), count,
                                                                           errors[0] if errors else "-"))
    return max(finished) - began


def _tell(procs: list[subprocess.Popen], word: str) -> None:
    for proc in procs:
        proc.stdin.write(word + "\n")
        proc.stdin.flush()


def agents_process(backend: str, endpoint: str, run_id: str, count: int, local: int) -> None:
    """(Child process) ``local`` agents of a ``count``-node rendezvous: build their handlers, print
    ``ready``, wait for ``go`` on stdin, rendezvous in threads and print ``done <wall time>`` (or
    ``error ...``) for each; shut the handlers down after ``stop``."""
    os.environ[FRESH_STORE_ENV] = "1"
    if backend == LEAN_C10D:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous

        dynamic_rendezvous.get_method_name = lambda depth=2: sys._getframe(depth).f_code.co_name
        backend = "c10d"
    handlers = [make_handler(backend, endpoint, run_id, count) for _ in range(local)]
    print("ready", flush=True)
    sys.stdin.readline()
    output = threading.Lock()

    def agent(handler) -> None:
        try:
            handler.next_rendezvous()
            line = "done %.6f" % time.time()
        except Exception as exc:  # the parent reports it
            line = "error %r" % exc
        with output:
            print(line, flush=True)

    _in_threads(agent, handlers)
    sys.stdin.readline()
    _in_threads(lambda handler: handler.shutdown(), handlers)


def _in_threads(function: Callable[[object], None], items: list) -> None:
    threads = [threading.Thread(target=function, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def make_handler(backend: str, endpoint: str, run_id: str, count: int):
    """A handler as torchrun builds it for ``--rdzv-backend=backend`` (c10d: a client of the TCPStore at ``endpoint``)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = {"join_timeout": str(SCALE_TIMEOUT_S), "last_call_timeout": "1", "keep_alive_interval": str(SCALE_KEEP_ALIVE_S)}
    if backend == "etcd-v3":
        from elastic_ddp.rendezvous import create_rdzv_handler

        params = RendezvousParameters(backend, endpoint, run_id, count, count, "127.0.0.1", read_timeout="60", **conf)
        return create_rdzv_handler(params)
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = endpoint.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=SCALE_TIMEOUT_S))
    params = RendezvousParameters(backend, endpoint, run_id, count, count, "127.0.0.1", **conf)
    return create_handler(store, C10dRendezvousBackend(store, run_id), params)


SCALE_LOOPS = ("c10d", "etcd-v3", LEAN_C10D)


def scale(agent_counts: list[int], endpoint: str, per_process: int, loops: tuple[str, ...] = SCALE_LOOPS
          ) -> dict[int, dict[str, float | None]]:
    """Each count in each loop; ``None`` where the rendezvous did not complete or the loop did not run."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    results: dict[int, dict[str, float | None]] = {}
    for count in agent_counts:
        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=SCALE_TIMEOUT_S))
        store = "127.0.0.1:%d" % server.port
        results[count] = {
            loop: _timed_or_none(lambda: scale_run(loop, endpoint if loop == "etcd-v3" else store,
                                                   "%s-%d" % (loop, count), count, per_process))
            if loop in loops else None
            for loop in SCALE_LOOPS
        }
        del server
        print("  %4d agents: %s" % (count, ", ".join("%s %s" % (k, _seconds(v)) for k, v in results[count].items())),
              flush=True)
    return results


def _timed_or_none(run: Callable[[], float]) -> float | None:
    try:
        return run()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print("    did not complete: %s" % exc, flush=True)
        return None


def _seconds(value: float | None) -> str:
    return "-" if value is None else "%.2f s" % value


def report_scale(results: dict[int, dict[str, float | None]], per_process: int) -> None:
    print("\nrendezvous of N agents at once (--nnodes=N, last_call_timeout=1, keep_alive_interval=%d; threads, %d per"
          " process): seconds until all have a rank" % (SCALE_KEEP_ALIVE_S, per_process))
    print("  %6s %9s %9s %7s %10s %7s" % ("agents", "etcd-v3", "c10d", "ratio", LEAN_C10D, "ratio"))
    for count, times in results.items():
        etcd, c10d, lean = times["etcd-v3"], times["c10d"], times[LEAN_C10D]
        print("  %6d %9s %9s %7s %10s %7s" % (count, _seconds(etcd), _seconds(c10d), _ratio(etcd, c10d),
                                                 _seconds(lean), _ratio(etcd, lean)))


def _ratio(value: float | None, baseline: float | None) -> str:
    return "%.2fx" % (value / baseline) if value and baseline else "-"


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop etcd and the jobs
    if sys.argv[1:2] == ["_agents"]:
        backend, endpoint, run_id, count, local = sys.argv[2:7]
        agents_process(backend, endpoint, run_id, int(count), int(local))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="restarts,scale", help="comma-separated: restarts, scale")
    parser.add_argument("--kills", type=int, default=30, help="kills in the etcd-v3 loop")
    parser.add_argument("--recovery-kills", type=int, default=10,
                        help="kills in the c10d fresh-store loop and the two prefork loops")
    parser.add_argument("--default-kills", type=int, default=10,
                        help="kills in the torch-default loop (a hung restart costs 90 s or more)")
    parser.add_argument("--agents", default="16,64,256", help="agent counts for the scale part")
    parser.add_argument("--scale-loops", default=",".join(SCALE_LOOPS),
                        help="comma-separated loops of the scale part: %s" % ", ".join(SCALE_LOOPS))
    parser.add_argument("--agents-per-process", type=int, default=32, help="scale part: agents (threads) per process")
    parser.add_argument("--seed", type=int, default=0, help="seed of the choice of worker to kill")
    parser.add_argument("--workdir", default="", help="keep the jobs' logs and checkpoints here (default: a temp dir)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-rdzv-") as tmp:
        tmp = args.workdir or tmp
        etcd = start_with_port_retries(lambda attempt: EtcdServer.create(find_etcd_binary(), Path(tmp) / ("etcd-%d" % attempt)))
        try:
            restarts = scale_results = None
            if "restarts" in parts:
                restarts = restart_loops(args.kills, args.recovery_kills, args.default_kills, etcd.endpoint, Path(tmp),
                                         args.seed)
            if "scale" in parts:
                scale_results = scale([int(n) for n in args.agents.split(",")], etcd.endpoint, args.agents_per_process,
                                      tuple(args.scale_loops.split(",")))
        finally:
            etcd.stop()
    if restarts:
        report_restarts(restarts)
    if scale_results:
        report_scale(scale_results, args.agents_per_process)
    print("\ntotal %.1f min" % ((time.monotonic() - started) / 60))


if __name__ == "__main__":
    main()
