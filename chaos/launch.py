"""``python -m chaos launch``: an elastic job of simulated nodes on this machine.

    python -m chaos launch --nodes 2:3 --nproc-per-node 2 -- examples/train.py --max-steps 500 \\
        --checkpoint-dir /tmp/ckpt --checkpoint-every 50

Each node is a ``torchrun`` agent in its own process group (:mod:`chaos.cluster`); they
rendezvous through ``etcd-v3`` on an embedded etcd (started on 127.0.0.1 when ``--etcd`` names
none) or through ``c10d``. Node logs go to ``--workdir``. The command returns when every node
exited: 0 if all exited 0. Ctrl-C (or SIGTERM) stops every node and the embedded etcd.

A work directory serves one launch at a time (a lock file). Launched again on it, the job goes on from
its checkpoints: the embedded etcd starts empty (the previous launch's rendezvous, closed when that job
finished, is not this one's), and the previous launch's node logs become ``nodeN.previous.log``.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from chaos.cluster import JobSpec, LocalCluster
from chaos.etcd import EtcdServer, start_etcd
from chaos.scenario import ETCD_CONF, RDZV_CONF, ScenarioError

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_ENDPOINT = re.compile(r"^(https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="1:2", help="torchrun --nnodes: MIN:MAX or N (default 1:2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--nodes-start", type=int, default=0, help="nodes to start (default: the maximum)")
    parser.add_argument("--rdzv-backend", choices=("etcd-v3", "c10d"), default="etcd-v3")
    parser.add_argument("--etcd", default="", help="etcd endpoint(s) HOST:PORT[,...]; default: an embedded etcd")
    parser.add_argument("--run-id", default="local", help="torchrun --rdzv-id (default local)")
    parser.add_argument("--max-restarts", type=int, default=10, help="torchrun --max-restarts (default 10)")
    parser.add_argument("--workdir", default="", help="node logs and embedded etcd data (default: a new temp dir)")
    parser.add_argument("--prefork", action=argparse.BooleanOptionalAction, default=True,
                        help="start workers through a per-node fork server that imported torch once "
                             "(elastic_ddp.prefork), so restarts skip importing torch (default); "
                             "--no-prefork starts every worker as a new Python process")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="stop every node after this long (default 3600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")


def node_range(text: str) -> tuple[int, int]:
    """(min, max) of ``--nodes``; ScenarioError naming the value when it is not MIN:MAX or N."""
    parts = text.split(":")
    if len(parts) in (1, 2) and all(part.isdigit() for part in parts) and 1 <= int(parts[0]) <= int(parts[-1]):
        return int(parts[0]), int(parts[-1])
    raise ScenarioError(f"--nodes {text!r}: expected MIN:MAX or N with 1 <= MIN <= MAX")


def launch(args: argparse.Namespace) -> int:
    """Start the nodes, wait for them, return 0 if every one exited 0."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ScenarioError("launch: name the training script after --, e.g. -- examples/train.py --max-steps 100")
    low, high = node_range(args.nodes)
    start = args.nodes_start or high
    if not low <= start <= high:
        raise ScenarioError(f"--nodes-start {start} is outside --nodes {args.nodes}")
    if args.nproc_per_node < 1:
        raise ScenarioError(f"--nproc-per-node {args.nproc_per_node}: expected at least 1 worker per node")
    if args.max_restarts < 0:
        raise ScenarioError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    bad = [entry for entry in args.etcd.split(",") if args.etcd and not _ENDPOINT.match(entry.strip())]
    if bad:
        raise ScenarioError(f"--etcd {args.etcd!r}: {', '.join(map(repr, bad))} is not HOST:PORT")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elastic-ddp-launch-"))
    with ExitStack() as stack:
        _hold(workdir, stack)
        _set_aside_previous_launch(workdir)
        endpoint = _rendezvous_endpoint(args, workdir, stack)
        conf = ETCD_CONF if args.rdzv_backend == "etcd-v3" else RDZV_CONF
        spec = JobSpec(script=command[0], args=command[1:], nnodes=args.nodes, nproc_per_node=args.nproc_per_node,
                       rdzv_backend=args.rdzv_backend, rdzv_endpoint=endpoint, rdzv_conf=dict(conf),
                       run_id=args.run_id, max_restarts=args.max_restarts, prefork=args.prefork)
        cluster = stack.enter_context(LocalCluster(spec, workdir))
        cluster.start(start)
        start_mode = "warm (elastic_ddp.prefork)" if args.prefork else "as new processes (--no-prefork)"
        print(f"launched {start} node(s) x {args.nproc_per_node} worker(s), rendezvous {args.rdzv_backend} at "
              f"{spec.rdzv_endpoint}, workers start {start_mode}; node logs in {workdir}", file=sys.stderr)
        codes = _wait(cluster, args.timeout_s)
    return _summarize(cluster, codes)


def _hold(workdir: Path, stack: ExitStack) -> None:
    """Take the work directory for this launch, or refuse in one line when another launch holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    lock = stack.enter_context(open(workdir / "launch.lock", "a+"))  # noqa: SIM115 - closed by the stack
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise ScenarioError(f"--workdir {workdir} is in use by another launch (pid {lock.read().strip() or '?'}); "
                            "wait for it to end or choose another directory") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()


def _set_aside_previous_launch(workdir: Path) -> None:
    """What a finished launch left that is not the job's state: its embedded etcd's data and its node logs."""
    old_etcd = sorted(workdir.glob("etcd-*"))
    for path in old_etcd:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    logs = sorted(path for path in workdir.glob("node*.log") if not path.name.endswith(".previous.log"))
    for log in logs:
        log.replace(log.with_name(log.stem + ".previous.log"))
    if old_etcd or logs:
        print(f"{workdir}: the previous launch's embedded etcd data removed and its node logs kept as "
              "nodeN.previous.log; the job goes on from its checkpoints", file=sys.stderr)


def _rendezvous_endpoint(args: argparse.Namespace, workdir: Path, stack: ExitStack) -> str:
    if args.rdzv_backend != "etcd-v3" or args.etcd:
        return args.etcd
    server = start_etcd("embedded", workdir, stack)
    assert isinstance(server, EtcdServer)
    print(f"embedded etcd at {server.endpoint} (pid {server.pid})", file=sys.stderr)
    return server.endpoint


def _wait(cluster: LocalCluster, timeout_s: float) -> dict[str, int | None]:
    deadline = time.monotonic() + timeout_s
    while any(node.running for node in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return {node.name: node.returncode for node in cluster.nodes}


def _summarize(cluster: LocalCluster, codes: dict[str, int | None]) -> int:
    for node in cluster.nodes:
        code = codes[node.name]
        print(f"{node.name}: {'still running at the deadline' if code is None else f'exit {code}'} ({node.log_path})")
        lines = node.output().splitlines()
        done = [line for line in lines if "elastic_ddp.trainer: done:" in line]
        if done:
            print(f"  {done[-1]}")
        elif code and lines:  # why it failed: torchrun's or the worker's last word
            print(f"  {lines[-1]}")
    return 0 if all(code == 0 for code in codes.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos launch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return launch(parser.parse_args(argv))
