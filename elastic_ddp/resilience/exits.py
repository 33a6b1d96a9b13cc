"""Why a worker exits, and the exit status that makes torchrun's agent do the right thing.

===================  ======  ==============================================================
reason               status  what the agent does
===================  ======  ==============================================================
``done``             0       the run reached --max-steps/--max-epochs; the agent finishes
``preempted``        0       this rank was asked to stop (SIGTERM/SIGINT or a spot notice),
                             saved, and leaves; its agent ends (it was signalled, or it sees
                             its workers succeed) and the node leaves the job
``peer-lost``        75      a peer was preempted: this rank saved with it and exits with a
                             failure status, so its agent restarts the worker group and
                             re-rendezvouses with whoever is still there; also a peer that
                             died during a collective (its connection closed): one line
                             here, the cause is in that peer's log
``hang:<phase>``     76      the watchdog saw no progress in <phase> for too long; stacks are
                             in the log; the agent restarts the group from the last checkpoint
``divergence``       77      ranks disagreed on the parameters; the agent restarts the group
``save-deadline``    78      an emergency save did not finish within its deadline; the
                             previous checkpoint stays the newest committed one
``config``           2       a configuration the runtime refused before training (one line
                             naming the flag or the script's mistake); the agent restarts the
                             group, which fails the same way, so fix it
``error``            1       any other failure (a storage error, a broken contract, a bug)
===================  ======  ==============================================================

A restart consumes one of torchrun's ``--max-restarts``: give an elastic job enough of them
for the failures and departures it should survive.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import time

from elastic_ddp.events import Event, EventLog
from elastic_ddp.job_end import JobEnd, tell_agent
from elastic_ddp.prefork import agent_pid

logger = logging.getLogger(__name__)

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo's transport says when the other end of a collective's connection has gone: only a fast path
(:func:`peer_loss`); tests/unit/test_compat.py checks that gloo still says it."""
_NCCL_PEER_GONE = ("remote process exited or there was a network error", "ncclRemoteError",
                   "NCCL communicator was aborted")
"""What NCCL (``ncclGetErrorString(ncclRemoteError)`` and its name) and torch's NCCL process group (a communicator
its watchdog aborted after a remote error or the collective timeout, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) say
when a collective's peer is gone or never came."""
_DEVICE_FAULT = ("CUDA error", "ECC error", "illegal memory access", "device-side assert")
"""Words of a device fault: an aborted communicator whose reason is one of these is not a peer's loss (the
process's CUDA context cannot be trusted; it restarts)."""


def peer_loss(exc: BaseException) -> str | None:
    """A one-line account of ``exc`` when gloo's or NCCL's own words say a peer died (or, for NCCL, the communicator
    was aborted for it) during a collective, else None. A fast path only: what decides a lost peer is the control
    plane (:mod:`elastic_ddp.resilience.group`; in the in-process mode, :meth:`Generations.lost_member`)."""
    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    if any(marker in text for marker in _PEER_GONE) or (
            any(marker in text for marker in _NCCL_PEER_GONE) and not any(fault in text for fault in _DEVICE_FAULT)):
        return f"a peer left during a collective ({text.splitlines()[0][:300]})"
    return None


class ExitReason(str, enum.Enum):
    """Why a worker exits (the table in this module's docstring); :attr:`status` is its exit status."""

    DONE = "done"
    PREEMPTED = "preempted"
    PEER_LOST = "peer-lost"
    HANG = "hang"
    DIVERGENCE = "divergence"
    SAVE_DEADLINE = "save-deadline"
    CONFIG = "config"
    ERROR = "error"

    @property
    def status(self) -> int:
        return _STATUS[self]

    def label(self, phase: str = "") -> str:
        """The reason as the ``exit`` event and the log line write it: ``hang:<phase>`` for a hang in a phase."""
        return f"{self.value}:{phase}" if phase else self.value


_STATUS = {
    ExitReason.DONE: 0,
    ExitReason.PREEMPTED: 0,
    ExitReason.PEER_LOST: 75,
    ExitReason.HANG: 76,
    ExitReason.DIVERGENCE: 77,
    ExitReason.SAVE_DEADLINE: 78,
    ExitReason.CONFIG: 2,
    ExitReason.ERROR: 1,
}


def log_exit(reason: ExitReason, detail: str = "", events: EventLog | None = None, error: str = "", phase: str = "") -> int:
    """Log the one line that says why this worker exits, and write its ``exit`` event (with ``error``, the
    message of the error that ended it, logged before on its own line); return its exit status. ``phase``:
    where a hang was seen."""
    code, label = reason.status, reason.label(phase)
    logger.log(logging.INFO if code == 0 else logging.ERROR, "exit: reason=%s status=%d%s", label, code,
               f" ({detail})" if detail else "")
    if events is not None:
        events.emit(Event.EXIT, reason=label, status=code, detail=detail, **({"error": error} if error else {}))
    return code


def tell_the_agent(reason: ExitReason, message: str) -> None:
    """What this worker's agent learns of an error that ends it: the error file (:func:`write_error_file`), and for
    a configuration mistake a job-end record (:mod:`elastic_ddp.job_end`), so the job ends instead of restarting."""
    write_error_file(reason.value, message)
    if reason is ExitReason.CONFIG:
        rank = os.environ.get("RANK", "0")
        one_line = " ".join(line.strip() for line in message.strip().splitlines())
        tell_agent(JobEnd(reason.value, reason.status, one_line, int(rank) if rank.isdigit() else 0))


def write_error_file(reason: str, message: str) -> None:
    """Record the failure where torchrun's agent looks for it (TORCHELASTIC_ERROR_FILE), so its
    failure summary shows this message for this rank instead of <N/A>."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    body = {"message": {"message": f"{reason}: {message}", "extraInfo": extra}}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(body, handle)
    except OSError as exc:  # the agent then shows <N/A>; the log line above still says why
        logger.warning("could not write the error file %s: %s", path, exc)


def leave_job(stop_source: str | None) -> None:
    """Make this node's torchrun agent leave the job after a spot notice, without ending the job.

    An agent whose workers all exit 0 treats the job as finished and closes the rendezvous for
    every node; an agent that dies of SIGTERM does not (torchrun keeps the rendezvous open then,
    so the others can re-form). After a SIGTERM the agent already got its own; after a spot
    notice, local rank 0 sends it, so the node leaves the way a terminated instance would.
    """
    if stop_source != "spot-notice" or os.environ.get("LOCAL_RANK") != "0" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = agent_pid()
    logger.info("leaving the job: sending SIGTERM to this node's torchrun agent (pid %d)", agent)
    os.kill(agent, signal.SIGTERM)
