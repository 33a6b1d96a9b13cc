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
    N agents (threads in child processes of ``--agents-per-process``, each with its own handler; see
    ``tests/fixtures/rdzv_agents.py``) call ``next_rendezvous()`` at once with ``--nnodes=N``; the
    time from the start until every one has a rank. ``etcd-v3``: the handler
    :func:`elastic_ddp.rendezvous.create_rdzv_handler` builds, on one etcd, the agents of a process
    sharing one etcd client; ``c10d``: torch's ``C10dRendezvousBackend`` on one TCPStore (what
    ``--rdzv-backend=c10d`` builds). Both with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    ``c10d-lean``: the same c10d handler with torch's event naming made as cheap as the etcd-v3
    handler's (torch names every rendezvous event with two ``inspect.stack()`` calls, even when no
    event handler is set; the etcd-v3 handler skips that), so that the backends themselves are
    compared too. Then, in an elastic job of ``N-1:N+1`` formed beforehand: etcd's writes and CPU
    over ``--steady`` seconds of N nodes training, and ``--changes`` times a node joining and one
    leaving (etcd-v3; c10d-lean: one join), with etcd's writes from its ``/metrics``; and N agents
    forming on a 3-member etcd cluster, with and without its leader killed (``--cluster-agents``).

The figures, with their dates, commits and commands: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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
from tests.fixtures.etcd_proc import EtcdCluster, EtcdServer, find_etcd_binary, start_with_port_retries  # noqa: E402
from tests.fixtures.rdzv_agents import LEAN_C10D, Fleet, delta, etcd_counters  # noqa: E402

NODES = 2
HUNG_AFTER_S = 90.0
FOREVER_STEPS = 10**7  # the loops end the job themselves
SCALE_TIMEOUT_S = 600
"""join_timeout of the simulated agents; a rendezvous that takes longer is reported as not completed."""
SCALE_KEEP_ALIVE_S = 30
"""Heartbeat interval of the simulated c10d agents. Each c10d heartbeat is a compare-and-swap of the
whole state, competing with the joins; with torch's 5 s (dead after 3 missed, 15 s) a few hundred
agents on two cores miss their heartbeats, drop each other from the round and never finish."""
ETCD_KEEP_ALIVE_S = SCALE_KEEP_ALIVE_S
"""etcd-v3's agents heartbeat as c10d's do. An etcd-v3 heartbeat is a lease keep-alive, not a write, but each
costs its agent about 2 ms of CPU (a gRPC stream), and at 1,024 agents on two cores torch's 5 s would take a
quarter of the machine from the rendezvous being measured."""
LEADER_KILL_S = 0.5


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


@dataclass
class ScaleResult:
    """One backend at one agent count."""

    form_s: float | None = None
    """Seconds from the common start until every agent had its rank."""
    form_writes: float | None = None
    """etcd raft writes (proposals committed) while the round formed; etcd-v3 only."""
    form_rpcs: dict[str, float] | None = None
    form_bytes: float | None = None
    steady_writes_per_s: float | None = None
    steady_cpu: float | None = None
    """etcd's CPU seconds per second while the N nodes trained (heartbeats and polls only)."""
    join_s: list[float] = field(default_factory=list)
    """Each time a node joins the running job: its start -> every agent, it included, in the new round."""
    join_writes: list[float] = field(default_factory=list)
    leave_s: list[float] = field(default_factory=list)
    """Each time one node leaves (a preempted agent's exit): the leave -> every survivor in the new round."""
    leave_writes: list[float] = field(default_factory=list)
    change_cpu: list[tuple[float, float]] = field(default_factory=list)
    """Each join and each leave: CPU seconds the agents' processes and etcd used until all were in the new round."""
    note: str = ""


def scale_backend(backend: str, endpoint: str, count: int, per_process: int, steady_s: float,
                  etcd_pid: int | None, changes: int = 1) -> ScaleResult:
    """Form a job of ``count`` agents (``--nnodes=count``: it closes once all joined); then, as an elastic job
    (``--nnodes=count-1:count+1``), keep ``count`` nodes running ``steady_s`` seconds (etcd-v3: etcd's writes
    and CPU meanwhile), and ``changes`` times: add one node, then have one leave (etcd-v3)."""
    result = ScaleResult()
    keep_alive = SCALE_KEEP_ALIVE_S if backend != "etcd-v3" else ETCD_KEEP_ALIVE_S
    conf = {"join_timeout": str(SCALE_TIMEOUT_S), "last_call_timeout": "2", "keep_alive_interval": str(keep_alive),
            "read_timeout": str(SCALE_TIMEOUT_S // 2)}
    counted = backend == "etcd-v3"
    fleet = Fleet(backend, endpoint, "%s-%d-%s" % (backend, count, uuid.uuid4().hex[:6]), count, (count, count),
                  per_process=per_process, conf=conf)
    try:
        fleet.start()
        before = etcd_counters(endpoint) if counted else {}
        began = fleet.go()
        fleet.wait_for(lambda f: len(f.in_round(count, began)) == count, SCALE_TIMEOUT_S, "formation")
        result.form_s = max(done.time for done in fleet.in_round(count, began).values()) - began
        if counted:
            used = delta(etcd_counters(endpoint), before)
            result.form_writes = used["writes"]
            result.form_bytes = used["rx_bytes"] + used["tx_bytes"]
            result.form_rpcs = {key[4:]: value for key, value in used.items() if key.startswith("rpc:") and value}
    except (RuntimeError, TimeoutError) as exc:
        result.note = str(exc)
        print("    %s: %d agents did not form: %s" % (backend, count, exc), flush=True)
        return result
    finally:
        fleet.stop()
    run_id = "%s-%d-%s" % (backend, count, uuid.uuid4().hex[:6])
    nodes = (count - 1, count + 1)
    fleet = Fleet(backend, endpoint, run_id, count, nodes, per_process=per_process, conf=conf)
    joiners = [Fleet(backend, endpoint, run_id, 1, nodes, per_process=1, conf=conf, first_agent=count + index)
               for index in range(changes)]
    fleets = [fleet, *joiners]

    def all_in(size: int, since: float) -> Callable[[Fleet], bool]:
        return lambda _: sum(len(each.in_round(size, since)) for each in fleets) == size

    def last(size: int, since: float) -> float:
        return max(done.time for each in fleets for done in each.in_round(size, since).values())

    try:
        for each in fleets:
            each.start()
        began = fleet.go()
        fleet.wait_for(all_in(count, began), SCALE_TIMEOUT_S, "the elastic job's formation")
        if steady_s > 0 and counted:
            before = etcd_counters(endpoint)
            cpu = _cpu_seconds(etcd_pid)
            time.sleep(steady_s)  # the measurement window itself: N nodes training, heartbeating and polling
            result.steady_writes_per_s = delta(etcd_counters(endpoint), before)["writes"] / steady_s
            result.steady_cpu = (_cpu_seconds(etcd_pid) - cpu) / steady_s if etcd_pid else None
        for index, joiner in enumerate(joiners):
            before = etcd_counters(endpoint) if counted else {}
            cpu = (_fleet_cpu(fleets), _cpu_seconds(etcd_pid))
            joined = joiner.go()
            fleet.wait_for(all_in(count + 1, joined), SCALE_TIMEOUT_S, "join %d" % (index + 1))
            result.join_s.append(last(count + 1, joined) - joined)
            result.change_cpu.append((_fleet_cpu(fleets) - cpu[0], _cpu_seconds(etcd_pid) - cpu[1]))
            if not counted:
                break  # c10d: one join (its leave waits out torch's heartbeat rule, as a kill does)
            result.join_writes.append(delta(etcd_counters(endpoint), before)["writes"])
            before = etcd_counters(endpoint)
            cpu = (_fleet_cpu(fleets), _cpu_seconds(etcd_pid))
            left = fleet.leave(index)
            fleet.wait_for(all_in(count, left), SCALE_TIMEOUT_S, "the re-formation after leave %d" % (index + 1))
            result.leave_s.append(last(count, left) - left)
            result.change_cpu.append((_fleet_cpu(fleets) - cpu[0], _cpu_seconds(etcd_pid) - cpu[1]))
            result.leave_writes.append(delta(etcd_counters(endpoint), before)["writes"])
    except (RuntimeError, TimeoutError) as exc:
        result.note = str(exc)
        print("    %s at %d agents did not complete: %s" % (backend, count, exc), flush=True)
    finally:
        for each in fleets:
            each.stop()
    return result


def _fleet_cpu(fleets: list[Fleet]) -> float:
    """CPU seconds the fleets' agent processes have used."""
    return sum(_cpu_seconds(proc.pid) for each in fleets for proc in each.procs if proc.poll() is None)


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


SCALE_LOOPS = ("etcd-v3", LEAN_C10D, "c10d")


def scale(agent_counts: list[int], endpoint: str, etcd_pid: int | None, per_process: int, steady_s: float,
          loops: tuple[str, ...] = SCALE_LOOPS, c10d_max: int = 1 << 30, changes: int = 1) -> dict[int, dict[str, ScaleResult]]:
    """Each count in each loop, one after the other (c10d: a TCPStore in this process per count)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    results: dict[int, dict[str, ScaleResult]] = {}
    for count in agent_counts:
        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=SCALE_TIMEOUT_S))
        store = "127.0.0.1:%d" % server.port
        results[count] = {}
        for loop in loops:
            if loop != "etcd-v3" and count > c10d_max:
                continue
            results[count][loop] = scale_backend(loop, endpoint if loop == "etcd-v3" else store, count,
                                                 per_process, steady_s, etcd_pid, changes)
            print("  %4d agents, %s: %s" % (count, loop, results[count][loop]), flush=True)
        del server
    return results


def scale_cluster(count: int, per_process: int, workdir: Path, kill_leader: bool) -> tuple[float | None, str]:
    """``count`` agents form one round on a fresh 3-member etcd cluster (the leader killed ``LEADER_KILL_S``
    after the start, with ``kill_leader``). Returns the formation time and what the check found: every agent
    in one round, with distinct ranks 0..count-1 (none admitted twice, none lost)."""
    cluster = start_with_port_retries(lambda attempt: EtcdCluster.create(
        find_etcd_binary(), workdir / ("cluster-%d-%d-%d" % (count, kill_leader, attempt)), size=3))
    conf = {"join_timeout": str(SCALE_TIMEOUT_S), "last_call_timeout": "30", "read_timeout": str(SCALE_TIMEOUT_S // 2),
            "keep_alive_interval": str(ETCD_KEEP_ALIVE_S)}
    fleet = Fleet("etcd-v3", cluster.endpoint, "cluster-%d" % count, count, (count, count), per_process=per_process,
                  conf=conf)
    try:
        fleet.start()
        began = fleet.go()
        if kill_leader:
            time.sleep(LEADER_KILL_S)  # "mid-formation": the scenario's moment, not a wait for a condition
            cluster.leader().kill()
        fleet.wait_for(lambda f: len(f.in_round(count, began)) == count, SCALE_TIMEOUT_S, "formation")
        ends = fleet.in_round(count, began)
        ranks = sorted(done.rank for done in ends.values())
        rounds = {done.round for done in ends.values()}
        dones = [done for done in fleet.done if done.time >= began]
        verdict = "ok" if ranks == list(range(count)) and len(rounds) == 1 and len(dones) == count else (
            "ranks %s..., rounds %s, %d completions" % (ranks[:5], sorted(rounds), len(dones)))
        return max(done.time for done in ends.values()) - began, verdict
    except (RuntimeError, TimeoutError) as exc:
        return None, str(exc)
    finally:
        fleet.stop()
        cluster.stop()


def _seconds(value: float | None) -> str:
    return "-" if value is None else "%.2f s" % value


def _number(value: float | None) -> str:
    return "-" if value is None else "%.0f" % value


def report_scale(results: dict[int, dict[str, ScaleResult]], per_process: int, steady_s: float) -> None:
    print("\nrendezvous of N agents (threads, %d per process, each the real handler; --nnodes=N, keep_alive_interval %d s "
          "etcd-v3 / %d s c10d): seconds until all have a rank" % (per_process, ETCD_KEEP_ALIVE_S, SCALE_KEEP_ALIVE_S))
    print("  %6s %10s %10s %7s %10s %7s" % ("agents", "etcd-v3", LEAN_C10D, "ratio", "c10d", "ratio"))
    for count, by_loop in results.items():
        etcd, lean, c10d = (by_loop.get(loop, ScaleResult()).form_s for loop in SCALE_LOOPS)
        print("  %6d %10s %10s %7s %10s %7s" % (count, _seconds(etcd), _seconds(lean), _ratio(etcd, lean),
                                                 _seconds(c10d), _ratio(etcd, c10d)))
    print("\netcd-v3 at each N: etcd writes (raft proposals) and client bytes of the formation; then, in a job of "
          "--nnodes=N-1:N+1, a node joining (its start -> all N+1 in the new round) and one leaving (-> the N others), "
          "each time: median (min-max) of the times, median of the writes")
    print("  %6s %12s %8s %10s %20s %7s %20s %7s %13s %12s" % (
        "agents", "form writes", "per N", "form MB", "join", "writes", "leave", "writes", "steady wr/s", "etcd cpu"))
    for count, by_loop in results.items():
        etcd_result = by_loop.get("etcd-v3")
        if etcd_result is None:
            continue
        r = etcd_result
        print("  %6d %12s %8s %10s %20s %7s %20s %7s %13s %12s" % (
            count, _number(r.form_writes), "%.2f" % (r.form_writes / count) if r.form_writes else "-",
            "%.2f" % (r.form_bytes / 1e6) if r.form_bytes else "-", _spread(r.join_s), _number(_median(r.join_writes)),
            _spread(r.leave_s), _number(_median(r.leave_writes)),
            "%.2f" % r.steady_writes_per_s if r.steady_writes_per_s is not None else "-",
            "%.0f%%" % (100 * r.steady_cpu) if r.steady_cpu is not None else "-"))
    for count, by_loop in results.items():
        for loop, r in by_loop.items():
            if r.form_rpcs:
                print("  %s at %d: etcd RPCs while forming: %s" % (loop, count, ", ".join(
                    "%s %d" % (name, value) for name, value in sorted(r.form_rpcs.items()))))
            if r.join_s and loop != "etcd-v3":
                print("  %s at %d: a node joining -> all in the new round %s" % (loop, count, _spread(r.join_s)))
            if r.change_cpu:
                agents, etcd = (statistics.median(cpu[i] for cpu in r.change_cpu) for i in (0, 1))
                print("  %s at %d: CPU per join or leave until all were in the new round (median): agents %.2f s, "
                      "etcd %.2f s; %.2f s of wall time on %d cores at best" % (
                          loop, count, agents, etcd, (agents + etcd) / (os.cpu_count() or 1), os.cpu_count() or 1))
    if steady_s:
        print("  (steady: %d s of N nodes training: heartbeats every %d s and the agents' 0.1 s polls)"
              % (steady_s, ETCD_KEEP_ALIVE_S))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> str:
    """``median (min-max)`` seconds, or the one value, or ``-``."""
    if len(values) < 2:
        return _seconds(values[0] if values else None)
    return "%s (%.2f-%.2f)" % (_seconds(statistics.median(values)), min(values), max(values))


def _ratio(value: float | None, baseline: float | None) -> str:
    return "%.2fx" % (value / baseline) if value and baseline else "-"


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop etcd and the jobs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="restarts,scale", help="comma-separated: restarts, scale")
    parser.add_argument("--kills", type=int, default=30, help="kills in the etcd-v3 loop")
    parser.add_argument("--recovery-kills", type=int, default=10,
                        help="kills in the c10d fresh-store loop and the two prefork loops")
    parser.add_argument("--default-kills", type=int, default=10,
                        help="kills in the torch-default loop (a hung restart costs 90 s or more)")
    parser.add_argument("--agents", default="64,256,1024", help="agent counts for the scale part")
    parser.add_argument("--c10d-max-agents", type=int, default=1 << 30,
                        help="scale part: run the c10d loops only up to this many agents")
    parser.add_argument("--steady", type=float, default=60, help="scale part: seconds of steady state measured per count")
    parser.add_argument("--changes", type=int, default=3,
                        help="scale part: how many times a node joins, then one leaves, the running job of N")
    parser.add_argument("--cluster-agents", type=int, default=256,
                        help="scale part: agents forming on a 3-member etcd cluster, with and without a leader kill (0: skip)")
    parser.add_argument("--scale-loops", default=",".join(SCALE_LOOPS),
                        help="comma-separated loops of the scale part: %s" % ", ".join(SCALE_LOOPS))
    parser.add_argument("--agents-per-process", type=int, default=64, help="scale part: agents (threads) per process")
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
            cluster_results: list[tuple[bool, float | None, str]] = []
            if "restarts" in parts:
                restarts = restart_loops(args.kills, args.recovery_kills, args.default_kills, etcd.endpoint, Path(tmp),
                                         args.seed)
            if "scale" in parts:
                scale_results = scale([int(n) for n in args.agents.split(",")], etcd.endpoint, etcd.pid,
                                      args.agents_per_process, args.steady, tuple(args.scale_loops.split(",")),
                                      args.c10d_max_agents, args.changes)
                if args.cluster_agents:
                    for kill in (False, True):
                        took, verdict = scale_cluster(args.cluster_agents, args.agents_per_process, Path(tmp), kill)
                        cluster_results.append((kill, took, verdict))
                        print("  %d agents on a 3-member cluster%s: %s, %s" % (
                            args.cluster_agents, ", leader killed" if kill else "", _seconds(took), verdict), flush=True)
        finally:
            etcd.stop()
    if restarts:
        report_restarts(restarts)
    if scale_results:
        report_scale(scale_results, args.agents_per_process, args.steady)
        for kill, took, verdict in cluster_results:
            print("  %d agents on a 3-member etcd cluster%s: %s (%s)" % (
                args.cluster_agents, ", its leader killed %.1f s in" % LEADER_KILL_S if kill else "", _seconds(took), verdict))
    print("\ntotal %.1f min" % ((time.monotonic() - started) / 60))


if __name__ == "__main__":
    main()
