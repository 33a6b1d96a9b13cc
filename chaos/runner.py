"""Run one scenario: services, simulated nodes, faults on schedule, facts for the verifier.

:func:`run_scenario` is the whole flow::

    reference = reference_run(...)           # cached clean run of the same job
    with services (etcd, S3 endpoint + proxy, spot metadata) and a LocalCluster:
        start the first nodes
        every tick: observe (newest step, world size, unfinished saves) -> fire due faults
                    -> run due follow-ups (SIGCONT, etcd back...) -> progress on stderr
        until every node exited (or only frozen ones remain after 'done'), or the deadline
    collect facts (events.jsonl, agent logs, metrics.jsonl, commits, final checkpoint) -> checks -> report

Every process it starts is stopped on every exit path (``try/finally`` and an ``ExitStack``;
Ctrl-C included): nodes by process group (``LocalCluster.close``), etcd and moto by pid.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import random
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from chaos.cluster import JobSpec, LocalCluster, Node
from chaos.etcd import EtcdCluster, EtcdServer, start_etcd
from chaos.faults import (
    START,
    ChaosEnv,
    CheckpointStore,
    CrashWorker,
    Fault,
    FollowUp,
    Observation,
    Previous,
    SpotServer,
    make_faults,
)
from chaos.netns import Fabric
from chaos.s3 import BUCKET, StorageProxy, client_env, start_on_free_port, storage_options
from chaos.scenario import ETCD_CONF, RDZV_CONF, Scenario
from chaos.verify import (
    NOT_REACHED,
    REFERENCE_TIMEOUT_S,
    NodeOutcome,
    ReferenceFacts,
    RunFacts,
    VerifyError,
    compare_weights,
    final_weights,
    job_events,
    parse_agent_log,
    parse_metrics,
    read_checkpoint,
    read_ledger_facts,
    reference_run,
    write_data,
)
from elastic_ddp.events import Event, parse_events, read_events

logger = logging.getLogger(__name__)

TICK_S = 0.02
"""How often the loop looks at the job: fast enough to catch a local checkpoint save in flight."""
SCAN_EVERY_S = {"local": 0.02, "s3": 0.5}
"""How often the checkpoint root is listed (S3 listings are requests to the one-at-a-time endpoint)."""
NODE_ENV = {"LOGLEVEL": "INFO"}
"""torchrun's own INFO lines (failures seen, new nodes, rendezvous rounds) in each node's log."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Where a run keeps its files, and how it reports progress."""

    workdir: Path
    """Node logs, metrics, local checkpoints and service data; must not exist yet or be empty."""
    cache_dir: Path
    """Reference runs, reused across runs of the same job."""
    progress: TextIO | None = field(default_factory=lambda: sys.stderr)
    """Where the progress line goes; None: nowhere."""


# -- services ---------------------------------------------------------------------------


@dataclass
class Services:
    """What the job relies on besides its nodes, started for the scenario."""

    rdzv_endpoint: str = ""
    checkpoint_uri: str = ""
    checkpoint_args: list[str] = field(default_factory=list)
    node_env: dict[str, str] = field(default_factory=dict)
    store_options: dict[str, Any] | None = None
    """fsspec options with which the runner reads the checkpoint root directly (not through the proxy)."""
    etcd: EtcdServer | EtcdCluster | None = None
    proxy: StorageProxy | None = None
    moto_endpoint: str = ""
    data_uri: str = ""
    """Where the job's dataset was written (``job.data_write``), read by the nodes through the proxy."""
    spot: SpotServer | None = None
    fabric: Fabric | None = None


def start_services(scenario: Scenario, workdir: Path, stack: ExitStack) -> Services:
    """etcd, the S3 endpoint and its proxy, the spot metadata server: as the scenario needs them.
    Each is registered on ``stack`` for shutdown as soon as it started."""
    services = Services(checkpoint_uri=str(workdir / "ckpt"))
    cluster = scenario.cluster
    if cluster.network == "namespaces":
        services.fabric = Fabric()
        stack.callback(services.fabric.close)  # the last to go: after every process in its namespaces
        services.fabric.create()
    if cluster.etcd != "none":
        services.etcd = start_etcd(cluster.etcd, workdir, stack, fabric=services.fabric)
        if cluster.rdzv_backend == "etcd-v3":
            services.rdzv_endpoint = services.etcd.endpoint
    if cluster.checkpoint == "s3":
        _start_s3(services, scenario.name, workdir, stack)
        if scenario.job.data_write:  # straight to moto, not through the proxy: the faults are for the job
            services.data_uri = f"{services.checkpoint_uri}-data"
            write_data(scenario.job, services.data_uri, {**os.environ, **client_env(services.moto_endpoint)},
                       scenario.timeout_s)
    if any(fault.kind == "spot-notice" for fault in scenario.faults):
        services.spot = SpotServer(services.fabric.add_host("md") if services.fabric else None).start()
        stack.callback(services.spot.close)
    return services


def _start_s3(services: Services, name: str, workdir: Path, stack: ExitStack) -> None:
    moto = start_on_free_port(workdir / "moto.log", stack=stack)
    proxy = StorageProxy(moto.port, services.fabric.add_host("s3") if services.fabric else None).start()
    stack.callback(proxy.close)
    services.proxy = proxy
    services.checkpoint_uri = f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"
    services.checkpoint_args = ["--checkpoint-storage-options", json.dumps({"endpoint_url": proxy.endpoint})]
    services.node_env = client_env(proxy.endpoint)
    services.store_options = storage_options(moto.endpoint)
    services.moto_endpoint = moto.endpoint


# -- the job ------------------------------------------------------------------------------


def job_spec(scenario: Scenario, services: Services, workdir: Path) -> JobSpec:
    """What every node runs: the scenario's job plus the flags the runner owns."""
    job, cluster = scenario.job, scenario.cluster
    args = [*job.args, "--max-steps", str(job.max_steps), "--checkpoint-every", str(job.checkpoint_every),
            "--checkpoint-dir", services.checkpoint_uri, *services.checkpoint_args,
            "--log-dir", str(workdir / "logs"), "--log-every", "1",
            *([job.data_uri_flag, services.data_uri] if services.data_uri else [])]
    return JobSpec(
        script=job.script, args=args, nnodes=cluster.nodes, nproc_per_node=cluster.nproc_per_node,
        rdzv_backend=cluster.rdzv_backend, rdzv_endpoint=services.rdzv_endpoint,
        rdzv_conf={**(ETCD_CONF if cluster.rdzv_backend == "etcd-v3" else RDZV_CONF),
                   **({"in_process": "true"} if cluster.in_process else {})},
        run_id=scenario.name, max_restarts=cluster.max_restarts, env={**NODE_ENV, **services.node_env},
        prefork=cluster.prefork,
    )


class Tail:
    """A file that others append lines to, read incrementally: the complete lines added since the last poll."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


class MetricsTail:
    """Rank 0's ``metrics.jsonl`` and every rank's ``events.jsonl``, read incrementally: the newest step and
    world size, and whether a rank finished the job (its ``done`` event)."""

    def __init__(self, log_dir: Path) -> None:
        self.metrics = Tail(log_dir / "metrics.jsonl")
        self.events = Tail(log_dir / "events.jsonl")
        self.step = 0
        self.world_size = 0
        self.done = False

    def poll(self) -> None:
        for record in parse_metrics(self.metrics.new_lines()):
            self.step = max(self.step, record.step)
            self.world_size = record.world_size
        records, _ = parse_events(self.events.new_lines())  # the verifier reports invalid lines
        self.done = self.done or any(record["event"] == Event.DONE for record in records)


class ProgressLine:
    """Elapsed time, step, world size and faults fired, on one stderr line (a new line every 10 s when
    stderr is not a terminal)."""

    def __init__(self, stream: TextIO | None, max_steps: int, faults: int) -> None:
        self.stream = stream
        self.max_steps = max_steps
        self.faults = faults
        self.tty = bool(stream is not None and stream.isatty())
        self.last = 0.0
        self.note = ""

    def update(self, elapsed: float, step: int, world: int, fired: int, force: bool = False) -> None:
        if self.stream is None or (not force and elapsed - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = elapsed
        line = (f"[chaos] {elapsed:6.1f} s | step {step}/{self.max_steps} | world {world} | "
                f"faults {fired}/{self.faults}{' | ' + self.note if self.note else ''}")
        self.stream.write(f"\r{line[:150]:150}" if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")


class Schedule:
    """Follow-ups due at monotonic times (a heap; ties keep their order)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Fault, FollowUp]] = []
        self.counter = itertools.count()

    def add(self, now: float, fault: Fault, follow_up: FollowUp) -> None:
        heapq.heappush(self.heap, (now + follow_up.delay_s, next(self.counter), fault, follow_up))

    def due(self, now: float) -> list[tuple[Fault, FollowUp]]:
        ready = []
        while self.heap and self.heap[0][0] <= now:
            _, _, fault, follow_up = heapq.heappop(self.heap)
            ready.append((fault, follow_up))
        return ready


class ScenarioRun:
    """One run of a scenario on a started cluster: the event loop and its bookkeeping."""

    def __init__(self, scenario: Scenario, cluster: LocalCluster, services: Services, workdir: Path,
                 progress: TextIO | None) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.services = services
        self.faults = make_faults(scenario.faults)
        self.store = CheckpointStore(services.checkpoint_uri, services.store_options)
        self.env = ChaosEnv(cluster=cluster, rng=random.Random(scenario.seed), min_nodes=scenario.cluster.min_nodes,
                            add_node=self.add_node, store=self.store, etcd=services.etcd, proxy=services.proxy,
                            spot=services.spot, fabric=services.fabric)
        self.metrics = MetricsTail(workdir / "logs")
        self.schedule = Schedule()
        self.progress = ProgressLine(progress, scenario.job.max_steps, len(self.faults))
        self.unfinished: frozenset[int] = frozenset()
        self.scanned_at = -1.0
        self.scan_every = SCAN_EVERY_S[scenario.cluster.checkpoint]
        self.started = 0.0
        self.started_wall = 0.0
        self.timed_out = False
        self.running_at_end: set[str] = set()

    def add_node(self, env: dict[str, str] | None = None) -> Node:
        """Start one more node (with its own spot-notice URL when the scenario sends notices)."""
        name = f"node{len(self.cluster.nodes)}"
        args = self.services.spot.node_args(name) if self.services.spot else []
        return self.cluster.add_node(args, env)

    def start(self) -> None:
        crash_env: dict[str, str] = {}
        for fault in self.faults:
            if isinstance(fault, CrashWorker):
                faults = [value for value in (crash_env.get("ELASTIC_DDP_FAULT"), fault.env()["ELASTIC_DDP_FAULT"]) if value]
                crash_env["ELASTIC_DDP_FAULT"] = ",".join(faults)
        self.started, self.started_wall = time.monotonic(), time.time()
        for _ in range(self.scenario.cluster.start_nodes):
            self.add_node(crash_env)

    def loop(self) -> None:
        """Fire faults on schedule until the job ended or the deadline passed."""
        deadline = self.started + self.scenario.timeout_s
        while True:
            now = time.monotonic()
            observation = self.observe(now)
            self.fire_due(observation, now)
            self.run_follow_ups(now)
            self.progress.update(now - self.started, self.metrics.step, self.metrics.world_size, self.fired_count())
            if self.finished():
                break
            if now > deadline:
                self.timed_out = True
                logger.error("scenario %s: deadline of %.0f s passed at step %d", self.scenario.name,
                             self.scenario.timeout_s, self.metrics.step)
                break
            time.sleep(TICK_S)
        self.progress.update(time.monotonic() - self.started, self.metrics.step, self.metrics.world_size,
                             self.fired_count(), force=True)
        self.progress.close()
        self.running_at_end = {node.name for node in self.cluster.nodes if node.running}
        for fault in self.faults:
            if not fault.record.fired and not fault.record.skipped:
                fault.record.skipped = NOT_REACHED

    def observe(self, now: float) -> Observation:
        self.metrics.poll()
        if now - self.scanned_at >= self.scan_every:
            self.scanned_at = now
            self.unfinished = self._scan()
        return Observation(now - self.started, self.metrics.step, self.metrics.world_size, self.unfinished)

    def _scan(self) -> frozenset[int]:
        try:
            return self.store.scan()
        except OSError as exc:  # a listing racing retention's removal; the next scan sees the settled state
            logger.debug("checkpoint scan failed: %s", exc)
            return self.unfinished

    def fire_due(self, observation: Observation, now: float) -> None:
        previous: Previous | None = START
        for fault in self.faults:
            if fault.due(observation, previous):
                fired = fault.fire(self.env)
                fault.fired = Previous(now - self.started, observation.step)
                self.progress.note = f"{fault.record.label} -> {fault.record.target or '-'}"
                for follow_up in fired.follow_ups:
                    self.schedule.add(now, fault, follow_up)
            previous = fault.fired

    def run_follow_ups(self, now: float) -> None:
        for fault, follow_up in self.schedule.due(now):
            line = follow_up.action()
            if follow_up.ends_fault:
                fault.record.ended_at = time.time()
            if line:
                fault.record.detail += f"; {line}"
                logger.info("fault %s: %s", fault.record.label, line)

    def fired_count(self) -> int:
        return sum(fault.record.fired for fault in self.faults)

    def finished(self) -> bool:
        """Every node exited, or the job is done and only nodes chaos froze still exist."""
        running = [node for node in self.cluster.nodes if node.running]
        if not running and self.cluster.nodes:
            return True
        return self.metrics.done and all(node.name in self.env.frozen for node in running)

    # -- facts ----------------------------------------------------------------------------

    def facts(self, workdir: Path, reference: ReferenceFacts) -> RunFacts:
        """What the checks need; call after the nodes were stopped, while storage still runs."""
        ended = time.time()
        year = time.localtime(self.started_wall).tm_year
        records, problems = read_events(workdir / "logs")
        agents = {node.pid: node.name for node in self.cluster.nodes}
        events = sorted([*job_events(records, agents),
                         *(event for node in self.cluster.nodes for event in parse_agent_log(node.output(), node.name, year))],
                        key=lambda event: event.time)
        metrics_path = workdir / "logs" / "metrics.jsonl"
        steps = parse_metrics(metrics_path.read_text().splitlines()) if metrics_path.exists() else []
        self._scan()
        final, final_error = self._final_checkpoint()
        removed = {name: fault.record.label for fault in self.faults for name in fault.record.removes}
        trained = {event.node for event in events if event.kind == Event.PROCESS_GROUP_FORMED}
        nodes = [NodeOutcome(node.name, None if node.name in self.running_at_end else node.returncode,
                             removed.get(node.name, ""), arrived_late=_arrived_late(node, trained))
                 for node in self.cluster.nodes]
        ended_at = max([step.time for step in steps] + [event.time for event in events if event.kind == Event.DONE],
                       default=ended)
        facts = RunFacts(scenario=self.scenario.name, max_steps=self.scenario.job.max_steps,
                         open_schedule=self.scenario.open_schedule, started_at=self.started_wall,
                         ended_at=ended_at, timed_out=self.timed_out, nodes=nodes,
                         faults=[fault.record for fault in self.faults], steps=steps, events=events,
                         commits=list(self.store.commits), final=final, final_error=final_error, reference=reference,
                         event_problems=problems, ledger=read_ledger_facts(workdir / "logs"),
                         in_process=self.scenario.cluster.in_process,
                         nproc_per_node=self.scenario.cluster.nproc_per_node)
        if final is not None and {step.world_size for step in steps} != {reference.world_size}:
            facts.weights = compare_weights(final_weights(self.services.checkpoint_uri, self.services.store_options),
                                            final_weights(reference.checkpoint_uri))
        return facts

    def _final_checkpoint(self) -> tuple[Any, str]:
        from elastic_ddp.errors import CheckpointError

        try:
            return read_checkpoint(self.services.checkpoint_uri, self.services.store_options), ""
        except (CheckpointError, VerifyError) as exc:
            return None, str(exc)


def run_scenario(scenario: Scenario, options: RunOptions) -> RunFacts:
    """Reference run (cached), then the scenario on a fresh cluster; returns the facts for the checks."""
    workdir = options.workdir
    if workdir.exists() and any(workdir.iterdir()):
        raise VerifyError(f"work directory {workdir} is not empty: every run needs a fresh one")
    workdir.mkdir(parents=True, exist_ok=True)
    # the clean run does the same steps without faults: the scenario's own time limit bounds it too
    reference = reference_run(scenario.job, scenario.cluster.start_world_size, options.cache_dir,
                              timeout_s=max(REFERENCE_TIMEOUT_S, scenario.timeout_s))
    with ExitStack() as stack:
        services = start_services(scenario, workdir, stack)
        cluster = LocalCluster(job_spec(scenario, services, workdir), workdir, services.fabric)
        run = ScenarioRun(scenario, cluster, services, workdir, options.progress)
        try:
            run.start()
            run.loop()
        finally:
            cluster.close()
        return run.facts(workdir, reference)


def _arrived_late(node: Node, trained: set[str]) -> bool:
    """The node's agent ended because the job had finished before it could join: it never formed a
    process group, and its agent failed with torch's ``RendezvousClosedError``."""
    return (node.name not in trained and node.returncode not in (0, None)
            and "RendezvousClosedError" in node.output())
