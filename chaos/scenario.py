"""Chaos scenarios: a job, the cluster it runs on, and a schedule of faults, read from TOML.

A scenario file (see ``chaos/scenarios/*.toml``)::

    name = "kill-worker"
    description = "SIGKILL rank 1 at step 60; the agents restart the group from the last checkpoint"
    seed = 7                      # random targets are drawn from this seed
    timeout_s = 300               # the whole run, services and reference excluded
    open_schedule = false         # true: faults left when the job finishes are fine (churn until the end)

    [job]
    script = "examples/train.py"  # relative to the repository root, or absolute
    args = ["--optim-decay-steps", "40"]
    max_steps = 300
    checkpoint_every = 20
    # optional: a dataset on the run's S3 endpoint (needs checkpoint = "s3"); {uri} is where it goes
    data_write = ["examples/lm/shards.py", "{uri}"]
    data_uri_flag = "--data-shards-uri"

    [cluster]
    nodes = "1:2"                 # torchrun --nnodes (min:max)
    start_nodes = 2
    nproc_per_node = 1
    rdzv_backend = "etcd-v3"      # or "c10d"
    etcd = "embedded"             # "none", "embedded" (one member) or "cluster" (three members)
    checkpoint = "local"          # or "s3" (an embedded S3 endpoint behind a fault proxy)
    prefork = true                # workers start from a fork server (default); false for hang-* faults
    in_process = false            # the etcd-v3 handler's in-process mode: survivors keep their processes

    [[faults]]
    kind = "kill-worker"
    at_step = 60                  # and/or at_s = 12.5; after_s = 5 or after_steps = 50 (after the
                                  # previous fault); world_size = 2; during_save = true (all must hold)
    target = "rank:1"             # "rank:N", "node:N", "random" or "newest", as the kind allows

:func:`load_scenario` parses and validates; every problem found is reported at once, each
naming its key (``faults[2].target: ...``). The runner owns some flags of the job
(:data:`RUNNER_FLAGS`): a scenario that sets one is refused rather than silently overridden. Every
scenario's job also writes the sample ledger (:data:`LEDGER_FLAG` is added to its ``args``), which the
verifier's ``sample-ledger`` check reads.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project declares tomli for Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"

RUNNER_FLAGS = ("--max-steps", "--checkpoint-dir", "--checkpoint-every", "--checkpoint-keep", "--log-dir",
                "--log-every", "--checkpoint-storage-options")
"""Flags the runner sets for every job (from ``[job]`` keys or its own work directory). A script the runner
trains takes them all, and ``--resilience-spot-notice-url`` and ``--resilience-spot-poll-interval-s`` when the
scenario sends spot notices; it writes ``events.jsonl`` (every rank) and ``metrics.jsonl`` (rank 0: ``step``,
``time``, ``world_size``, ``loss``, ``step_time_s``) to ``--log-dir``. Both examples/train.py (the trainer
path) and examples/byo_loop/train.py (the library path) do."""

RDZV_CONF = {"join_timeout": "60", "last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
"""Rendezvous settings of every job: a dead node is noticed after 3 s, a round closes 1 s after
the minimum is reached (as in the integration tests)."""

ETCD_CONF = {**RDZV_CONF, "read_timeout": "30"}
"""``etcd-v3`` adds ``read_timeout``: one etcd call rides out an outage this long."""


class ChaosError(Exception):
    """Base of every error the chaos package raises."""


class ScenarioError(ChaosError):
    """A scenario file is missing, unreadable or invalid; the message lists every problem by key."""


@dataclass(frozen=True, kw_only=True)
class FaultKind:
    """What a fault kind needs from its scenario."""

    targets: tuple[str, ...]
    """Target forms it accepts (``rank``, ``node``, ``random``, ``newest``); empty: it takes none."""
    needs_duration: bool = False
    """It undoes itself after ``duration_s`` seconds, which must then be > 0."""
    needs: str = ""
    """What the cluster must provide: ``etcd``, ``etcd-cluster``, ``s3`` or ``namespaces``."""


WORKER_TARGETS = ("rank", "random")
NODE_TARGETS = ("node", "random", "newest")

FAULT_KINDS: dict[str, FaultKind] = {
    "kill-worker": FaultKind(targets=WORKER_TARGETS),
    "crash-worker": FaultKind(targets=("rank",)),
    "kill-node": FaultKind(targets=NODE_TARGETS),
    "preempt-node": FaultKind(targets=NODE_TARGETS),
    "spot-notice": FaultKind(targets=NODE_TARGETS),
    "hang-worker": FaultKind(targets=WORKER_TARGETS),
    "hang-node": FaultKind(targets=NODE_TARGETS),
    "add-node": FaultKind(targets=()),
    "remove-node": FaultKind(targets=NODE_TARGETS),
    "restart-etcd": FaultKind(targets=(), needs_duration=True, needs="etcd"),
    "kill-etcd-leader": FaultKind(targets=(), needs="etcd-cluster"),
    "storage-outage": FaultKind(targets=(), needs_duration=True, needs="s3"),
    "slow-storage": FaultKind(targets=(), needs_duration=True, needs="s3"),
    "corrupt-checkpoint": FaultKind(targets=()),
    "kill-during-save": FaultKind(targets=NODE_TARGETS),
    "partition": FaultKind(targets=NODE_TARGETS, needs="namespaces"),
    "packet-loss": FaultKind(targets=NODE_TARGETS, needs="namespaces"),
    "bandwidth": FaultKind(targets=NODE_TARGETS, needs="namespaces"),
    "latency": FaultKind(targets=NODE_TARGETS, needs="namespaces"),
    "heal": FaultKind(targets=(), needs="namespaces"),
}
"""Every fault a scenario may schedule (implemented in :mod:`chaos.faults`)."""


@dataclass(frozen=True, kw_only=True)
class Trigger:
    """When a fault fires: once every condition given holds."""

    at_s: float | None = None
    """Seconds after the first node started."""
    at_step: int | None = None
    """The job logged this step (or a later one)."""
    after_s: float | None = None
    """Seconds after the previous fault of the schedule fired (the first fault: after the start)."""
    after_steps: int | None = None
    """Steps beyond the newest one logged when the previous fault fired (so the job recovered from it)."""
    world_size: int | None = None
    """The newest step was logged at this world size (e.g. a node that was added has joined)."""
    during_save: bool = False
    """Then, during the next checkpoint save: a new ``step-*`` directory without a manifest appeared."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """Whom a fault hits: ``rank:N`` (a worker by global rank), ``node:N`` (the N-th node started),
    ``random`` (drawn with the scenario's seed among running ones) or ``newest`` (the newest running node)."""

    form: str = ""
    index: int = 0

    def __str__(self) -> str:
        return f"{self.form}:{self.index}" if self.form in ("rank", "node") else self.form or "-"


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One scheduled fault."""

    kind: str
    trigger: Trigger
    target: Target = field(default_factory=Target)
    duration_s: float = 0.0
    """hang-*: SIGCONT after this long (0: stays stopped); restart-etcd, storage-outage, slow-storage:
    how long the service is away or slow; kill-etcd-leader: restart the member after this long (0: never)."""
    delay_s: float = 0.2
    """slow-storage: seconds added to every chunk a client sends."""
    grace_s: float = 30.0
    """preempt-node, remove-node, spot-notice: SIGKILL the node if it still runs this long after the notice."""
    mode: str = "flip"
    """corrupt-checkpoint: ``flip`` one byte or ``truncate`` a data file of the newest committed checkpoint."""
    peers: str = "all"
    """partition, packet-loss, latency: the other side of the target node's links: ``nodes`` (every other node),
    ``etcd`` (every etcd member), ``storage`` (the S3 endpoint), ``all`` (all of them) or ``node:N``."""
    direction: str = "both"
    """partition, packet-loss, latency: ``both``; ``out`` (only what the target sends is dropped) or ``in`` (only
    what it receives)."""
    percent: float = 5.0
    """packet-loss: the share of packets dropped at random, in percent."""
    rate_mbit: float = 10.0
    """bandwidth: the target node's link rate each way, in Mbit/s."""
    delay_ms: float = 50.0
    """latency: milliseconds added to every packet (one way) between the target node and its peers."""
    jitter_ms: float = 0.0
    """latency: each packet's delay is drawn uniformly from delay_ms ± jitter_ms."""
    label: str = ""
    """A name for reports; defaults to the kind and its position."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """What every node runs."""

    script: str
    """Absolute path of the training script."""
    args: tuple[str, ...] = ()
    """Its arguments, without the flags in :data:`RUNNER_FLAGS`."""
    max_steps: int
    checkpoint_every: int
    data_write: tuple[str, ...] = ()
    """A command (a script relative to the repository, then its arguments) that writes the job's dataset to the URI
    it is given in place of ``{uri}``: the runner writes it once to the run's S3 endpoint (the job reads it through
    the storage proxy, so storage faults hit its reads) and once to a local directory for the reference run."""
    data_uri_flag: str = ""
    """The job's flag that takes the dataset's URI (e.g. ``--data-shards-uri``). Every node also gets a shard cache
    of its own, empty when it starts (``ELASTIC_DDP_SHARD_CACHE_DIR``)."""

    def data_command(self, uri: str) -> list[str]:
        """``data_write`` run by this interpreter, with ``{uri}`` replaced."""
        script, *args = self.data_write
        path = Path(script) if Path(script).is_absolute() else REPO / script
        return [sys.executable, str(path), *(arg.replace("{uri}", uri) for arg in args)]


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The simulated cluster and the services it relies on."""

    nodes: str
    """``torchrun --nnodes``: ``MIN:MAX`` or ``N``."""
    start_nodes: int
    nproc_per_node: int = 1
    rdzv_backend: str = "etcd-v3"
    etcd: str = "embedded"
    """``none``, ``embedded`` (one member) or ``cluster`` (three members)."""
    checkpoint: str = "local"
    """``local`` (a directory in the run's work directory) or ``s3`` (embedded endpoint)."""
    max_restarts: int = 30
    """``torchrun --max-restarts``: a worker that fails or stops early (a failure, a departure) consumes one of its
    node's; a join, which restarts the groups without a failure, consumes none."""
    prefork: bool = True
    """Workers start through :mod:`elastic_ddp.prefork`: restarts skip importing torch."""
    in_process: bool = False
    """``--rdzv-conf in_process=true`` (etcd-v3 only): the workers keep their processes through a membership change,
    a restarted or added node's workers join the running membership, and the verifier checks that every worker
    no fault hit kept its process (``survivors-kept-processes``)."""
    network: str = "loopback"
    """``loopback``: everything on 127.0.0.1. ``namespaces``: each node, etcd member and the S3 endpoint in a
    network namespace of its own on one bridge (:mod:`chaos.netns`; needs root, ``ip`` and ``nft``), which the
    network faults (partition, packet-loss, bandwidth, heal) act on."""

    @property
    def min_nodes(self) -> int:
        return int(self.nodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nodes.split(":")[-1])

    @property
    def start_world_size(self) -> int:
        return self.start_nodes * self.nproc_per_node


@dataclass(frozen=True, kw_only=True)
class GoodputFigures:
    """``[goodput]``: figures a report prints next to the run's own goodput (shares of the wall time, 0 to 1),
    over the whole run and after start-up (from the first step on)."""

    before: float | None = None
    """Measured before the work this scenario tracks (``before_note`` says which)."""
    before_after_startup: float | None = None
    before_note: str = ""
    target: float | None = None
    """The run meets it when its goodput is at least this."""
    target_after_startup: float | None = None


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A validated scenario."""

    name: str
    description: str = ""
    seed: int = 0
    timeout_s: float = 300.0
    """Deadline for the job, from the first node's start to the last node's exit."""
    open_schedule: bool = False
    """The fault schedule runs longer than the job (churn for the job's whole life): faults still waiting for
    their trigger when the job finishes are reported as not reached instead of failing the run."""
    job: JobConfig
    cluster: ClusterConfig
    faults: tuple[FaultSpec, ...] = ()
    goodput: GoodputFigures = GoodputFigures()
    path: str = ""


# -- lookup and loading ------------------------------------------------------------


def scenario_names() -> list[str]:
    """Names of the scenarios in the library (``chaos/scenarios``)."""
    return sorted(path.stem for path in SCENARIO_DIR.glob("*.toml"))


def resolve(name_or_path: str) -> Path:
    """A scenario file: an existing path, or a name from the library."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = SCENARIO_DIR / f"{name_or_path}.toml"
    if named.is_file():
        return named
    raise ScenarioError(f"no scenario {name_or_path!r}: not a file, and not one of {', '.join(scenario_names())}")


def load_scenario(name_or_path: str) -> Scenario:
    """Read, parse and validate a scenario file (a path or a library name)."""
    path = resolve(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    return parse_scenario(data, str(path))


def parse_scenario(data: dict[str, Any], where: str = "<scenario>") -> Scenario:
    """Validate a parsed TOML document; raise ScenarioError listing every problem by key."""
    problems: list[str] = []
    reader = _Reader(data, "", problems)
    name = reader.string("name", required=True)
    description = reader.string("description")
    seed = reader.integer("seed", default=0)
    timeout_s = reader.number("timeout_s", default=300.0, minimum=1.0)
    open_schedule = reader.boolean("open_schedule", default=False)
    job = _parse_job(reader.table("job"), problems)
    cluster = _parse_cluster(reader.table("cluster"), problems)
    faults = tuple(_parse_fault(item, index, problems) for index, item in enumerate(reader.tables("faults")))
    goodput = _parse_goodput(reader.table("goodput", required=False))
    reader.reject_unknown()
    if not problems:
        problems += fault_problems(faults, cluster)
        if job.data_write and cluster.checkpoint != "s3":
            problems.append("job.data_write: needs cluster.checkpoint = 's3' (the dataset lives on the S3 endpoint)")
    if problems:
        raise ScenarioError(f"{where}: invalid scenario:\n  " + "\n  ".join(problems))
    return Scenario(name=name, description=description, seed=seed, timeout_s=timeout_s, open_schedule=open_schedule, job=job,
                    cluster=cluster, faults=faults, goodput=goodput, path=where)


def _parse_goodput(reader: _Reader) -> GoodputFigures:
    def share(name: str) -> float | None:
        value = reader.number(name, minimum=0.0)
        if value is not None and value > 1.0:
            reader.problem(name, f"is a share of the wall time (0 to 1), got {value}")
        return value

    figures = GoodputFigures(before=share("before"), before_after_startup=share("before_after_startup"),
                             before_note=reader.string("before_note"), target=share("target"),
                             target_after_startup=share("target_after_startup"))
    reader.reject_unknown()
    return figures


LEDGER_FLAG = "--log-sample-ledger"
"""Added to every scenario's ``job.args``: rank 0 writes ``samples.jsonl`` (elastic_ddp.events.SAMPLES_FILE) to
``--log-dir``, one line per committed step with its sample ids. :func:`with_script` drops the scenario's args
with the rest: give the flag in ``--script-args`` when the other script takes it (without a ledger the check is
skipped)."""


def with_script(scenario: Scenario, script: str, args: Sequence[str] = ()) -> Scenario:
    """The scenario training another script: its faults and cluster, ``script`` with ``args`` instead of the
    job's own script and arguments (which belong to that script). The checks are the same."""
    problems: list[str] = []
    path = Path(script) if Path(script).is_absolute() else REPO / script
    if not path.is_file():
        problems.append(f"--script: {script!r} is not a file (relative paths start at {REPO})")
    problems += [f"--script-args: {arg.split('=', 1)[0]} is set by the runner" for arg in args
                 if arg.split("=", 1)[0] in RUNNER_FLAGS]
    if problems:
        raise ScenarioError("; ".join(problems))
    return dataclasses.replace(scenario, job=dataclasses.replace(scenario.job, script=str(path), args=tuple(args)))


def in_process(scenario: Scenario) -> Scenario:
    """The scenario with the etcd-v3 handler's in-process mode (``run --in-process``).

    Raises:
        ScenarioError: its rendezvous is not etcd-v3's.
    """
    if scenario.cluster.rdzv_backend != "etcd-v3":
        raise ScenarioError(f"--in-process: {scenario.name} uses rdzv_backend {scenario.cluster.rdzv_backend!r}; "
                            "the in-process mode is the etcd-v3 handler's")
    return dataclasses.replace(scenario, cluster=dataclasses.replace(scenario.cluster, in_process=True))


def _parse_job(reader: _Reader, problems: list[str]) -> JobConfig:
    script = reader.string("script", required=True)
    args = tuple(reader.strings("args"))
    for arg in args:
        if arg.split("=", 1)[0] in RUNNER_FLAGS:
            problems.append(f"job.args: {arg.split('=', 1)[0]} is set by the runner (use job.max_steps, "
                            "job.checkpoint_every or the cluster table)")
    path = Path(script) if Path(script).is_absolute() else REPO / script
    if script and not path.is_file():
        problems.append(f"job.script: {script!r} is not a file (relative paths start at {REPO})")
    if LEDGER_FLAG not in args and "--no-" + LEDGER_FLAG[2:] not in args:  # a scenario may turn it off
        args += (LEDGER_FLAG,)
    data_write, data_uri_flag = tuple(reader.strings("data_write")), reader.string("data_uri_flag")
    if data_write or data_uri_flag:
        if not data_write or not data_uri_flag.startswith("--"):
            problems.append("job.data_write and job.data_uri_flag: give both (the writer command, the job's --flag)")
        elif "{uri}" not in data_write[1:]:
            problems.append("job.data_write: no argument is '{uri}' (where the runner has the dataset written)")
        elif not (Path(data_write[0]) if Path(data_write[0]).is_absolute() else REPO / data_write[0]).is_file():
            problems.append(f"job.data_write: {data_write[0]!r} is not a file (relative paths start at {REPO})")
        if data_uri_flag in args:
            problems.append(f"job.args: {data_uri_flag} is set by the runner (job.data_uri_flag)")
    job = JobConfig(script=str(path), args=args, max_steps=reader.integer("max_steps", required=True, minimum=1),
                    checkpoint_every=reader.integer("checkpoint_every", required=True, minimum=1),
                    data_write=data_write, data_uri_flag=data_uri_flag)
    reader.reject_unknown()
    return job


def _parse_cluster(reader: _Reader, problems: list[str]) -> ClusterConfig:
    nodes = reader.string("nodes", required=True)
    low, high = _node_range(nodes)
    if low is None:
        problems.append(f"cluster.nodes: {nodes!r} is not MIN:MAX or N with 1 <= MIN <= MAX")
        low = high = 1
    cluster = ClusterConfig(
        nodes=nodes,
        start_nodes=reader.integer("start_nodes", required=True, minimum=1),
        nproc_per_node=reader.integer("nproc_per_node", default=1, minimum=1),
        rdzv_backend=reader.choice("rdzv_backend", ("etcd-v3", "c10d"), "etcd-v3"),
        etcd=reader.choice("etcd", ("none", "embedded", "cluster"), "embedded"),
        checkpoint=reader.choice("checkpoint", ("local", "s3"), "local"),
        max_restarts=reader.integer("max_restarts", default=30, minimum=0),
        prefork=reader.boolean("prefork", default=True),
        in_process=reader.boolean("in_process", default=False),
        network=reader.choice("network", ("loopback", "namespaces"), "loopback"),
    )
    reader.reject_unknown()
    if not low <= cluster.start_nodes <= high:
        problems.append(f"cluster.start_nodes: {cluster.start_nodes} is outside nodes {nodes!r}")
    if cluster.in_process and cluster.rdzv_backend != "etcd-v3":
        problems.append("cluster.in_process: the in-process mode is the etcd-v3 handler's; set rdzv_backend = 'etcd-v3'")
    if cluster.rdzv_backend == "etcd-v3" and cluster.etcd == "none":
        problems.append("cluster.etcd: rdzv_backend 'etcd-v3' needs etcd = 'embedded' or 'cluster'")
    if cluster.network == "namespaces" and cluster.rdzv_backend != "etcd-v3":
        problems.append("cluster.network: 'namespaces' needs rdzv_backend = 'etcd-v3' (c10d's store dies with node0's agent)")
    if cluster.rdzv_backend == "c10d" and cluster.etcd != "none":
        problems.append(f"cluster.etcd: rdzv_backend 'c10d' does not use etcd; set etcd = 'none' (not {cluster.etcd!r})")
    return cluster


def _node_range(text: str) -> tuple[int | None, int]:
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(part.isdigit() for part in parts):
        return None, 0
    low, high = int(parts[0]), int(parts[-1])
    return (low, high) if 1 <= low <= high else (None, 0)


def _parse_fault(reader: _Reader, index: int, problems: list[str]) -> FaultSpec:
    kind = reader.choice("kind", tuple(FAULT_KINDS), "", required=True)
    trigger = Trigger(
        at_s=reader.number("at_s", minimum=0.0),
        at_step=reader.integer("at_step", minimum=1),
        after_s=reader.number("after_s", minimum=0.0),
        after_steps=reader.integer("after_steps", minimum=1),
        world_size=reader.integer("world_size", minimum=1),
        during_save=reader.boolean("during_save", default=kind == "kill-during-save"),
    )
    spec = FaultSpec(
        kind=kind,
        trigger=trigger,
        target=_parse_target(reader, FAULT_KINDS[kind].targets if kind else ()),
        duration_s=reader.number("duration_s", default=0.0, minimum=0.0),
        delay_s=reader.number("delay_s", default=0.2, minimum=0.001),
        grace_s=reader.number("grace_s", default=30.0, minimum=0.0),
        mode=reader.choice("mode", ("flip", "truncate"), "flip"),
        peers=_parse_peers(reader),
        direction=reader.choice("direction", ("both", "out", "in"), "both"),
        percent=reader.number("percent", default=5.0, minimum=0.01),
        rate_mbit=reader.number("rate_mbit", default=10.0, minimum=0.01),
        delay_ms=reader.number("delay_ms", default=50.0, minimum=0.0),
        jitter_ms=reader.number("jitter_ms", default=0.0, minimum=0.0),
        label=reader.string("label") or f"{index}:{kind}",
    )
    reader.reject_unknown()
    given = (trigger.at_s, trigger.at_step, trigger.after_s, trigger.after_steps, trigger.world_size)
    if kind and all(value is None for value in given) and not trigger.during_save:
        problems.append(f"faults[{index}]: give at least one trigger (at_s, at_step, after_s, after_steps, world_size "
                        "or during_save)")
    return spec


PEER_GROUPS = ("nodes", "etcd", "storage", "all")


def _parse_peers(reader: _Reader) -> str:
    text = reader.string("peers") or "all"
    form, _, number = text.partition(":")
    if text not in PEER_GROUPS and not (form == "node" and number.isdigit()):
        reader.problem("peers", f"{text!r} is not one of {', '.join(PEER_GROUPS)}, node:N")
        return "all"
    return text


def _parse_target(reader: _Reader, allowed: tuple[str, ...]) -> Target:
    text = reader.string("target")
    if not text:
        if allowed and allowed != ("rank",):
            return Target(form="random" if "random" in allowed else allowed[0])
        if allowed:
            reader.problem("target", "is required (rank:N)")
        return Target()
    if not allowed:
        reader.problem("target", "this fault kind takes no target")
        return Target()
    form, _, number = text.partition(":")
    if form not in allowed or (form in ("rank", "node")) != number.isdigit():
        forms = ", ".join(f"{name}:N" if name in ("rank", "node") else name for name in allowed)
        reader.problem("target", f"{text!r} is not one of {forms}")
        return Target()
    return Target(form=form, index=int(number) if number else 0)


def fault_problems(faults: tuple[FaultSpec, ...], cluster: ClusterConfig) -> list[str]:
    """Faults that the cluster cannot host, or that need a trigger or duration they lack."""
    problems = []
    for index, fault in enumerate(faults):
        kind = FAULT_KINDS[fault.kind]
        key = f"faults[{index}] ({fault.kind})"
        if kind.needs_duration and fault.duration_s <= 0:
            problems.append(f"{key}.duration_s: must be > 0")
        if kind.needs == "etcd" and cluster.rdzv_backend != "etcd-v3":
            problems.append(f"{key}: needs cluster.rdzv_backend = 'etcd-v3'")
        if kind.needs == "etcd-cluster" and (cluster.etcd != "cluster" or cluster.rdzv_backend != "etcd-v3"):
            problems.append(f"{key}: needs cluster.etcd = 'cluster' and rdzv_backend = 'etcd-v3'")
        if kind.needs == "s3" and cluster.checkpoint != "s3":
            problems.append(f"{key}: needs cluster.checkpoint = 's3'")
        if kind.needs == "namespaces" and cluster.network != "namespaces":
            problems.append(f"{key}: needs cluster.network = 'namespaces'")
        if fault.kind == "packet-loss" and fault.percent > 100:
            problems.append(f"{key}.percent: must be <= 100, got {fault.percent:g}")
        if fault.jitter_ms > fault.delay_ms:
            problems.append(f"{key}.jitter_ms: must be <= delay_ms ({fault.delay_ms:g}), got {fault.jitter_ms:g}")
        if fault.peers == "storage" and cluster.checkpoint != "s3":
            problems.append(f"{key}.peers: 'storage' needs cluster.checkpoint = 's3' (local checkpoints have no endpoint)")
        trigger = fault.trigger
        if fault.kind == "crash-worker" and (trigger.at_step is None or trigger != Trigger(at_step=trigger.at_step)):
            problems.append(f"{key}.at_step: crash-worker fires inside the job (ELASTIC_DDP_FAULT) at a step of "
                            "its first launch: give at_step alone")
        if fault.kind in ("hang-worker", "hang-node") and cluster.prefork:
            problems.append(f"{key}: SIGSTOP stops a prefork launcher, not its worker; set cluster.prefork = false")
        if fault.kind == "kill-during-save" and not fault.trigger.during_save:
            problems.append(f"{key}.during_save: kill-during-save always waits for a save; leave it true")
        most = cluster.max_nodes * cluster.nproc_per_node
        if trigger.world_size is not None and trigger.world_size > most:
            problems.append(f"{key}.world_size: {trigger.world_size} is more than the cluster's largest world size {most}")
        if fault.target.form == "node" and fault.target.index >= cluster.start_nodes + _added(faults):
            problems.append(f"{key}.target: node:{fault.target.index} is never started "
                            f"({cluster.start_nodes} start, {_added(faults)} added)")
    return problems


def _added(faults: tuple[FaultSpec, ...]) -> int:
    return sum(fault.kind == "add-node" for fault in faults)


# -- a typed reader over one TOML table that collects problems -------------------------


class _Reader:
    """Typed access to one TOML table; each problem is recorded with its full key."""

    def __init__(self, data: Any, prefix: str, problems: list[str]) -> None:
        self.data = data if isinstance(data, dict) else {}
        self.prefix = prefix
        self.problems = problems
        self.seen: set[str] = set()
        if not isinstance(data, dict):
            problems.append(f"{prefix.rstrip('.') or 'scenario'}: must be a table")

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def problem(self, name: str, message: str) -> None:
        self.problems.append(f"{self.key(name)}: {message}")

    def _get(self, name: str, required: bool) -> Any:
        self.seen.add(name)
        if name not in self.data:
            if required:
                self.problem(name, "is required")
            return None
        return self.data[name]

    def string(self, name: str, required: bool = False) -> str:
        value = self._get(name, required)
        if value is None:
            return ""
        if not isinstance(value, str):
            self.problem(name, f"must be a string, got {value!r}")
            return ""
        return value

    def strings(self, name: str) -> list[str]:
        value = self._get(name, False)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            self.problem(name, "must be a list of strings")
            return []
        return value

    def integer(self, name: str, default: int | None = None, required: bool = False,
                minimum: int | None = None) -> Any:
        value = self._get(name, required)
        if value is None:
            return default if default is not None or not required else 0
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(name, f"must be an integer, got {value!r}")
            return default or 0
        if minimum is not None and value < minimum:
            self.problem(name, f"must be >= {minimum}, got {value}")
        return value

    def number(self, name: str, default: float | None = None, minimum: float | None = None) -> Any:
        value = self._get(name, False)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problem(name, f"must be a number, got {value!r}")
            return default
        if minimum is not None and value < minimum:
            self.problem(name, f"must be >= {minimum}, got {value}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problem(name, f"must be true or false, got {value!r}")
            return default
        return value

    def choice(self, name: str, allowed: tuple[str, ...], default: str, required: bool = False) -> str:
        value = self.string(name, required)
        if not value:
            return default
        if value not in allowed:
            self.problem(name, f"{value!r} is not one of {', '.join(allowed)}")
            return default
        return value

    def table(self, name: str, required: bool = True) -> _Reader:
        return _Reader(self._get(name, required) or {}, f"{self.prefix}{name}.", self.problems)

    def tables(self, name: str) -> list[_Reader]:
        value = self._get(name, False)
        if value is None:
            return []
        if not isinstance(value, list):
            self.problem(name, "must be an array of tables ([[faults]])")
            return []
        return [_Reader(item, f"{self.prefix}{name}[{index}].", self.problems) for index, item in enumerate(value)]

    def reject_unknown(self) -> None:
        for name in sorted(set(self.data) - self.seen):
            self.problem(name, "unknown key")
