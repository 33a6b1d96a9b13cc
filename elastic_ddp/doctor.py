"""``elastic-ddp doctor``: is this job's network healthy, and if not, which rank, node or link is to blame?

Run it like a training script, on every node of the job::

    torchrun --nnodes 3 --nproc-per-node 2 --rdzv-backend etcd-v3 --rdzv-endpoint HOST:2379 ... \\
        -m elastic_ddp.doctor [--json] [--report FILE] [--rdzv-endpoint HOST:2379]

or alone (``elastic-ddp doctor``: one rank; it checks the endpoint and this machine's compute).
Every rank takes part; rank 0 prints the report. What it measures, in order:

1. **Control plane**: forming the gloo process group through the workers' store (time taken), and
   with ``--rdzv-endpoint`` a TCP dial and etcd's ``/health`` on each endpoint.
2. **TCP matrix**: every rank listens on the address it reaches the store from; every rank dials
   every other (``--dial-timeout-s``) and times a 1-byte echo: cells OK, REFUSED or TIMEOUT.
3. **Compute**: a fixed matmul loop, the ranks taking turns, best of 30 rounds (stragglers by local work,
   not by waiting in collectives, and not by ranks of one machine competing for its cores).
4. **All-reduce** of each size in ``--sizes-kib`` on all ranks, reported as nccl-tests does:
   algbw = bytes / time, busbw = algbw × 2(n−1)/n; and the same per pair of nodes (their first ranks).

Verdicts (:func:`diagnose`, a pure function of the measurements): UNREACHABLE cells; a node all of
whose links are slow (round trip above ``--slow-link-factor`` × the best link's and
``--slow-link-min-ms`` more), else each slow link; a rank whose compute or all-reduce time is
``--straggler-factor`` × the median. Exit status: 0 healthy, 1 something is slow, 2 something is
unreachable or a measurement failed (as Meta GCM's ``check-nccl``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OK, REFUSED, TIMEOUT = 0, 1, 2
CELL_NAMES = {OK: "OK", REFUSED: "REFUSED", TIMEOUT: "TIMEOUT"}
EXIT_HEALTHY, EXIT_SLOW, EXIT_BROKEN = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """What the doctor measures and how it judges."""

    sizes_kib: tuple[int, ...] = (4, 64, 1024, 4096)
    """All-reduce sizes in KiB (float32 elements)."""
    iters: int = 10
    """Timed all-reduces per size (after ``warmup``)."""
    warmup: int = 3
    """Untimed all-reduces per size first."""
    timeout_s: float = 30.0
    """Process-group formation and every collective: past it the doctor reports the failure and exits 2."""
    dial_timeout_s: float = 2.0
    """One TCP dial between two ranks; past it the cell is TIMEOUT."""
    rdzv_endpoints: tuple[str, ...] = ()
    """``host:port`` of the rendezvous (etcd) endpoints to check; empty: not checked."""
    slow_link_factor: float = 5.0
    """A link is slow when its round trip exceeds this many times the best link's ..."""
    slow_link_min_ms: float = 10.0
    """... and the best link's plus this many milliseconds."""
    straggler_factor: float = 2.0
    """A rank is a straggler when its compute or all-reduce time is this many times the median rank's."""

    def problems(self) -> list[str]:
        found = []
        if not self.sizes_kib or any(size < 1 for size in self.sizes_kib):
            found.append(f"--sizes-kib: give sizes >= 1, got {list(self.sizes_kib)}")
        if self.iters < 1:
            found.append(f"--iters: must be >= 1, got {self.iters}")
        if self.warmup < 0:
            found.append(f"--warmup: must be >= 0, got {self.warmup}")
        for name in ("timeout_s", "dial_timeout_s", "slow_link_min_ms"):
            if not getattr(self, name) > 0:
                found.append(f"--{name.replace('_', '-')}: must be > 0, got {getattr(self, name)}")
        for name in ("slow_link_factor", "straggler_factor"):
            if not getattr(self, name) > 1:
                found.append(f"--{name.replace('_', '-')}: must be > 1, got {getattr(self, name)}")
        for endpoint in self.rdzv_endpoints:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                found.append(f"--rdzv-endpoint: {endpoint!r} is not HOST:PORT")
        return found


# -- measurements (what every rank contributes; rank 0 holds them all) ------------------------


@dataclass
class Measurements:
    world_size: int
    nodes: list[int]
    """The node (torchrun's GROUP_RANK) of each rank."""
    addresses: list[str]
    """The address each rank reached the store from."""
    store_s: float = 0.0
    endpoints: dict[str, str] = field(default_factory=dict)
    """Rendezvous endpoint -> "OK 1.2 ms" or the error."""
    cells: list[list[int]] = field(default_factory=list)
    """cells[i][j]: rank i dialling rank j (OK, REFUSED, TIMEOUT)."""
    rtt_ms: list[list[float]] = field(default_factory=list)
    """rtt_ms[i][j]: the median 1-byte echo from rank i to rank j (0 where the cell is not OK)."""
    compute_ms: list[float] = field(default_factory=list)
    allreduce: list[dict[str, Any]] = field(default_factory=list)
    """One row per size: bytes, time_us (the slowest rank's median), algbw/busbw (GB/s), per-rank time_us."""
    pairs: list[dict[str, Any]] = field(default_factory=list)
    """One row per pair of nodes: nodes, ranks, time_us, algbw, busbw, rtt_ms (median over their rank pairs)."""
    error: str = ""
    """A measurement that failed (a collective timed out...): the report is partial."""


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor, 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size if world_size > 1 else 0.0


def bandwidth_row(size_bytes: int, seconds: float, world_size: int) -> dict[str, float]:
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return {"bytes": size_bytes, "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(world_size)}


# -- verdicts (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    severity: int
    """EXIT_SLOW or EXIT_BROKEN."""
    kind: str
    """UNREACHABLE, SLOW NODE, SLOW LINK, STRAGGLER, FAILED."""
    message: str


def diagnose(m: Measurements, config: DoctorConfig) -> list[Finding]:
    """Every problem the measurements show, worst first."""
    findings = []
    if m.error:
        findings.append(Finding(EXIT_BROKEN, "FAILED", m.error))
    for endpoint, outcome in m.endpoints.items():
        if not outcome.startswith("OK"):
            findings.append(Finding(EXIT_BROKEN, "UNREACHABLE", f"rendezvous endpoint {endpoint}: {outcome}"))
    for i, row in enumerate(m.cells):
        for j, cell in enumerate(row):
            if i != j and cell != OK:
                findings.append(Finding(EXIT_BROKEN, "UNREACHABLE", f"rank {i} on node {m.nodes[i]} -> rank {j} on node "
                                        f"{m.nodes[j]} ({m.addresses[j]}): {CELL_NAMES[cell]}"))
    findings += _slow_links(m, config)
    findings += _stragglers(m, config)
    return sorted(findings, key=lambda finding: -finding.severity)


def node_rtts(m: Measurements) -> dict[tuple[int, int], float]:
    """The median round trip between each pair of nodes, over the rank pairs that span them (both directions)."""
    samples: dict[tuple[int, int], list[float]] = {}
    for i, row in enumerate(m.rtt_ms):
        for j, rtt in enumerate(row):
            a, b = sorted((m.nodes[i], m.nodes[j]))
            if a != b and m.cells[i][j] == OK:
                samples.setdefault((a, b), []).append(rtt)
    return {pair: statistics.median(values) for pair, values in sorted(samples.items())}


def _slow_links(m: Measurements, config: DoctorConfig) -> list[Finding]:
    rtts = node_rtts(m)
    if len(rtts) < 1:
        return []
    best = min(rtts.values())
    limit = max(best * config.slow_link_factor, best + config.slow_link_min_ms)
    slow = {pair for pair, rtt in rtts.items() if rtt > limit}
    if not slow:
        return []
    findings, explained = [], set()
    nodes = sorted({node for pair in rtts for node in pair})
    for node in nodes:
        own = [pair for pair in rtts if node in pair]
        others = [pair for pair in rtts if node not in pair]
        if len(nodes) >= 3 and own and all(pair in slow for pair in own) and not all(pair in slow for pair in others):
            links = ", ".join(f"node{a} \u2194 node{b} {rtts[(a, b)]:.1f} ms" for a, b in own)
            findings.append(Finding(EXIT_SLOW, "SLOW NODE", f"node{node} ({_node_address(m, node)}): every link slow: "
                                    f"{links} (best link {best:.1f} ms)"))
            explained.update(own)
    for a, b in sorted(slow - explained):
        findings.append(Finding(EXIT_SLOW, "SLOW LINK", f"node{a} \u2194 node{b} latency {rtts[(a, b)]:.1f} ms "
                                f"(best link {best:.1f} ms)"))
    return findings


def _node_address(m: Measurements, node: int) -> str:
    return next(address for address, owner in zip(m.addresses, m.nodes) if owner == node)


def _stragglers(m: Measurements, config: DoctorConfig) -> list[Finding]:
    findings = []
    series = [("compute", m.compute_ms)]
    if m.allreduce:
        series.append(("all-reduce", [time_us / 1000 for time_us in m.allreduce[-1]["per_rank_us"]]))
    for what, times in series:
        if len(times) < 2:
            continue
        median = statistics.median(times)
        for rank, value in enumerate(times):
            if median > 0 and value > config.straggler_factor * median:
                findings.append(Finding(EXIT_SLOW, "STRAGGLER", f"rank {rank} on node {m.nodes[rank]}: {what} "
                                        f"{value / median:.1f}\u00d7 the median ({value:.1f} ms vs {median:.1f} ms)"))
    return findings


def exit_status(findings: list[Finding]) -> int:
    return max((finding.severity for finding in findings), default=EXIT_HEALTHY)


# -- rendering ----------------------------------------------------------------------------


def render(m: Measurements, findings: list[Finding]) -> str:
    lines = [f"elastic-ddp doctor: {m.world_size} rank(s) on {len(set(m.nodes))} node(s); store and process group "
             f"in {m.store_s * 1000:.0f} ms"]
    for endpoint, outcome in m.endpoints.items():
        lines.append(f"  rendezvous {endpoint}: {outcome}")
    if m.cells:
        lines.append("TCP matrix (round trip ms; row dials column):")
        for i, rtt_row in enumerate(m.rtt_ms):
            cells = [("-" if i == j else f"{rtt:.2f}" if m.cells[i][j] == OK else CELL_NAMES[m.cells[i][j]])
                     for j, rtt in enumerate(rtt_row)]
            lines.append(f"  rank {i:>3} node{m.nodes[i]}: " + " ".join(f"{cell:>8}" for cell in cells))
    if m.compute_ms:
        lines.append("compute per rank (ms): " + " ".join(f"{value:.1f}" for value in m.compute_ms))
    if m.allreduce:
        lines.append(f"all-reduce, {m.world_size} ranks (float32, sum; time: the slowest rank's median)")
        lines.append(f"  {'size (B)':>10} {'count':>9} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for row in m.allreduce:
            lines.append(f"  {row['bytes']:>10} {row['bytes'] // 4:>9} {row['time_us']:>11.1f} "
                         f"{row['algbw_gbps']:>13.3f} {row['busbw_gbps']:>13.3f}")
        lines.append(f"  Avg bus bandwidth: {statistics.mean(row['busbw_gbps'] for row in m.allreduce):.3f} GB/s")
    for row in m.pairs:
        lines.append(f"  pair node{row['nodes'][0]} \u2194 node{row['nodes'][1]}: all-reduce {row['bytes']} B "
                     f"{row['time_us']:.1f} us, busbw {row['busbw_gbps']:.3f} GB/s, round trip {row['rtt_ms']:.2f} ms")
    if findings:
        lines += [f"{finding.kind}: {finding.message}" for finding in findings]
    else:
        lines.append("healthy: every rank reachable, no slow link, no straggler")
    return "\n".join(lines)


def as_json(m: Measurements, findings: list[Finding]) -> dict[str, Any]:
    return {"measurements": asdict(m), "findings": [asdict(finding) for finding in findings],
            "exit_status": exit_status(findings)}


# -- measuring (every rank) -------------------------------------------------------------------


def local_address(master_addr: str, master_port: int) -> str:
    """The address this host reaches the store from (a UDP "connect" sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, master_port or 1))
        return probe.getsockname()[0]


class EchoServer:
    """Accepts connections on ``address`` and echoes every byte back, until closed."""

    def __init__(self, address: str) -> None:
        self.listener = socket.create_server((address, 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, name="doctor-echo", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._echo, args=(client,), daemon=True).start()

    @staticmethod
    def _echo(client: socket.socket) -> None:
        with client:
            try:
                while data := client.recv(64):
                    client.sendall(data)
            except OSError:  # the dialler went away: nothing to echo any more
                return

    def close(self) -> None:
        self.listener.close()


def dial(address: str, port: int, timeout_s: float, echoes: int = 5) -> tuple[int, float]:
    """(cell, median round trip in ms) of one rank dialling another."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(echoes):
                started = time.perf_counter()
                sock.sendall(b"x")
                if sock.recv(1) != b"x":
                    return REFUSED, 0.0
                times.append(time.perf_counter() - started)
            return OK, statistics.median(times) * 1000
    except ConnectionRefusedError:
        return REFUSED, 0.0
    except OSError:
        return TIMEOUT, 0.0


def check_endpoint(endpoint: str, timeout_s: float) -> str:
    """``OK <ms>`` when ``host:port`` accepts a TCP connection and (etcd) reports itself healthy."""
    host, _, port = endpoint.rpartition(":")
    started = time.perf_counter()
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"TCP dial failed: {exc}"
    dialled_ms = (time.perf_counter() - started) * 1000
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout_s) as response:
            health = json.loads(response.read()).get("health")
    except (OSError, ValueError) as exc:
        return f"OK {dialled_ms:.1f} ms (TCP; /health did not answer: {exc})"
    if health != "true":
        return f"etcd /health says {health!r}"
    return f"OK {dialled_ms:.1f} ms" + _v2_api_note(endpoint, timeout_s)


def _v2_api_note(endpoint: str, timeout_s: float) -> str:
    """What the endpoint's etcd means for torch's own etcd backends, which need the v2 API (etcd 3.6 removed it)."""
    try:
        urllib.request.urlopen(f"http://{endpoint}/v2/keys/", timeout=timeout_s).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return "; this etcd has no v2 API: use --rdzv-backend=etcd-v3 (torch's etcd and etcd-v2 backends need v2)"
        return ""
    except (OSError, ValueError):
        return ""
    return ""


COMPUTE_ROUNDS = 30
"""Timings of the compute loop per rank; the doctor keeps each rank's best."""


def compute_once(a: Any, b: Any) -> float:
    """Milliseconds for a fixed loop of 256x256 matmuls."""
    started = time.perf_counter()
    for _ in range(20):
        a = (a @ b).tanh_()
    return (time.perf_counter() - started) * 1000


def compute_each_in_turn(rank: int, world_size: int, rounds: int = COMPUTE_ROUNDS) -> float:
    """This rank's best :func:`compute_once` over ``rounds`` rounds in which the ranks take turns (the others wait in
    a barrier): ranks sharing a machine do not slow each other down, a passing load elsewhere on the machine hits
    every rank's timings alike, and only a rank that is slow every time stands out."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    best = float("inf")
    for _ in range(rounds):
        for turn in range(world_size):
            dist.barrier()
            if turn == rank:
                best = min(best, compute_once(a, b))
    return best


def measure(config: DoctorConfig) -> Measurements:
    """Every rank runs this; rank 0's return value holds everyone's measurements."""
    import torch

    from elastic_ddp.config import DistConfig
    from elastic_ddp.distributed import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_env()
    node = int(os.environ.get("GROUP_RANK", "0"))
    started = time.perf_counter()
    init_distributed(DistConfig(backend="gloo", device="cpu", init_timeout_s=config.timeout_s,
                                collective_timeout_s=config.timeout_s), env)
    store_s = time.perf_counter() - started
    address = local_address(env.master_addr, env.master_port) if env.under_launcher else "127.0.0.1"
    server = EchoServer(address)
    m = Measurements(world_size=env.world_size, nodes=[node], addresses=[address], store_s=store_s)
    try:
        if env.rank == 0:
            m.endpoints = {endpoint: check_endpoint(endpoint, config.dial_timeout_s) for endpoint in config.rdzv_endpoints}
        n = env.world_size
        ident = torch.tensor([node, int.from_bytes(socket.inet_aton(address), "big"), server.port], dtype=torch.int64)
        idents = _gather(ident, n)
        m.nodes = [int(row[0]) for row in idents]
        m.addresses = [socket.inet_ntoa(int(row[1]).to_bytes(4, "big")) for row in idents]
        ports = [int(row[2]) for row in idents]
        row = [dial(m.addresses[j], ports[j], config.dial_timeout_s) if j != env.rank else (OK, 0.0) for j in range(n)]
        cells = _gather(torch.tensor([cell for cell, _ in row], dtype=torch.int64), n)
        rtts = _gather(torch.tensor([rtt for _, rtt in row], dtype=torch.float64), n)
        m.cells = [[int(value) for value in line] for line in cells]
        m.rtt_ms = [[float(value) for value in line] for line in rtts]
        own_ms = compute_each_in_turn(env.rank, n)
        m.compute_ms = [float(value) for value in _gather(torch.tensor([own_ms], dtype=torch.float64), n)[:, 0]]
        for size_kib in config.sizes_kib:
            m.allreduce.append(_time_allreduce(size_kib * 1024, config, n, None))
        m.pairs = _pairs(m, config)
    except (RuntimeError, OSError) as exc:  # a collective timed out or a peer went away: report what was measured
        m.error = f"rank {env.rank}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
    finally:
        server.close()
        shutdown_distributed()
    return m


def _gather(tensor: Any, world_size: int) -> Any:
    import torch
    import torch.distributed as dist

    rows = [torch.zeros_like(tensor) for _ in range(world_size)]
    dist.all_gather(rows, tensor)
    return torch.stack(rows)


def _time_allreduce(size_bytes: int, config: DoctorConfig, world_size: int, group: Any) -> dict[str, Any]:
    """One all-reduce size on ``group`` (None: all ranks): each member's median, gathered on all ranks."""
    import torch
    import torch.distributed as dist

    data = torch.ones(size_bytes // 4)
    times = []
    for index in range(config.warmup + config.iters):
        dist.barrier(group=group)
        started = time.perf_counter()
        dist.all_reduce(data, group=group)
        if index >= config.warmup:
            times.append(time.perf_counter() - started)
    own = torch.tensor([statistics.median(times)], dtype=torch.float64)
    members = world_size if group is None else dist.get_world_size(group)
    rows = [torch.zeros_like(own) for _ in range(members)]
    dist.all_gather(rows, own, group=group)
    per_rank = [float(row[0]) for row in rows]
    return {**bandwidth_row(size_bytes, max(per_rank), members), "per_rank_us": [value * 1e6 for value in per_rank]}


def _pairs(m: Measurements, config: DoctorConfig) -> list[dict[str, Any]]:
    """The largest all-reduce between the first ranks of each pair of nodes, one pair at a time."""
    import torch
    import torch.distributed as dist

    leaders = {node: m.nodes.index(node) for node in sorted(set(m.nodes))}
    rtts = node_rtts(m)
    rows = []
    rank = dist.get_rank()
    size = config.sizes_kib[-1] * 1024
    for a, b in itertools.combinations(sorted(leaders), 2):
        members = [leaders[a], leaders[b]]
        group = dist.new_group(members, timeout=_timedelta(config.timeout_s))  # every rank creates every group
        result = torch.zeros(2, dtype=torch.float64)
        if rank in members:
            row = _time_allreduce(size, config, 2, group)
            result = torch.tensor([row["time_us"], 1.0], dtype=torch.float64)
        dist.all_reduce(result)  # the pair's figure (sent by both members) to everyone
        time_us = float(result[0] / max(1.0, float(result[1])))
        rows.append({**bandwidth_row(size, time_us / 1e6, 2), "nodes": [a, b], "ranks": members,
                     "rtt_ms": rtts.get((a, b), 0.0)})
    return rows


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


# -- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DoctorConfig()
    parser.add_argument("--json", action="store_true", help="print the report as JSON (rank 0)")
    parser.add_argument("--report", default="", metavar="FILE", help="also write the JSON report to FILE (rank 0)")
    parser.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT[,...]",
                        help="rendezvous (etcd) endpoints to check: TCP dial and /health")
    parser.add_argument("--sizes-kib", default=",".join(map(str, defaults.sizes_kib)),
                        help=f"all-reduce sizes in KiB, comma-separated (default {defaults.sizes_kib})")
    parser.add_argument("--iters", type=int, default=defaults.iters, help="timed all-reduces per size")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed all-reduces per size first")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                        help="process-group formation and each collective; past it: exit 2")
    parser.add_argument("--dial-timeout-s", type=float, default=defaults.dial_timeout_s,
                        help="one TCP dial between two ranks; past it the cell is TIMEOUT")
    parser.add_argument("--slow-link-factor", type=float, default=defaults.slow_link_factor,
                        help="a link whose round trip is this many times the best link's (and --slow-link-min-ms more) is slow")
    parser.add_argument("--slow-link-min-ms", type=float, default=defaults.slow_link_min_ms)
    parser.add_argument("--straggler-factor", type=float, default=defaults.straggler_factor,
                        help="a rank this many times the median rank's compute or all-reduce time is a straggler")


def config_from(args: argparse.Namespace) -> DoctorConfig:
    from elastic_ddp.errors import ConfigError

    try:
        sizes = tuple(int(part) for part in args.sizes_kib.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(f"--sizes-kib: {args.sizes_kib!r} is not a comma-separated list of integers") from exc
    config = DoctorConfig(
        sizes_kib=sizes, iters=args.iters, warmup=args.warmup, timeout_s=args.timeout_s,
        dial_timeout_s=args.dial_timeout_s,
        rdzv_endpoints=tuple(part for part in args.rdzv_endpoint.split(",") if part),
        slow_link_factor=args.slow_link_factor, slow_link_min_ms=args.slow_link_min_ms,
        straggler_factor=args.straggler_factor,
    )
    problems = config.problems()
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def run(args: argparse.Namespace) -> int:
    """Measure (every rank), judge and report (rank 0); the exit status on every rank."""
    config = config_from(args)
    m = measure(config)
    findings = diagnose(m, config) if len(m.cells) == m.world_size else [Finding(EXIT_BROKEN, "FAILED", m.error)]
    if int(os.environ.get("RANK", "0")) == 0:
        report = as_json(m, findings)
        if args.report:
            with open(args.report, "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1)
        print(json.dumps(report, indent=1) if args.json else render(m, findings), flush=True)
    return exit_status(findings)


def main(argv: Sequence[str] | None = None) -> int:
    from elastic_ddp.errors import ElasticDDPError

    parser = argparse.ArgumentParser(prog="elastic-ddp doctor", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ElasticDDPError as exc:
        print(f"elastic-ddp doctor: error: {exc}", file=sys.stderr)
        return EXIT_BROKEN


if __name__ == "__main__":
    sys.exit(main())
