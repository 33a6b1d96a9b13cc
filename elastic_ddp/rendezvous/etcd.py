"""``etcd-v3``: torch's dynamic rendezvous over the etcd v3 API, registered for torchrun (docs/design.md, "Rendezvous").

Use::

    torchrun --nnodes=1:8 --rdzv-backend=etcd-v3 \\
        --rdzv-endpoint=etcd1:2379,etcd2:2379,etcd3:2379 --rdzv-id=job42 \\
        --rdzv-conf=join_timeout=300,cacert=/etc/etcd/ca.pem,user=train,password=... train.py

torchrun finds :func:`handler_factory` through the ``torchrun.handlers`` entry point
``etcd-v3`` (torch's own ``etcd``/``etcd-v2`` speak the v2 API, which etcd 3.6 no
longer serves; an out-of-tree handler may not reuse a built-in name). The handler is
torch's ``DynamicRendezvousHandler`` with :class:`EtcdRendezvousBackend` holding the
state and :class:`~elastic_ddp.rendezvous.store.EtcdStore` as the agents' store, and two
additions: every worker-group attempt gets a fresh worker store
(:func:`use_fresh_worker_store`), and a node that the round dropped while it was cut off
from etcd re-joins instead of training on beside it (:class:`EtcdRendezvousHandler`).
``--rdzv-conf`` keys are listed in :mod:`elastic_ddp.rendezvous.settings`.

Keys (``<p>`` = ``key_prefix``, default ``/elastic_ddp/rdzv/``)::

    <p><run_id>/state        the rendezvous state, CAS on its mod revision
    <p><run_id>/store/...    the agents' store (torch adds a per-round prefix)

Why the agents' store lives in etcd, not in a TCPStore
------------------------------------------------------
torch's ``c10d`` backend hosts a TCPStore on the ``--rdzv-endpoint`` machine, and
the ``DynamicRendezvousHandler`` of recent torch (2.13 here) by default makes the rank-0
*agent* host a second TCPStore that the *workers* use (``use_agent_store``). The ``etcd-v3``
handler opts out (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see
:func:`use_fresh_worker_store`): each round, rank 0's *worker* hosts the workers' TCPStore on
a port published through the agents' store. The store returned by
:func:`create_backend` is therefore only the agents' store: a handful of operations
per rendezvous round (publish and read ``MASTER_ADDR``/``MASTER_PORT``, one
``set`` + ``multi_get``/``multi_set`` + blocking ``get`` for rank assignment, an
``add``/``wait`` exit barrier). Workers never touch it, so its latency is not on
any training path.

A TCPStore for the agents would have to be hosted by one agent chosen before the
store exists, and would die with that agent's node: the next round, which happens
exactly because a node went away, would lose its store. etcd is already the
fault-tolerant component of the job, so the store lives there, next to the state.

An agent makes about eight store calls per round (``RendezvousStoreInfo.build`` and
``_assign_worker_ranks``), each an etcd round trip: milliseconds against the seconds that
``last_call_timeout`` and worker start-up take (docs/performance.md has the latencies,
``python -m tests.fixtures.store_latency``). The workers' process-group traffic stays on a TCPStore, at
TCPStore speed.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import subprocess
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.events.handlers import get_logging_handler
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandlerCreator,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)

from elastic_ddp import prefork
from elastic_ddp.rendezvous import reach
from elastic_ddp.rendezvous._torch_compat import (  # torch's private names, checked on import
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousState,
)
from elastic_ddp.rendezvous.client import Absent, EtcdClient, GrpcEtcdClient, ModRevisionIs
from elastic_ddp.rendezvous.errors import EtcdConnectionError, EtcdRendezvousError, EtcdStateError
from elastic_ddp.rendezvous.lease import LeaseKeeper
from elastic_ddp.rendezvous.settings import EtcdRendezvousSettings
from elastic_ddp.rendezvous.store import EXIT_BARRIER_COUNT, EXIT_BARRIER_DONE, EtcdStore

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
_FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_STATE_MAGIC = b"elastic_ddp.rdzv.v1:"
_CRC_HEX = re.compile(rb"[0-9a-f]{8}")
_TORCH_SYNC_INTERVAL_S = 1.0  # how long torch's rendezvous loop sleeps before it reads the state again
_LAST_CALL_MARGIN_S = 0.005  # wake just after the last call's end, not just before it
_WAKE_COALESCE_S = 0.01  # after a watch fired: let the writes of a burst land, then read once
LEAVE_TIMEOUT_S = 5.0
"""The most an exiting agent spends taking its node out of the round (etcd may be unreachable)."""


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, updated by compare-and-swap on its mod revision.

    The fencing token is the key's ``mod_revision``; each successful
    :meth:`set_state` is one etcd transaction and yields a new, larger token.
    The key is attached to this participant's lease, which is refreshed at most every tenth
    of its TTL: a write is one etcd transaction, which matters when many nodes compete to
    write (every failed compare-and-swap is retried at once by torch's handler).

    Args:
        client: the etcd client.
        key: the etcd key holding the state.
        leases: the lease the state is written under.
    """

    def __init__(self, client: EtcdClient, key: str, leases: LeaseKeeper) -> None:
        self._client = client
        self._key = key.encode()
        self._leases = leases
        self._seen_revision = 0
        """The newest revision of the state key this process read or wrote (any thread)."""
        self._quick = threading.local()
        """This thread's bound on a read of the state (:meth:`reads_within`); unset: ``read_timeout``."""

    @contextmanager
    def reads_within(self, timeout: float) -> Iterator[None]:
        """Within the block, this thread's reads of the state give up after ``timeout`` seconds
        (:class:`EtcdConnectionError`) instead of riding out an outage for ``read_timeout``."""
        self._quick.timeout = timeout
        try:
            yield
        finally:
            self._quick.timeout = None

    def wait_for_change(self, timeout: float) -> bool:
        """Block until the state is written after the newest revision this process has seen (True),
        or ``timeout`` seconds pass (False). An etcd that does not answer is no change (False, after
        at most ``timeout``): the read that follows rides out an outage up to ``read_timeout``."""
        started = time.monotonic()
        if self._seen_revision > 0:
            try:
                return self._client.wait_for_put(self._key, self._seen_revision, timeout)
            except EtcdConnectionError:
                pass
        time.sleep(max(0.0, timeout - (time.monotonic() - started)))
        return False

    def _saw(self, revision: int) -> int:
        self._seen_revision = max(self._seen_revision, revision)
        return revision

    @property
    def name(self) -> str:
        """``etcd-v3``; torch requires it to equal the registered backend name."""
        return BACKEND_NAME

    @property
    def key(self) -> str:
        """The etcd key of the state."""
        return self._key.decode()

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its token, or ``None`` when no state exists.

        Raises:
            RendezvousConnectionError: etcd was unreachable (``EtcdConnectionError``).
            RendezvousStateError: the key holds something this backend did not write.
        """
        current = self._client.get(self._key, timeout=getattr(self._quick, "timeout", None))
        if current is None:
            return None
        return self._decode(current.value), self._saw(current.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is still current (``None``: if no state exists).

        Returns ``(state, new_token, True)`` on success, ``(current_state,
        current_token, False)`` when the token is stale or invalid, and ``None``
        when the token is stale and the state has vanished meanwhile.

        The token is checked with a read before the compare-and-swap: etcd puts every
        transaction that may write through raft and fsyncs it, even when its compare then
        fails, and when many nodes join at once most attempts carry a stale token (torch's
        handler retries each failed one at once). A read is served without a log write.
        """
        revision = None if token is None else _as_revision(token)
        if token is not None and revision is None:
            return self._current_state_not_written()
        current = self._client.get(self._key, timeout=getattr(self._quick, "timeout", None))
        if (None if current is None else current.mod_revision) != revision:
            return None if current is None else (self._decode(current.value), self._saw(current.mod_revision), False)
        condition = Absent() if revision is None else ModRevisionIs(revision)
        payload = _encode_state(state)
        outcome = self._leases.write(lambda lease: self._client.put_if(self._key, payload, condition, lease))
        if outcome.succeeded:
            return state, self._saw(outcome.revision), True
        if outcome.current is None:
            return None
        return self._decode(outcome.current.value), self._saw(outcome.current.mod_revision), False

    def _current_state_not_written(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        return None if current is None else (*current, False)

    def _decode(self, payload: bytes) -> bytes:
        try:
            return _decode_state(payload)
        except ValueError as exc:
            raise EtcdStateError(
                "the rendezvous state at etcd key %s (endpoints %s) is corrupt: %s; delete the key "
                "or use another --rdzv-id" % (self.key, ",".join(self._client.endpoints), exc)
            ) from exc


def _as_revision(token: Token) -> int | None:
    """The revision a token stands for, or ``None`` if it is not one this backend issued."""
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        return None
    return token


def _encode_state(state: bytes) -> bytes:
    """Frame ``state`` with a magic prefix and a CRC32, so foreign or damaged values are detected."""
    return _STATE_MAGIC + b"%08x:" % zlib.crc32(state) + state


def _decode_state(payload: bytes) -> bytes:
    """Inverse of :func:`_encode_state`; raises ``ValueError`` saying what is wrong."""
    if not payload.startswith(_STATE_MAGIC):
        raise ValueError("missing the %r header" % _STATE_MAGIC.decode())
    header, separator, state = payload[len(_STATE_MAGIC):].partition(b":")
    if not separator or not _CRC_HEX.fullmatch(header):
        raise ValueError("malformed checksum header")
    if zlib.crc32(state) != int(header, 16):
        raise ValueError("checksum mismatch (%d bytes of state)" % len(state))
    return state


def _record_event(
    owner: type, node: _NodeDesc, run_id: str, message: str, node_state: NodeState, rank: int | None = None
) -> None:
    """Record a rendezvous event as torch's ``_record`` methods do, named ``<owner>.<method that
    called _record>``, but only if events go anywhere (by default their handler is a
    ``NullHandler``) and without ``inspect.stack()``; see :class:`_OpExecutor`."""
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    construct_and_record_rdzv_event(
        name="%s.%s" % (owner.__name__, sys._getframe(2).f_code.co_name),
        run_id=run_id,
        message=message,
        node_state=node_state,
        hostname=node.addr,
        pid=node.pid,
        local_id=node.local_id,
        rank=rank,
    )


class _OpExecutor(_DistributedRendezvousOpExecutor):
    """torch's rendezvous operation executor, with two changes that cost it time.

    **Events.** torch names each event after the calling method with ``inspect.stack()``, twice,
    reading the source of every frame on the stack, and only then finds that no event handler is
    configured. The executor records about three events per pass of its loop, and it loops once
    per lost compare-and-swap: with 64 agents joining at once on two cores, that naming was three
    quarters of the agents' CPU time (py-spy) and made the rendezvous 3-5x slower. Here the name
    comes from the caller's frame, and only when events are recorded.

    **Waiting.** While a node waits (a participant for others or for the last call to end, a node
    on the wait list for the next round), torch re-reads the state once a second. So a round whose
    last call ends between two reads completes up to a second late, and a node that re-joins while
    the others still hold the old round (it goes on the wait list) joins the new round only at its
    next read: after a worker's death that was the whole last call again. Here a waiting node
    watches the state key (with the backend attached, see :attr:`backend`) and reads the state as
    soon as another node wrote it (after a short pause that lets a burst of writes land, so one read
    serves them all), and a participant's wait ends no later than the last call.

    **Closing early.** torch keeps a round open for the whole last call, whoever is still to come.
    After the job's first round, with :attr:`early_close`, a participant completes the round as
    soon as every live node has joined it (:func:`_may_close_early`): a re-formation after a
    preemption or a failure then costs no last call at all.
    """

    backend: EtcdRendezvousBackend | None = None
    """The state's backend, whose watch wakes a waiting node; without it, only the last call's end does."""
    early_close: bool = False
    """Whether a round after the first completes once every live node is a participant."""
    leaving: bool = False
    """Set by :meth:`EtcdRendezvousHandler.leave`: this node's exit operation is its last."""

    def _remove_from_participants(self) -> None:
        """See base class. torch's re-join runs an exit operation and then a join, and the exit drops the
        node's heartbeat: between the two, another node re-joining first would see every live node in
        the round and close it early without this one (which would then wait for a round of its own).
        So a node that exits to re-join keeps its heartbeat (torch still drops it if the node dies);
        only a node that leaves for good removes it."""
        super()._remove_from_participants()
        if not self.leaving:
            self._state.last_heartbeats[self._node] = datetime.now(timezone.utc)

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """See base class."""

        joining = isinstance(state_handler, _RendezvousJoinOp)

        def until_something_changes(ctx: _RendezvousContext, deadline: float) -> _Action:
            action = state_handler(ctx, deadline)
            while action == _Action.SYNC:
                if joining and self.early_close and _may_close_early(ctx):
                    self._record(f"The node '{self._node}' closes round {ctx.state.round} early: every live node joined")
                    return _Action.MARK_RENDEZVOUS_COMPLETE
                pause = _pause_until_last_call_ends(ctx.state)
                if self.backend is None:
                    if pause is None:
                        break  # torch's own one-second wait
                    time.sleep(pause)
                else:
                    limit = _TORCH_SYNC_INTERVAL_S if pause is None else pause
                    if self.backend.wait_for_change(max(0.0, min(limit, deadline - time.monotonic()))):
                        time.sleep(_WAKE_COALESCE_S)
                        if isinstance(self._state_holder, _BackendRendezvousStateHolder):
                            self._state_holder._last_sync_time = -1.0  # read now, not the cached state
                self._state_holder.sync()  # a read (or the cached state); completing it is a compare-and-swap
                self._state = self._state_holder.state
                ctx = _RendezvousContext(self._node, self._state, self._settings)
                action = state_handler(ctx, deadline)
            return action

        super().run(until_something_changes, deadline, update_deadline)

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        _record_event(_DistributedRendezvousOpExecutor, self._node, self._settings.run_id, message, node_state)


def _may_close_early(ctx: _RendezvousContext) -> bool:
    """Whether this participant may complete the open round now: it is not the job's first round,
    the round has ``min_nodes`` to ``max_nodes`` participants, no node waits for a later round or
    as a spare, and every node with a heartbeat (torch drops a node whose heartbeats stopped) is a
    participant. The first round waits its last call: nodes starting together start together."""
    state, settings = ctx.state, ctx.settings
    if state.round == 0 or state.complete or state.closed or state.deadline is None:
        return False
    if ctx.node not in state.participants or state.wait_list or state.redundancy_list:
        return False
    if not settings.min_nodes <= len(state.participants) <= settings.max_nodes:
        return False
    return all(node in state.participants for node in state.last_heartbeats)


def _job_nodes(state: _RendezvousState) -> set[_NodeDesc]:
    """The nodes of the job as the state shows them: the current round's participants, the nodes waiting
    for the next round or as spares, and every node with a heartbeat. Between two rounds the new one may
    have no participant yet while the old one's participants wait on torch's wait list, and a node that
    left a round to re-join keeps its heartbeat (:meth:`_OpExecutor._remove_from_participants`) but is in
    neither."""
    return {*state.participants, *state.wait_list, *state.redundancy_list, *state.last_heartbeats}


def _pause_until_last_call_ends(state: _RendezvousState) -> float | None:
    """Seconds until the open round's last call ends, if that is sooner than torch's next read
    (a second); ``None`` otherwise."""
    if state.complete or state.deadline is None:
        return None
    remaining = (state.deadline - datetime.now(timezone.utc)).total_seconds()
    if not 0 < remaining < _TORCH_SYNC_INTERVAL_S:
        return None
    return remaining + _LAST_CALL_MARGIN_S


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's ``DynamicRendezvousHandler``, plus: an agent that exits leaves the round at once,
    and a node that the round went on without re-joins.

    **Leaving.** torchrun's agent does not shut the rendezvous down when a signal ends it (that
    would close the rendezvous for every node), so a preempted node (SIGTERM, or a spot notice's
    SIGTERM from its own worker) stayed a participant until its heartbeats were older than
    ``keep_alive_interval * keep_alive_max_attempt``; the survivors' next round waited that long.
    At interpreter exit, unless :meth:`shutdown` ran, this handler takes its node out of the round
    (torch's own exit operation, which it runs before every re-join), bounded by
    :data:`LEAVE_TIMEOUT_S`. A node killed outright is still removed by the heartbeat rule.

    **Leaving as the job ends.** torchrun's agent waits in an exit barrier (up to 300 s) until
    every agent of the round has checked in, and an agent ended by a signal never gets there. So
    the exiting node checks in on its way out (before it leaves the round), unless its agent
    already did: a node preempted just after its workers finished does not hold the others. A
    check-in by a node that left mid-training is harmless: the survivors' next round has a barrier
    of its own.

    **etcd outages.** Workers never use etcd; only membership changes need it. While etcd does not
    answer, :meth:`num_nodes_waiting` (the agent's poll of a healthy group) reports no waiting
    node, with one warning per outage, instead of failing the agent and stopping a training job:
    the first poll of an outage gives up after ``connect_timeout`` (:meth:`_waiting_within`); later ones probe etcd for at most
    ``connect_timeout`` every ``keep_alive_interval``. :meth:`shutdown` (a finished job) gives
    up closing the rendezvous, with a warning, when etcd does not answer within ``connect_timeout``.

    **Unreachable nodes.** A node cut off from its peers but not from etcd keeps heartbeating, so
    every round would include it and forming the process group would wait for it. With
    ``reach_check`` (the default), every completed round is checked first (:mod:`.reach`): the
    nodes of a cut pair that the agents agree to leave out step out of the round and wait until
    they reach every other node of the job again (:func:`_job_nodes`), then re-join; the others
    re-form at once without them.

    **Re-joining.** torch removes a node from the round once its last heartbeat is older than
    ``keep_alive_interval * keep_alive_max_attempt``. A node whose heartbeats could not reach
    etcd that long (an etcd outage, a frozen agent) is removed although its workers still
    train, and torch's agent restarts them only when other nodes wait; the next node to join
    would then form a round, and a second job, of its own on the same checkpoints (seen with a
    10 s etcd outage and a 3 s window). Counting this node as waiting makes its agent stop its
    workers and re-join, so every node is again in one round.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._op_executor: _OpExecutor = _OpExecutor(self._this_node, self._state_holder, self._settings)
        self._shut_down = False
        self._etcd_store: EtcdStore | None = None
        self._outage_since: float | None = None
        self._last_probe = 0.0
        self._listener: reach.ProbeListener | None = None
        self._reach_timeout: float | None = None
        self._fork_server_started = False
        self._local_addr_given = True
        self._members: tuple[int, frozenset[_NodeDesc]] | None = None
        """The round this node trains in, and its participants (a peer missing from them later is gone)."""
        atexit.register(_leave_at_exit, weakref.ref(self))

    def attach(
        self, store: EtcdStore, backend: EtcdRendezvousBackend, early_close: bool = True,
        reach_timeout: float | None = None, local_addr_given: bool = True,
    ) -> None:
        """Give the handler the store and backend it was built on (torch's constructor takes both, but
        keeps them where neither this class's probes nor the operation executor can see them), the
        ``early_close`` setting (see :class:`_OpExecutor`), and the reachability check's timeout
        (``None``: no check; see the class docstring) and whether torchrun was given ``--local-addr``
        (the probe listener binds that address; without it, every interface)."""
        self._etcd_store = store
        self._op_executor.backend = backend
        self._op_executor.early_close = early_close
        self._reach_timeout = reach_timeout
        self._local_addr_given = local_addr_given

    def _probe_listener(self) -> reach.ProbeListener | None:
        """This agent's probe listener, opened at the first round of more than one node (a job of one node
        listens on nothing); ``None`` without the check or when this node's address cannot be bound."""
        if self._listener is None and self._reach_timeout is not None:
            try:
                # torchrun without --local-addr names this node by its FQDN, which may resolve to a
                # loopback address here (Debian's 127.0.1.1) and to the real one elsewhere: then
                # listen everywhere, as the workers' TCPStore does
                bind = self._this_node.addr if self._local_addr_given else ""
                self._listener = reach.ProbeListener(self._this_node.addr, bind=bind)
            except OSError as exc:
                logger.warning(
                    "etcd-v3: no reachability check: cannot listen on this node's address %s (%s); set "
                    "torchrun's --local-addr to the address the other nodes reach this one at", self._this_node.addr, exc,
                )  # fmt: skip
                self._reach_timeout = None
                return None
            if self._etcd_store is not None:  # where a node that stepped out finds it, whatever the round
                self._etcd_store.set(reach.NODE_KEY % _node_key(self._this_node), self._listener.address)
        return self._listener

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class; with the reachability check, a round is returned only once every pair of
        its nodes reaches each other (see the class docstring). A node whose fork server
        (:mod:`elastic_ddp.prefork`) is still importing joins once it is warm: joining earlier would
        stop a running job's workers until this node's first worker can start."""
        if not self._fork_server_started:
            self._fork_server_started = True
            script = prefork.torchrun_worker_script()
            if script is not None:  # started here, its imports overlap this agent's; else by the first launcher
                try:
                    prefork.start_server(os.getpid(), script).wait(timeout=prefork.START_TIMEOUT_S)  # until it listens
                except subprocess.TimeoutExpired:
                    pass  # not listening yet: the wait below may miss it, and the first worker waits instead
        warm_within = min(self._settings.timeout.join.total_seconds(), prefork.START_TIMEOUT_S)  # a launcher's patience
        warmed = prefork.wait_until_warm(os.getpid(), warm_within)
        if warmed is not None:
            logger.info("etcd-v3: joining rendezvous %s now that this node's fork server is warm (waited %.1f s)",
                        self._settings.run_id, warmed)
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            info = super().next_rendezvous()
            listener = self._probe_listener() if info.world_size > 1 else None
            if listener is None or self._reach_timeout is None:
                return self._training_in(info)
            left_out = reach.check_round(info.store, info.rank, info.world_size, listener, self._reach_timeout)
            if not left_out:
                return self._training_in(info)
            if info.rank in left_out:
                self._step_out(left_out, info.world_size)
                self._wait_until_reachable(deadline)
            else:
                logger.warning(
                    "etcd-v3: round %d of rendezvous %s leaves out agent rank(s) %s, which some node cannot reach; "
                    "re-forming without them", self._state_holder.state.round, self._settings.run_id, sorted(left_out),
                )  # fmt: skip

    def _training_in(self, info: RendezvousInfo) -> RendezvousInfo:
        state = self._state_holder.state
        self._members = (state.round, frozenset(state.participants))
        return info

    def _step_out(self, left_out: frozenset[int], world_size: int) -> None:
        """Leave the round as a node that the others must not wait for (no heartbeat), but not for good."""
        logger.warning(
            "etcd-v3: this node (%s) cannot reach every other node of round %d of rendezvous %s (agents %s of %d "
            "are left out); it steps out and re-joins once it reaches them all",
            self._this_node, self._state_holder.state.round, self._settings.run_id, sorted(left_out), world_size,
        )  # fmt: skip
        self._stop_heartbeats()
        self._op_executor.leaving = True
        try:
            self._op_executor.run(_RendezvousExitOp(), time.monotonic() + self._settings.timeout.join.total_seconds())
        finally:
            self._op_executor.leaving = False

    def _wait_until_reachable(self, deadline: float) -> None:
        """Return once this node reaches every other node of the job (:func:`_job_nodes`; at once when
        there is none); probe every ``keep_alive_interval``.

        Raises:
            RendezvousClosedError: the job ended meanwhile.
            RendezvousTimeoutError: still cut off after ``join_timeout``.
        """
        assert self._reach_timeout is not None and self._etcd_store is not None
        started = time.monotonic()
        while True:
            try:
                if isinstance(self._state_holder, _BackendRendezvousStateHolder):
                    self._state_holder._last_sync_time = -1.0  # read the state now, not torch's cached copy
                self._state_holder.sync()
                state = self._state_holder.state
                if state.closed:
                    raise RendezvousClosedError()
                others = sorted(_job_nodes(state) - {self._this_node}, key=str)
                if not others:
                    return
                keys = [_node_key(node) for node in others]
                addresses = reach.node_addresses(self._etcd_store, keys)
                reached = reach.probe(addresses, self._reach_timeout)
                if len(reached) == len(others):
                    logger.warning("etcd-v3: this node reaches the %d other node(s) of round %d again after %.1f s; "
                                   "re-joining", len(others), state.round, time.monotonic() - started)
                    return
                logger.debug("etcd-v3: round %d: cannot reach %s", state.round, sorted(set(keys) - reached))
            except EtcdConnectionError as exc:
                logger.info("etcd-v3: waiting to reach the other nodes; etcd does not answer: %s", exc)
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"etcd-v3: this node could not reach the other nodes of rendezvous {self._settings.run_id} within "
                    f"join_timeout ({self._settings.timeout.join.total_seconds():.0f} s)"
                )
            time.sleep(self._settings.keep_alive_interval.total_seconds())

    def shutdown(self) -> bool:
        """See base class (closes the rendezvous for every node: the job is over). Gives up, with a
        warning, when etcd does not answer within ``connect_timeout``."""
        self._shut_down = True
        store = self._etcd_store
        if store is not None and (store.exit_barrier_given_up or not store.answers()):
            # torch's stop joins the heartbeat thread, which may be waiting read_timeout on etcd
            stopper = threading.Thread(target=self._stop_heartbeats, name="etcd-v3-stop-heartbeats", daemon=True)
            stopper.start()
            stopper.join(store.probe_timeout)
            logger.warning(
                "etcd-v3: etcd did not answer within %s s at shutdown; rendezvous %s is not closed (its "
                "keys expire with their lease)", store.probe_timeout, self._settings.run_id,
            )  # fmt: skip
            return False
        return super().shutdown()

    def leave(self) -> None:
        """Take this node out of the current round, so the others re-form without waiting for its
        heartbeats to expire; check in at the round's exit barrier first (see the class
        docstring). Does nothing if it is not a participant (as last seen)."""
        state = self._state_holder.state
        if self._this_node not in state.participants:
            return
        self._stop_heartbeats()
        self._check_in_at_exit_barrier(state.round, len(state.participants))
        self._op_executor.leaving = True
        self._op_executor.run(_RendezvousExitOp(), time.monotonic() + LEAVE_TIMEOUT_S)
        logger.info("etcd-v3: node %s left rendezvous %s", self._this_node, self._settings.run_id)

    def _check_in_at_exit_barrier(self, round_: int, agents: int) -> None:
        if self._etcd_store is None:
            return
        prefix = _round_store_prefix(self._settings.run_id, round_)
        if any(key.startswith(prefix + "/") for key in self._etcd_store.exit_barrier_check_ins):
            return  # the agent got there itself
        store = dist.PrefixStore(prefix, self._etcd_store)
        if store.add(EXIT_BARRIER_COUNT, 1) == agents:
            store.set(EXIT_BARRIER_DONE, "<val_ignored>")

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        _record_event(DynamicRendezvousHandler, self._this_node, self._settings.run_id, message, node_state, rank)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round; at least 1 when this node is no longer in the round;
        0 while etcd does not answer (see the class docstring)."""
        if self._outage_since is not None and not self._etcd_back():
            return 0
        try:
            waiting = self._waiting_within(self._poll_timeout())
        except EtcdConnectionError as exc:
            self._outage_began(exc)
            return 0
        if self._outage_since is not None:
            logger.warning("etcd-v3: etcd answers again after %.1f s", time.monotonic() - self._outage_since)
            self._outage_since = None
        if waiting == 0 and (self._left_behind() or self._peer_gone()):
            return 1
        return waiting

    def _poll_timeout(self) -> float:
        """How long one poll may wait on etcd: ``connect_timeout``, as a probe during an outage."""
        store = self._etcd_store
        return store.probe_timeout if store is not None else self._settings.timeout.heartbeat.total_seconds()

    def _waiting_within(self, limit: float) -> int:
        """torch's ``num_nodes_waiting`` (sync the state, count its wait list) in about ``limit`` seconds at most.

        The agent polls this while its workers train, and a poll that lands as they exit delays the
        agent's exit by as long as it takes. So neither of its waits rides out an outage: not the
        heartbeat lock, which a heartbeat holds while its own write waits on etcd, nor the read.

        Raises:
            EtcdConnectionError: etcd did not answer within ``limit``.
        """
        if not self._heartbeat_lock.acquire(timeout=limit):
            raise EtcdConnectionError(f"a heartbeat has waited on etcd for over {limit:g} s")
        try:
            backend = self._op_executor.backend
            with backend.reads_within(limit) if backend is not None else nullcontext():
                self._state_holder.sync()
            return len(self._state_holder.state.wait_list)
        finally:
            self._heartbeat_lock.release()

    def _outage_began(self, exc: EtcdConnectionError) -> None:
        if self._outage_since is None:
            self._outage_since = self._last_probe = time.monotonic()
            logger.warning(
                "etcd-v3: etcd does not answer (%s); the workers train on, and membership changes "
                "wait until it answers", exc,
            )  # fmt: skip

    def _etcd_back(self) -> bool:
        """During an outage: whether a probe (at most every keep_alive_interval) got an answer."""
        now = time.monotonic()
        if self._etcd_store is None or now - self._last_probe < self._settings.keep_alive_interval.total_seconds():
            return False
        self._last_probe = now
        return self._etcd_store.answers()

    def _left_behind(self) -> bool:
        # torch exposes neither the participants nor this node's descriptor; both are read from
        # the state that super().num_nodes_waiting() has just synced.
        state = self._state_holder.state
        if self._this_node in state.participants:
            return False
        logger.warning(
            "etcd-v3: this node (%s) is no longer a participant of round %d of rendezvous %s: its "
            "heartbeats did not reach etcd for longer than keep_alive_interval*keep_alive_max_attempt "
            "(an etcd outage?); restarting the worker group to re-join",
            self._this_node, state.round, self._settings.run_id,
        )  # fmt: skip
        return True


    def _peer_gone(self) -> bool:
        """A peer of this node's round is no longer a participant: torch's heartbeat rule removed it (a node
        killed, frozen or cut off), or it left. A peer gone silently may leave this node's workers blocked in
        a collective that never fails (NCCL's; gloo's when the peer's connections stay open), and torch's
        agent restarts its workers only when they fail or other nodes wait. Counting a waiting node makes it
        stop them (their group watch abandons the blocked step) and re-form without the peer."""
        if self._members is None:
            return False
        round_, members = self._members
        state = self._state_holder.state
        if state.round != round_:
            return False  # a later round began: torch's own wait list speaks for it
        gone = members - state.participants.keys()
        if not gone:
            return False
        logger.warning(
            "etcd-v3: %s of round %d of rendezvous %s left the round (stopped heartbeating or left); restarting "
            "this node's worker group to re-form without it",
            ", ".join(sorted(map(str, gone))), round_, self._settings.run_id,
        )  # fmt: skip
        self._members = None  # once per round: the agent restarts the group and re-joins
        return True


def _node_key(node: _NodeDesc) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


def _round_store_prefix(run_id: str, round_: int) -> str:
    """The prefix of one round's agents' store (torch's ``DynamicRendezvousHandler._wrap_store``)."""
    return f"torch.rendezvous.{run_id}.{round_}"


def _leave_at_exit(handler_ref: weakref.ref) -> None:
    """(atexit) Leave the round unless the handler was shut down; at most LEAVE_TIMEOUT_S."""
    handler = handler_ref()
    if handler is None or handler._shut_down:
        return

    def leave() -> None:
        try:
            handler.leave()
        except Exception as exc:  # noqa: BLE001 - exiting anyway; the heartbeat rule removes the node
            logger.warning("etcd-v3: could not leave rendezvous %s at exit: %s", handler._settings.run_id, exc)

    thread = threading.Thread(target=leave, name="etcd-v3-leave", daemon=True)
    thread.start()
    thread.join(LEAVE_TIMEOUT_S)


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Build the backend and the agents' store from torchrun's rendezvous parameters.

    Raises:
        EtcdConfigError: an endpoint or ``--rdzv-conf`` value is invalid (a ``ValueError``).
    """
    settings = _settings(params)
    return _backend_and_store(settings, GrpcEtcdClient(settings.client_options()))


def _settings(params: RendezvousParameters) -> EtcdRendezvousSettings:
    settings = EtcdRendezvousSettings.from_config(params.endpoint, params.run_id, params.config)
    logger.info(
        "etcd-v3 rendezvous %s on %s under %s (ttl=%ds, read_timeout=%ds, tls=%s, auth=%s)",
        settings.run_id, ",".join(settings.endpoints), settings.run_prefix, settings.ttl,
        settings.read_timeout, settings.client_options().secure, settings.user is not None,
    )  # fmt: skip
    return settings


def _backend_and_store(settings: EtcdRendezvousSettings, client: EtcdClient) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    leases = LeaseKeeper(client, settings.ttl)
    backend = EtcdRendezvousBackend(client, settings.run_prefix + "state", leases)
    store = EtcdStore(client, settings.run_prefix + "store/", leases, timedelta(seconds=settings.read_timeout),
                      probe_timeout=settings.connect_timeout)
    return backend, store


def create_rdzv_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """The ``etcd-v3`` handler for torchrun's rendezvous parameters (what torchrun calls).

    Also gives every worker-group attempt a fresh worker store; see :func:`use_fresh_worker_store`.

    Raises:
        EtcdConfigError: an endpoint or ``--rdzv-conf`` value is invalid (a ``ValueError``).
    """
    report_own_errors_in_one_line()
    settings = _settings(params)
    client = GrpcEtcdClient(settings.client_options())
    _first_contact(client, settings)
    backend, store = _backend_and_store(settings, client)
    use_fresh_worker_store()
    handler = EtcdRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        settings.rendezvous_timeout(), keep_alive_interval=settings.keep_alive_interval,
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
    )  # fmt: skip
    handler.attach(store, backend, early_close=settings.early_close,
                   reach_timeout=settings.reach_timeout if settings.reach_check else None,
                   local_addr_given=bool(params.local_addr))
    return handler


def _first_contact(client: EtcdClient, settings: EtcdRendezvousSettings) -> None:
    """Fail within ``connect_timeout`` when no etcd member answers at all: a wrong endpoint or a
    closed port is a start-up error, not ``read_timeout`` of silence in the first join."""
    try:
        status = client.status(timeout=settings.connect_timeout)
    except EtcdConnectionError as exc:
        raise EtcdConnectionError(
            f"etcd-v3: no etcd member answered at {','.join(settings.endpoints)} within {settings.connect_timeout} s "
            f"(--rdzv-conf connect_timeout): {exc}"
        ) from exc
    logger.info("etcd-v3: etcd %s answered at %s", status.version, status.endpoint)


V2_API_MISSING = (
    "--rdzv-backend=etcd (and etcd-v2) speak etcd's v2 API, which this etcd does not serve (404: etcd 3.6 removed "
    "it, and 3.4 and 3.5 serve it only with --enable-v2); use --rdzv-backend=etcd-v3, which speaks the v3 API"
)


def _v2_api_missing(value: BaseException) -> bool:
    """torch's own etcd backends (python-etcd, the v2 API) failing because the server has no v2 API."""
    return type(value).__module__.split(".")[0] == "etcd" and "404" in str(value)


def _torchrun_argument_check(value: BaseException, traceback: Any) -> bool:
    """An ``AssertionError`` raised by torchrun's own argument checks (``config_from_args``: ``--nnodes 3:1``)."""
    if not isinstance(value, AssertionError) or traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    code = traceback.tb_frame.f_code
    return code.co_name == "config_from_args" and code.co_filename.replace(os.sep, "/").endswith("torch/distributed/run.py")


def report_own_errors_in_one_line() -> None:
    """In torchrun's process, print an uncaught rendezvous error of this package as one line, say which
    backend to use when torch's v2-API etcd backend meets an etcd without that API, and print torchrun's own
    argument checks (``--nnodes 3:1``) as the one-line usage errors they are.

    torchrun lets an exception from creating the handler reach the interpreter, which prints the
    whole traceback; these errors name what is wrong and what to do in their message. Any other
    exception keeps the interpreter's report."""
    previous = sys.excepthook
    if getattr(previous, "_elastic_ddp_one_line", False):
        return

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if isinstance(value, EtcdRendezvousError):
            sys.stderr.write(f"torchrun: error: {value}\n")
            sys.stderr.flush()
            return
        if _v2_api_missing(value):
            sys.stderr.write(f"torchrun: error: {V2_API_MISSING} ({str(value).strip()})\n")
            sys.stderr.flush()
            return
        if _torchrun_argument_check(value, traceback):
            sys.stderr.write(f"torchrun: error: {value}\n")
            sys.stderr.flush()
            return
        previous(kind, value, traceback)

    hook._elastic_ddp_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def use_fresh_worker_store() -> None:
    """Default ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` to ``1`` in this (the agent's) process.

    With torch's default, the workers of every attempt share one TCPStore that the rank-0
    agent hosts for its whole life, and the keys a killed attempt left there break about
    half of all restarts: see ``RESTARTS.md`` in this package ("The fix, by depth", 1).
    torch reads the variable at each ``next_rendezvous()`` and when it starts workers,
    both after torchrun created this handler, so with it every round publishes a fresh
    MASTER_PORT through this backend's store and rank 0's worker hosts an empty TCPStore
    there. An explicit value in the agent's environment is respected (``0`` keeps torch's
    shared store; the workers then warn about it).
    """
    if _FRESH_STORE_ENV not in os.environ:
        os.environ[_FRESH_STORE_ENV] = "1"
        logger.info("etcd-v3: %s=1, so every worker-group attempt gets a fresh store (RESTARTS.md)", _FRESH_STORE_ENV)


def handler_factory() -> RendezvousHandlerCreator:
    """Entry point ``torchrun.handlers: etcd-v3``: returns the handler creator. torchrun loads it whatever the
    backend, so this is also where its one-line error reports are installed."""
    report_own_errors_in_one_line()
    return create_rdzv_handler
