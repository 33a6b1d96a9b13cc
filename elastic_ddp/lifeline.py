"""Every process ``elastic-ddp launch`` starts dies with it, however the launcher ends (``kill -9`` included).

The launcher's own children (the nodes' torchrun agents, the embedded etcd) start as
``python -m elastic_ddp.lifeline --parent PID COMMAND...`` (:func:`tied_to_this_process`): that small process
takes SIGKILL as its parent-death signal, ends at once if its parent is already gone, and then replaces itself
with the command (``execv`` keeps the signal; the pid is the one the launcher started). Linux sends the signal
when the launcher's thread that started them ends, so they are started from its main thread. (A ``preexec_fn``
would do the same without the extra exec, but is unsafe in a process with threads.) The fork servers detach
from whoever starts them and exit with their agent.

The processes further down are started by torchrun's agents, which the launcher cannot wrap; the launcher
names itself in their environment instead (:data:`LAUNCHER_PID_ENV`, inherited by
everything the agent starts) and each worker takes the signal for itself at its start (:func:`die_with_agent`):

- under ``-m elastic_ddp.prefork`` (the launcher's default) the worker torchrun starts is the prefork launcher,
  which calls :func:`die_with_agent` first; the forked worker dies with it through its lifeline pipe, and the
  fork server exits once the agent is gone, also while it is still importing torch;
- with ``--no-prefork`` the launcher runs the script through ``-m elastic_ddp.lifeline SCRIPT ARGS``, which calls
  it and then replaces itself with the script (``execv`` keeps both the pid torchrun watches and the signal).

The kill thus goes down the tree one level at a time: launcher, agent, worker; a worker's DataLoader processes
exit once they see their parent gone (torch checks every few seconds). A worker whose agent was already gone
before it could take the signal finds the launcher gone too and exits at once.

Linux only; elsewhere the calls do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID_ENV = "ELASTIC_DDP_LAUNCHER_PID"
"""Set by ``elastic-ddp launch`` in every node's environment: its pid. A worker that sees it dies with its agent."""
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when the thread that created it ends; whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tied_to_this_process(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGKILL when the calling thread of this process ends (see the docstring)."""
    return [sys.executable, "-m", "elastic_ddp.lifeline", "--parent", str(os.getpid()), *command]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_agent(environ: dict[str, str] | None = None) -> bool:
    """In a process a torchrun agent started for ``elastic-ddp launch``: take SIGKILL as this process's parent-death
    signal, and end at once if the launcher is already gone (its agent may have died before the signal was set).
    Does nothing outside such a launch; whether it took."""
    value = (os.environ if environ is None else environ).get(LAUNCHER_PID_ENV, "")
    if not value.isdigit():
        return False
    taken = set_parent_death_signal(signal.SIGKILL)
    if not _alive(int(value)):
        os._exit(128 + signal.SIGKILL)
    return taken


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic_ddp.lifeline --parent PID COMMAND...``: die with PID, then become COMMAND.
    ``python -m elastic_ddp.lifeline SCRIPT ARGS...``: :func:`die_with_agent`, then become ``python SCRIPT ARGS``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--parent" and len(argv) > 2 and argv[1].isdigit():
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != int(argv[1]):  # the parent died before the signal was set
            os._exit(128 + signal.SIGKILL)
        os.execvp(argv[2], argv[2:])
    die_with_agent()
    sys.stdout.flush()
    sys.stderr.flush()
    unbuffered = ["-u"] if getattr(sys.stdout, "write_through", False) else []  # as torchrun started this process
    os.execv(sys.executable, [sys.executable, *unbuffered, *argv])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
