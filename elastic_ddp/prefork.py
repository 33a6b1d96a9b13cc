"""Warm worker starts: a per-node fork server that imports torch once for every worker generation.

A restart after a failure or a membership change starts every worker anew, and on a small
machine most of that is Python importing torch (2-3 s) and the first optimizer importing
``torch._dynamo`` (about 2 s more). Run the training script through this module and only the
first generation on a node pays for it::

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_ddp.prefork examples/train.py --max-steps 1000

Each worker torchrun starts is then a small *launcher* (no torch import) that asks the node's
*fork server* for a worker. The first launcher of an agent starts the server: a process of
its own session that imports torch, ``torch._dynamo`` and the runtime (plus the modules named in
``ELASTIC_DDP_PREFORK_PRELOAD``, comma-separated) and then forks one child per request. The child
takes over the launcher's stdin/stdout/stderr, working directory, environment and argv and
runs the script as ``__main__``.

Process semantics, as torchrun and a user see them:

- The launcher is the worker to torchrun: its pid, its exit status (the child's exit code, or
  the same signal when the child was killed by one).
- SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 and SIGCONT sent to the launcher are forwarded to
  the child. When the launcher dies, even by SIGKILL, the child kills itself at once (it
  watches a pipe only the launcher holds open), so ``kill -9`` of a worker works as before.
  SIGSTOP cannot be forwarded: stopping the launcher does not stop the child.
- The server serves one agent (keyed by the agent's pid, the interpreter and the script) and
  exits as soon as that agent does. If it cannot be reached or started, the launcher logs why
  and runs the script in its own process instead: slower, never wrong.
- A worker's parent is the server; :func:`agent_pid` (``ELASTIC_DDP_AGENT_PID``) names its agent.
- Under ``elastic-ddp launch`` the launcher dies with its agent (a parent-death signal,
  :mod:`elastic_ddp.lifeline`), so the child dies with it; the server exits when the agent does,
  also while it is still importing.
- Children are forked before any CUDA or process-group initialisation (the server touches
  neither); each one re-seeds Python's ``random`` as a fresh interpreter would.

Linux only (abstract unix sockets, ``pidfd_open``).
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.distributed.elastic.multiprocessing.errors",
           "elastic_ddp.entry")
"""What the server imports before it forks anything."""
PRELOAD_ENV = "ELASTIC_DDP_PREFORK_PRELOAD"
"""More modules for the server to import, comma-separated (the script's heavy dependencies)."""
AGENT_PID_ENV = "ELASTIC_DDP_AGENT_PID"
"""Set in a forked worker's environment: the pid of its torchrun agent, which is not its parent."""
START_TIMEOUT_S = 120.0
"""How long a launcher waits for a server it started to accept (the server imports torch first)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
_STDIO = 3
"""A request passes stdin, stdout, stderr and then the lifeline's read end."""
_MAX_REQUEST = 1 << 20


def _log(message: str) -> None:
    print(f"elastic_ddp.prefork[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


# -- wire format: length-prefixed JSON, file descriptors alongside the request --------------


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    data = struct.pack("!I", len(body)) + body
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict:
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > _MAX_REQUEST:
        raise ConnectionError(f"message of {size} bytes is too large")
    return json.loads(_recv_exact(sock, size))


def _recv_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """A request and the fds sent with its first bytes (stdin, stdout, stderr, lifeline)."""
    head, fds, _, _ = socket.recv_fds(sock, 4, _STDIO + 1)
    if len(head) < 4:
        head += _recv_exact(sock, 4 - len(head))
    (size,) = struct.unpack("!I", head)
    if size > _MAX_REQUEST or len(fds) != _STDIO + 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"malformed request ({size} bytes, {len(fds)} fds)")
    return json.loads(_recv_exact(sock, size)), fds


# -- launcher ---------------------------------------------------------------------------------


def server_address(agent_pid: int, script: str, preload: str | None = None) -> str:
    """The abstract socket name of the server for this agent, interpreter, script and preload list
    (default: ``ELASTIC_DDP_PREFORK_PRELOAD`` of this process)."""
    preload = os.environ.get(PRELOAD_ENV, "") if preload is None else preload
    key = "\0".join([sys.executable, os.path.realpath(script), preload])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"\0elastic-ddp-prefork-{os.getuid()}-{agent_pid}-{digest}"


def torchrun_worker_script(argv: Sequence[str] | None = None) -> str | None:
    """The script that this process, a torchrun agent, runs through ``-m elastic_ddp.prefork``
    (``argv``: its command line, default ``sys.argv``); ``None`` for another program or script.

    The etcd-v3 rendezvous starts the node's fork server with it before the node first joins (see
    :func:`wait_until_warm`), instead of the first launcher after the rendezvous."""
    argv = sys.argv if argv is None else argv
    program = os.path.realpath(argv[0]) if argv else ""
    if os.path.basename(program) != "torchrun" and not program.endswith(os.path.join("torch", "distributed", "run.py")):
        return None
    from torch.distributed.run import get_args_parser  # an agent imported torch already; a launcher never gets here

    try:
        args = get_args_parser().parse_args(list(argv[1:]))  # what torchrun itself parsed, so no error
    except SystemExit:
        return None
    if args.module and not args.no_python and args.training_script == "elastic_ddp.prefork" and args.training_script_args:
        return args.training_script_args[0]
    return None


def warming_address(agent_pid: int) -> str:
    """The abstract socket a server of ``agent_pid`` listens on while it imports, and closes once warm."""
    return f"\0elastic-ddp-prefork-{os.getuid()}-{agent_pid}-warming"


def wait_until_warm(agent_pid: int, timeout: float) -> float | None:
    """Wait while a fork server of ``agent_pid`` imports what workers need; the seconds waited, or
    ``None`` at once when none is importing (none started, or it is warm already).

    The agent's rendezvous calls this before it joins, so that a node which joins a running job
    does not stop the others while its first worker waits for the server's imports. The server
    closes its warming socket once its imports are done, or fails, or dies: every way out wakes
    this call. After ``timeout`` it returns anyway (the first worker then waits as before)."""
    sock = _connect(warming_address(agent_pid))
    if sock is None:
        return None
    began = time.monotonic()
    with sock:
        sock.settimeout(timeout)
        try:
            sock.recv(1)  # never answered: the server closes the listener and this connection is reset
        except OSError:
            pass
    return time.monotonic() - began


def start_server(agent_pid: int, script: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the fork server for ``agent_pid``'s workers running ``script``; returns at once. The
    process returned exits as soon as the server listens (on its address and, while it imports,
    on its warming socket) and has detached from it, or found another server there; a thread
    reaps it. So the server is not the caller's child, and once the process has exited,
    :func:`wait_until_warm` sees the server.

    The first launcher of an agent calls this when it finds no server. Whoever starts the agent
    may call it right after (``chaos.cluster`` does), so that the server's imports overlap the
    agent's first rendezvous; a second server for the same agent exits at once.
    The server holds none of the caller's files (a pipe it held would never see EOF)."""
    env = dict(os.environ if env is None else env)
    address = server_address(agent_pid, script, env.get(PRELOAD_ENV, ""))
    process = subprocess.Popen(
        [sys.executable, "-u", "-m", "elastic_ddp.prefork", "--serve", address[1:], str(agent_pid), script],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    threading.Thread(target=process.wait, name="prefork-reaper", daemon=True).start()
    return process


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        return sock
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None


def connect_or_start(address: str, agent_pid: int, script: str) -> socket.socket:
    """A connection to the server, starting it first when there is none. The server binds
    before it imports anything, so connections queue until it accepts."""
    sock = _connect(address)
    if sock is not None:
        return sock
    start_server(agent_pid, script)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        sock = _connect(address)
        if sock is not None:
            return sock
        time.sleep(0.02)
    raise TimeoutError(f"no fork server answered within {START_TIMEOUT_S:.0f} s")


def launch(argv: list[str]) -> int:
    """Run ``argv`` (script and its arguments) in a child of the node's fork server; its exit status."""
    from elastic_ddp.lifeline import die_with_agent

    die_with_agent()  # under elastic-ddp launch: this launcher, and through its lifeline the worker, die with the agent
    script = argv[0]
    agent_pid = os.getppid()
    try:
        sock = connect_or_start(server_address(agent_pid, script), agent_pid, script)
    except OSError as exc:
        _log(f"fork server unavailable ({exc}); running {script} in this process")
        return _exec_directly(argv)
    lifeline_read, lifeline_write = os.pipe()
    try:
        env = {**os.environ, AGENT_PID_ENV: str(agent_pid)}
        _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": env}, [0, 1, 2, lifeline_read])
        answer = _recv(sock)
    except (OSError, ValueError) as exc:
        answer = {"error": str(exc)}
    finally:
        os.close(lifeline_read)
    if "pid" not in answer:
        _log(f"fork server refused the request ({answer.get('error')}); running {script} in this process")
        sock.close()
        os.close(lifeline_write)
        return _exec_directly(argv)
    child = answer["pid"]
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: _forward(child, signum))
    try:
        status = _recv(sock)
    except (OSError, ValueError) as exc:
        _log(f"lost the fork server while worker {child} ran ({exc}); stopping it")
        return 1  # exiting closes the lifeline: the child kills itself
    if "signal" in status:
        _die_by(status["signal"])
    return int(status["code"])


def agent_pid() -> int:
    """The pid of this worker's torchrun agent: its parent, or its launcher's under prefork."""
    return int(os.environ.get(AGENT_PID_ENV) or os.getppid())


def agent_identity() -> str:
    """This worker's torchrun agent as one process, not only a pid: its pid and start time. The same for every
    worker group the agent starts (restarts and re-formations alike); another for a new launch."""
    import psutil  # only workers ask; the agent and the launchers import this module too

    pid = agent_pid()
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        return str(pid)
    return f"{pid}-{started:.3f}"


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _die_by(signum: int) -> None:
    """End this process by ``signum``, so the agent sees what the child saw."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not fatal


def _exec_directly(argv: list[str]) -> int:
    unbuffered = ["-u"] if getattr(sys.stdout, "write_through", False) else []  # as torchrun started this launcher
    os.execv(sys.executable, [sys.executable, *unbuffered, *argv])
    return 1  # not reached


# -- server -------------------------------------------------------------------------------------


def serve(address: str, agent_pid: int) -> int:
    """Accept requests until the agent exits; one forked child per request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + address)
    except OSError:  # another launcher of the same agent started one first
        return 0
    listener.listen(64)
    try:
        agent = os.pidfd_open(agent_pid)
    except ProcessLookupError:
        return 0
    warming = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        warming.bind(warming_address(agent_pid))
        warming.listen(8)
    except OSError:  # a server of the same agent for another script is importing too; it tells
        pass
    if os.fork():  # detach once listening: the process started exits (start_server), the server is nobody's
        os._exit(0)  # child (an agent's children are its workers, to torchrun and to tools)
    failure = _while_agent_lives(agent, _preload)
    warming.close()  # wakes the agent's rendezvous if it waits (wait_until_warm)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(agent, selectors.EVENT_READ, "agent")
    while True:
        for key, _ in selector.select():
            if key.data == "agent":
                return 0  # the agent is gone; its workers die with their launchers
            if key.data == "accept":
                conn, _ = listener.accept()
                if failure:
                    _refuse(conn, failure)
                else:
                    _start_child(conn, selector)
            else:
                _report_exit(key, selector)


def _while_agent_lives(agent: int, work: Callable[[], str]) -> str:
    """Run ``work`` with a thread that ends this process if the agent (pidfd ``agent``) exits meanwhile: the
    imports take seconds, and the server must not outlive an agent killed by then. The thread is gone when
    this returns, so the server forks its workers single-threaded."""
    stop_read, stop_write = os.pipe()

    def watch() -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(agent, selectors.EVENT_READ, "agent")
            selector.register(stop_read, selectors.EVENT_READ, "stop")
            if any(key.data == "agent" for key, _ in selector.select()):
                os._exit(0)

    watcher = threading.Thread(target=watch, name="prefork-agent-watch", daemon=True)
    watcher.start()
    try:
        return work()
    finally:
        os.write(stop_write, b"x")
        watcher.join()
        os.close(stop_read)
        os.close(stop_write)


def _preload() -> str:
    """Import what every worker needs; what went wrong, or ``""``."""
    extra = [name.strip() for name in os.environ.get(PRELOAD_ENV, "").split(",") if name.strip()]
    for name in (*PRELOAD, *extra):
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 - told to every launcher, which then runs without us
            return f"preloading {name} failed: {exc!r}"
    from elastic_ddp.config import build_parser

    build_parser()  # reads the runtime's field docs from source once, here, instead of in every worker
    return ""


def _refuse(conn: socket.socket, failure: str) -> None:
    try:
        _, fds = _recv_request(conn)
        for fd in fds:
            os.close(fd)
        _send(conn, {"error": failure})
    except (OSError, ValueError):
        pass
    conn.close()


def _start_child(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    try:
        request, fds = _recv_request(conn)
    except (OSError, ValueError) as exc:
        _log(f"dropped a malformed request: {exc}")
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        _drop_server_files(selector)
        conn.close()
        _run_child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": pid})
    except OSError:
        pass  # the launcher is gone; the child notices through its lifeline
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ, (pid, conn))


def _drop_server_files(selector: selectors.BaseSelector) -> None:
    """(Forked child) close the server's listener, pidfds and other launchers' connections."""
    for key in list(selector.get_map().values()):
        if isinstance(key.data, tuple):  # a running child's pidfd and its launcher's connection
            os.close(key.fd)
            key.data[1].close()
        elif isinstance(key.fileobj, socket.socket):
            key.fileobj.close()
        else:
            os.close(key.fd)
    selector.close()


def _report_exit(key: selectors.SelectorKey, selector: selectors.BaseSelector) -> None:
    pid, conn = key.data
    selector.unregister(key.fd)
    os.close(key.fd)
    _, status = os.waitpid(pid, 0)
    message = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"code": os.waitstatus_to_exitcode(status)}
    try:
        _send(conn, message)
    except OSError:
        pass
    conn.close()


def _run_child(request: dict, fds: list[int]) -> None:
    """(Forked child) become the worker the launcher asked for and run its script."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds[:_STDIO]):
            os.dup2(fd, target)
            os.close(fd)
        _watch_lifeline(fds[_STDIO])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_script(request["argv"])
    except BaseException:  # noqa: BLE001 - a child must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        _flush()
        os._exit(code)


def _watch_lifeline(fd: int) -> None:
    """Kill this process when the launcher's end of ``fd`` closes (the launcher died or exited)."""
    import threading

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="prefork-lifeline", daemon=True).start()


def _run_script(argv: list[str]) -> int:
    import atexit
    import random
    import runpy

    random.seed()  # a fresh interpreter seeds from the OS; a fork would share the server's state
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - reported as Python would, then the same exit status
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        address, agent_pid = argv[1], int(argv[2])
        return serve(address, agent_pid)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
