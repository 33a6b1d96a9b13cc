"""Simulated nodes on this machine: each a ``torchrun`` agent with its workers, started by ``elastic-ddp launch``.

Every node's agent runs in its own session, and torchrun starts each worker in a session of
its own too; :meth:`Node.signal_node` signals the agent's process group and every worker's,
so a node can be stopped as a whole — agent, workers and their DataLoader processes together —
the way a machine goes away. All nodes rendezvous on 127.0.0.1 through ``c10d`` or ``etcd-v3``.
Nodes can be added while the job runs. :meth:`LocalCluster.close` stops every process it started,
by process group and pid, on every exit path (use it as a context manager; Ctrl-C included).

With ``die_with_launcher`` (what ``elastic-ddp launch`` asks for), the nodes die with this process
however it ends, ``kill -9`` included (:mod:`elastic_ddp.lifeline`): agents get a parent-death
signal, and their workers take one for themselves.

:mod:`chaos.cluster` builds on this module (nodes in network namespaces, faults); nothing here
imports chaos, or torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastic_ddp.lifeline import LAUNCHER_PID_ENV, tied_to_this_process

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


REPLICA_DIR_ENV = "ELASTIC_DDP_REPLICA_DIR"
"""elastic_ddp.checkpoint.replica.REPLICA_DIR_ENV, restated: importing it would import torch into the launcher."""
SHARD_CACHE_DIR_ENV = "ELASTIC_DDP_SHARD_CACHE_DIR"
"""elastic_ddp.shards.dataset.CACHE_DIR_ENV, restated likewise: every node's shard cache is its own, empty at its start."""

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class JobSpec:
    """What each node runs, and how the agents rendezvous."""

    script: str
    args: list[str]
    nnodes: str = "1:2"
    nproc_per_node: int = 2
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    run_id: str = "chaos"
    max_restarts: int = 10
    monitor_interval_s: float = 0.1
    """torchrun's --monitor-interval (its default): how soon an agent sees a worker exit."""
    env: dict[str, str] = field(default_factory=dict)
    prefork: bool = True
    """Start workers through :mod:`elastic_ddp.prefork` (a per-node fork server that imported torch
    once), so a restart does not pay for Python importing torch again."""
    die_with_launcher: bool = False
    """Every process of the job dies with the process that starts the nodes (:mod:`elastic_ddp.lifeline`);
    without prefork, workers then start through ``-m elastic_ddp.lifeline``. Start nodes from the main thread."""

    def torchrun_command(self, extra_args: Sequence[str] = (), local_addr: str = HOST) -> list[str]:
        conf = ",".join(f"{key}={value}" for key, value in self.rdzv_conf.items())
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-backend={self.rdzv_backend}", f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.run_id}", f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}", "--local-addr", local_addr,
        ]
        if conf:
            command.append(f"--rdzv-conf={conf}")
        launcher = (["-m", "elastic_ddp.prefork"] if self.prefork
                    else ["-m", "elastic_ddp.lifeline"] if self.die_with_launcher else [])
        return command + [*launcher, self.script, *self.args, *extra_args]


class Node:
    """One simulated node: a torchrun agent in its own process group, its output in a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path,
                 prefork_script: str = "", replica_dir: Path | None = None, prestart_fork_server: bool = True,
                 die_with_parent: bool = False) -> None:
        self.name = name
        self.die_with_parent = die_with_parent
        """The agent gets SIGKILL when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``)."""
        self.replica_dir = replica_dir
        """This node's memory for replicas (``ELASTIC_DDP_REPLICA_DIR``): nodes of one machine must not share it."""
        self.command = command
        self.env = env
        self.log_path = log_path
        self.prefork_script = prefork_script
        """The script of a job run through :mod:`elastic_ddp.prefork`: its fork server starts with the agent."""
        self.prestart_fork_server = prestart_fork_server
        """Start the fork server here, with the agent. False for a node in a network namespace: the server's
        abstract unix socket belongs to the namespace it binds in, so the node's etcd-v3 agent (or, under c10d,
        its first worker) starts it there."""
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> Node:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed by the child's exit; Popen dups it
        try:
            self.process = subprocess.Popen(
                tied_to_this_process(self.command) if self.die_with_parent else self.command,
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        if self.prefork_script and self.prestart_fork_server:  # importing torch overlaps the rendezvous
            from elastic_ddp.prefork import start_server

            start_server(self.process.pid, self.prefork_script, self.env)
        logger.info("node %s started: agent pid %d", self.name, self.process.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, f"node {self.name} was never started"
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal_agent(self, signum: int) -> None:
        """Signal the agent alone (as an orchestrator's SIGTERM to the launcher would)."""
        if self.running:
            os.kill(self.pid, signum)

    def signal_node(self, signum: int) -> None:
        """Signal the agent and all its workers at once (a machine going away, freezing, resuming)."""
        if self.process is None:
            return
        for group in [self.pid, *self.worker_pids()]:
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                pass

    def lose_memory(self) -> None:
        """What a node that is gone loses with its machine: the replicas it kept in memory."""
        if self.replica_dir is not None:
            shutil.rmtree(self.replica_dir, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        """Pids of the agent's worker processes (its children), read from /proc."""
        return [pid for pid, parent in _process_parents().items() if parent == self.pid]

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, grace_s: float = 5.0) -> None:
        """End the whole node: SIGTERM to the agent and workers, SIGKILL to all of them after ``grace_s``."""
        if self.process is None:
            return
        workers = self.worker_pids()  # before the agent exits: orphaned workers cannot be found by parent
        if self.process.poll() is None:
            self.signal_node(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        for group in [self.pid, *workers]:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.wait(timeout=30)
        if self.prefork_script:
            kill_fork_servers(self.pid)  # each exits by itself once the agent has, but not while still importing


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def fork_servers(agent_pid: int) -> list[int]:
    """Pids of the prefork servers serving ``agent_pid`` (``... elastic_ddp.prefork --serve ADDRESS AGENT_PID``)."""
    servers = []
    for pid in _pids():
        argv = (_read_proc(pid, "cmdline") or "").split("\0")
        if "elastic_ddp.prefork" in argv and "--serve" in argv:
            serve = argv.index("--serve")
            if argv[serve + 2 : serve + 3] == [str(agent_pid)]:
                servers.append(pid)
    return servers


def kill_fork_servers(agent_pid: int, timeout: float = 30.0) -> list[int]:
    """SIGKILL the :mod:`elastic_ddp.prefork` servers of ``agent_pid``, if any, and wait until they are gone;
    those still alive after ``timeout``."""
    servers = fork_servers(agent_pid)
    for pid in servers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while servers and time.monotonic() < deadline:
        servers = [pid for pid in servers if process_alive(pid)]
        time.sleep(0.02)
    return servers


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``; None if the process is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _process_parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for pid in _pids():
        if (parent := parent_pid(pid)) is not None:
            parents[pid] = parent
    return parents


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, ppid, ...; None if the process is gone."""
    stat = _read_proc(pid, "stat")
    # the command name is in parentheses and may contain spaces
    return None if stat is None else stat.rsplit(")", 1)[1].split()


def _read_proc(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/{name}", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


class LocalCluster:
    """Start, grow, shrink and stop a job of simulated nodes on this machine."""

    def __init__(self, spec: JobSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.nodes: list[Node] = []
        if not spec.rdzv_endpoint:
            spec.rdzv_endpoint = f"{HOST}:{free_port()}"

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def node_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            # a fresh worker store per restart (elastic_ddp/rendezvous/RESTARTS.md)
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        if self.spec.die_with_launcher:
            env[LAUNCHER_PID_ENV] = str(os.getpid())
        else:
            env.pop(LAUNCHER_PID_ENV, None)  # a job started by a launched job's process is not that launch's
        env.update(self.spec.env)
        return env

    def node_command(self, name: str, extra_args: Sequence[str]) -> tuple[list[str], dict[str, str], bool]:
        """Node ``name``'s command line, the environment it adds, and whether its fork server starts here with
        the agent (:mod:`chaos.cluster` runs nodes in network namespaces instead)."""
        return self.spec.torchrun_command(extra_args), {}, True

    def add_node(self, extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Node:
        """Start one more node (it joins at the next rendezvous round).

        With ``c10d`` the rendezvous store lives in the agent that binds the endpoint first, and
        dies with it. The first node is therefore started alone and given the store before any
        other starts, so "node0 hosts the store" holds in every run (never preempt node0 under
        c10d; ``etcd-v3`` has no such node).
        """
        name = f"node{len(self.nodes)}"
        replica_dir = self.workdir / "node-memory" / name
        cache_dir = self.workdir / "node-cache" / name
        command, network_env, prestart = self.node_command(name, extra_args)
        node = Node(name, command,
                    {**self.node_env(), REPLICA_DIR_ENV: str(replica_dir), SHARD_CACHE_DIR_ENV: str(cache_dir), **network_env,
                     **(env or {})},
                    self.workdir / f"{name}.log", prefork_script=self.spec.script if self.spec.prefork else "",
                    replica_dir=replica_dir, prestart_fork_server=prestart, die_with_parent=self.spec.die_with_launcher)
        self.nodes.append(node.start())
        if self.spec.rdzv_backend == "c10d" and len(self.nodes) == 1:
            host, port = self.spec.rdzv_endpoint.rsplit(":", 1)
            wait_for(lambda: _accepts(host, int(port)) or not node.running, 120, f"node0 to host the c10d store on {host}:{port}")
        return node

    def start(self, count: int) -> LocalCluster:
        for _ in range(count):
            self.add_node()
        return self

    def wait_all(self, timeout: float) -> dict[str, int]:
        """Wait until every node's agent exited; their exit statuses by node name."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        for node in self.nodes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                codes[node.name] = node.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"node {node.name} still running after {timeout:.0f} s:\n{node.output()[-3000:]}") from None
        return codes

    def close(self) -> None:
        """Stop every node this cluster started (agents and workers), whatever state they are in."""
        for node in self.nodes:
            node.signal_node(signal.SIGCONT)  # a stopped node cannot act on SIGTERM
            node.stop()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
