"""``elastic-ddp launch``: an elastic job of simulated nodes on this machine.

    elastic-ddp launch --nodes 2:3 --nproc-per-node 2 -- examples/train.py --max-steps 500 \\
        --checkpoint-dir /tmp/ckpt --checkpoint-every 50 --log-dir /tmp/logs

Each node is a ``torchrun`` agent in its own process group (:mod:`elastic_ddp.launcher.nodes`); they
rendezvous through ``etcd-v3`` on an embedded etcd (started on 127.0.0.1 when ``--etcd`` names none) or
through ``c10d``. Node logs go to ``--workdir``. The console shows rank 0's progress, each restart,
membership change and recovery, and how the job ended (:mod:`elastic_ddp.launcher.console`). The command
returns when every node exited: 0 if all exited 0. Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops
every node and the embedded etcd; if the launcher is killed outright (``kill -9``), every process it started
dies with it all the same (:mod:`elastic_ddp.lifeline`).

A work directory serves one launch at a time (a lock file). Launched again on it, the job goes on from
its checkpoints: the embedded etcd starts empty (the previous launch's rendezvous, closed when that job
finished, is not this one's), and the previous launch's node logs become ``nodeN.previous.log``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.launcher.console import Console, log_dir_of
from elastic_ddp.launcher.etcd import start_embedded
from elastic_ddp.launcher.nodes import JobSpec, LocalCluster
from elastic_ddp.metrics import PROGRESS_FILE_ENV

PROG = "elastic-ddp launch"
PROGRESS_FILE = "progress.jsonl"
"""Under the work directory: rank 0's progress feed (:class:`elastic_ddp.metrics.ProgressFeed`)."""

RDZV_CONF = {"join_timeout": "60", "last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
"""Rendezvous settings of a launched job: a dead node is noticed after 3 s, a round closes 1 s after the minimum
is reached (chaos.scenario's RDZV_CONF is the same)."""
ETCD_CONF = {**RDZV_CONF, "read_timeout": "30"}
"""``etcd-v3`` adds ``read_timeout``: one etcd call rides out an outage this long."""

_POLL_S = 0.2
_ENDPOINT = re.compile(r"^(https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
_STOPPING = (signal.SIGTERM, signal.SIGHUP)


class LaunchError(ElasticDDPError):
    """A launch refused before anything started (a bad value, a work directory in use); the message says which."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP: every node is stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=False,
                        help="the etcd-v3 rendezvous's in-process mode (a preview): the workers keep their processes "
                             "when a node is lost, preempted or added (--rdzv-conf in_process=true)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="stop every node after this long (default 3600)")
    parser.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                        help="without a terminal, one progress line this often (default 5; 0: none); "
                             "on a terminal the progress is a live bar")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")


def node_range(text: str) -> tuple[int, int]:
    """(min, max) of ``--nodes``; LaunchError naming the value when it is not MIN:MAX or N."""
    parts = text.split(":")
    if len(parts) in (1, 2) and all(part.isdigit() for part in parts) and 1 <= int(parts[0]) <= int(parts[-1]):
        return int(parts[0]), int(parts[-1])
    raise LaunchError(f"--nodes {text!r}: expected MIN:MAX or N with 1 <= MIN <= MAX")


def _command(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LaunchError("launch: name the training script after --, e.g. -- examples/train.py --max-steps 100")
    low, high = node_range(args.nodes)
    start = args.nodes_start or high
    if not low <= start <= high:
        raise LaunchError(f"--nodes-start {start} is outside --nodes {args.nodes}")
    if args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node {args.nproc_per_node}: expected at least 1 worker per node")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    if args.in_process and args.rdzv_backend != "etcd-v3":
        raise LaunchError(f"--in-process: the in-process mode is the etcd-v3 rendezvous's, not {args.rdzv_backend}'s")
    bad = [entry for entry in args.etcd.split(",") if args.etcd and not _ENDPOINT.match(entry.strip())]
    if bad:
        raise LaunchError(f"--etcd {args.etcd!r}: {', '.join(map(repr, bad))} is not HOST:PORT")
    return command


def launch(args: argparse.Namespace) -> int:
    """Start the nodes, show the job on the console, wait for them; 0 if every one exited 0.

    Call it from the main thread: the nodes and the embedded etcd take a parent-death signal tied to the thread
    that starts them. An interrupt (:class:`Interrupted`, KeyboardInterrupt) stops every node on its way out."""
    command = _command(args)
    start = args.nodes_start or node_range(args.nodes)[1]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elastic-ddp-launch-"))
    log_dir = log_dir_of(command[1:])
    with ExitStack() as stack:
        _hold(workdir, stack)
        _set_aside_previous_launch(workdir)
        progress_file = workdir / PROGRESS_FILE
        progress_file.unlink(missing_ok=True)
        console = Console(progress_file, log_dir, progress_every_s=args.progress_every)
        endpoint = _rendezvous_endpoint(args, workdir, stack, console)
        conf = {**(ETCD_CONF if args.rdzv_backend == "etcd-v3" else RDZV_CONF),
                **({"in_process": "true"} if args.in_process else {})}
        spec = JobSpec(script=command[0], args=command[1:], nnodes=args.nodes, nproc_per_node=args.nproc_per_node,
                       rdzv_backend=args.rdzv_backend, rdzv_endpoint=endpoint, rdzv_conf=conf,
                       run_id=args.run_id, max_restarts=args.max_restarts, prefork=args.prefork,
                       env={PROGRESS_FILE_ENV: str(progress_file.absolute())}, die_with_launcher=True)
        cluster = stack.enter_context(LocalCluster(spec, workdir))
        stack.callback(console.close)  # the bar comes down before the nodes' stop is reported
        cluster.start(start)
        start_mode = "warm (elastic_ddp.prefork)" if args.prefork else "as new processes (--no-prefork)"
        console.say(f"launched {start} node(s) x {args.nproc_per_node} worker(s), rendezvous {args.rdzv_backend} at "
                    f"{spec.rdzv_endpoint}, workers start {start_mode}; node logs in {workdir}")
        if not log_dir:
            console.say("the script has no --log-dir: the console shows rank 0's progress, not the restarts and "
                        "recoveries (they come from <log-dir>/events.jsonl)")
        codes = _wait(cluster, console, args.timeout_s)
        console.close()
    for node in cluster.nodes:
        code = codes[node.name]
        console.say(f"{node.name}: {'still running at the deadline' if code is None else f'exit {code}'} ({node.log_path})")
    console.say(console.outcome(codes))
    return 0 if all(code == 0 for code in codes.values()) else 1


def _hold(workdir: Path, stack: ExitStack) -> None:
    """Take the work directory for this launch, or refuse in one line when another launch holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    lock = stack.enter_context(open(workdir / "launch.lock", "a+"))  # noqa: SIM115 - closed by the stack
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise LaunchError(f"--workdir {workdir} is in use by another launch (pid {lock.read().strip() or '?'}); "
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


def _rendezvous_endpoint(args: argparse.Namespace, workdir: Path, stack: ExitStack, console: Console) -> str:
    if args.rdzv_backend != "etcd-v3" or args.etcd:
        return args.etcd
    server = start_embedded(workdir, stack)
    console.say(f"embedded etcd at {server.endpoint} (pid {server.pid})")
    return server.endpoint


def _wait(cluster: LocalCluster, console: Console, timeout_s: float) -> dict[str, int | None]:
    deadline = time.monotonic() + timeout_s
    reported: set[str] = set()
    while time.monotonic() < deadline:
        console.poll()
        running = [node for node in cluster.nodes if node.running]
        for node in cluster.nodes:
            if node not in running and node.name not in reported:
                reported.add(node.name)
                if running:  # the others train on: say so as it happens; the summary has the rest
                    console.note(f"{node.name}: agent exited {node.returncode}")
        if not running:
            break
        time.sleep(_POLL_S)
    return {node.name: node.returncode for node in cluster.nodes}


def _interrupt(signum: int, frame: FrameType | None) -> None:
    for other in (*_STOPPING, signal.SIGINT):  # a second signal must not cut the nodes' stop short
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)  # unwinds through every finally: the nodes and the embedded etcd stop


def main(argv: Sequence[str] | None = None) -> int:
    """``elastic-ddp launch ARGS`` (also ``python -m elastic_ddp.launcher ARGS``)."""
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=(__doc__ or "").split("\n\n", 1)[1])
    add_arguments(parser)
    args = parser.parse_args(argv)
    for stopping in (*_STOPPING, signal.SIGINT):  # SIGINT too: a shell's background job inherits it ignored
        signal.signal(stopping, _interrupt)
    try:
        return launch(args)
    except ElasticDDPError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
        try:
            print(f"{PROG}: interrupted ({signal.Signals(signum).name}); every process it started was stopped",
                  file=sys.stderr, flush=True)
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        return 128 + signum
