"""``etcd-v3``: a torchrun rendezvous over the etcd v3 API, registered for torchrun (docs/design.md, "Rendezvous").

Use::

    torchrun --nnodes=1:8 --rdzv-backend=etcd-v3 \\
        --rdzv-endpoint=etcd1:2379,etcd2:2379,etcd3:2379 --rdzv-id=job42 \\
        --rdzv-conf=join_timeout=300,cacert=/etc/etcd/ca.pem,user=train,password=... train.py

torchrun finds :func:`handler_factory` through the ``torchrun.handlers`` entry point
``etcd-v3`` (torch's own ``etcd``/``etcd-v2`` speak the v2 API, which etcd 3.6 no
longer serves; an out-of-tree handler may not reuse a built-in name). The handler implements
torch's public ``RendezvousHandler`` contract with the rounds protocol of :mod:`.rounds` as its
state machine (one key per node under its own lease, one closer per round: every etcd cost linear
in the number of nodes), with :class:`~elastic_ddp.rendezvous.store.EtcdStore` as the agents'
store: every worker-group attempt gets a fresh worker store, a node that leaves does so at once,
and nodes that cannot reach each other are left out of a round (:class:`EtcdRendezvousHandler`).
``--rdzv-conf`` keys are listed in :mod:`elastic_ddp.rendezvous.settings`; the keys it writes in
:mod:`.rounds`.

Why the agents' store lives in etcd, not in a TCPStore
------------------------------------------------------
torch's ``c10d`` backend hosts a TCPStore on the ``--rdzv-endpoint`` machine, and
torch's ``DynamicRendezvousHandler`` by default makes the rank-0 *agent* host a second
TCPStore that the *workers* use (``use_agent_store``). The ``etcd-v3`` handler does not
(``use_agent_store`` is ``False``): each round, rank 0's *worker* hosts the workers' TCPStore on
a port published through the agents' store. The handler's store is therefore only the agents' store: a handful of operations
per rendezvous round (publish and read ``MASTER_ADDR``/``MASTER_PORT``, one
``set`` + ``multi_get``/``multi_set`` + blocking ``get`` for torchrun's rank assignment, an
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
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.events.handlers import get_logging_handler
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from elastic_ddp import job_end, membership, prefork
from elastic_ddp.rendezvous import reach
from elastic_ddp.rendezvous.client import EtcdClient, GrpcEtcdClient
from elastic_ddp.rendezvous.errors import EtcdAuthError, EtcdConnectionError, EtcdRendezvousError, JobEnded
from elastic_ddp.rendezvous.lease import LeaseKeeper, NoLease
from elastic_ddp.rendezvous.rounds import PLAIN_CLOSE, Formed, Member, Node, RoundRules, Rounds, RoundWatch, node_key
from elastic_ddp.rendezvous.settings import EtcdRendezvousSettings
from elastic_ddp.rendezvous.store import EXIT_BARRIER_COUNT, EXIT_BARRIER_DONE, EtcdStore

T = TypeVar("T")
logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
LEAVE_TIMEOUT_S = 5.0
"""The most an exiting agent spends taking its node out of the round (etcd may be unreachable)."""
EVENT_SOURCE = "dynamic_rendezvous"
"""The torch event-handler name rendezvous events are recorded under (torch's own rendezvous's), so that
``torch.distributed.elastic.events`` configured for rendezvous events gets this handler's too."""


def _record_event(operation: str, node: Node, run_id: str, message: str, node_state: NodeState,
                  rank: int | None = None) -> None:
    """Record a rendezvous event (``torch.distributed.elastic.events``) named ``EtcdRendezvousHandler.<operation>``,
    but only if events go anywhere (by default their handler is a ``NullHandler``)."""
    if isinstance(get_logging_handler(EVENT_SOURCE), logging.NullHandler):
        return
    construct_and_record_rdzv_event(
        name="EtcdRendezvousHandler.%s" % operation,
        run_id=run_id,
        message=message,
        node_state=node_state,
        hostname=node.addr,
        pid=node.pid,
        local_id=node.local_id,
        rank=rank,
    )


@dataclass
class RoundView:
    """The round this node trains in, as its watch sees it: what :meth:`EtcdRendezvousHandler.num_nodes_waiting`
    answers from."""

    round: int = 0
    participants: dict[Node, int] = field(default_factory=dict)
    """The round's members whose key still exists, with their rank."""
    wait_list: set[Node] = field(default_factory=set)
    """Nodes that joined the next round."""
    closed: bool = False


class _RoundsState:
    """This node's view of the rendezvous (a :class:`RoundView`), kept from its rounds: after a join, the round as
    formed; while the node trains, which members' keys still exist and who joined the next round, as
    :class:`~.rounds.RoundWatch` saw them. Reading it costs no etcd call: the agent polls
    :meth:`EtcdRendezvousHandler.num_nodes_waiting` ten times a second."""

    def __init__(self) -> None:
        self._state = RoundView()
        self.formed: Formed | None = None
        self.watch: RoundWatch | None = None
        self.closed = False
        self._built_from: tuple[int, int, int] | None = None

    @property
    def state(self) -> RoundView:
        return self._state

    def sync(self) -> None:
        """Bring the view up to date with the watch (no etcd call).

        Raises:
            EtcdConnectionError: etcd does not answer the watch now.
        """
        watch = self.watch
        if watch is not None:
            view = watch.view
            if view.error is not None:
                raise view.error
            key = (view.formed.round, len(view.alive), len(view.waiting))
            if key != self._built_from:
                self._built_from = key
                self._state = _state_of(view.formed, view.alive, view.waiting.values(), self.closed)

    def formed_round(self, formed: Formed, watch: RoundWatch) -> None:
        self.stop_watching()
        self.formed, self.watch = formed, watch
        self._built_from = None
        self._state = _state_of(formed, {member.key for member in formed.members}, (), self.closed)

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def left(self) -> None:
        """This node left its round: it is no longer among the participants."""
        self.stop_watching()
        self.watch = None
        self._state.participants = {}

    def close(self) -> None:
        self.closed = self._state.closed = True


class _Background(Generic[T]):
    """``work()`` on a daemon thread; :meth:`result` waits for it and returns its value or raises its error."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        name = "%s-reach-report" % threading.current_thread().name  # named after the agent's thread, for its logs
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._value = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class _Heartbeats:
    """Calls ``beat`` every ``interval`` seconds on a daemon thread, under ``lock``, until stopped."""

    def __init__(self, interval: float, beat: Callable[[], None], lock: threading.Lock, name: str) -> None:
        self._interval = interval
        self._beat = beat
        self._lock = lock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            with self._lock:
                if not self._stopped.is_set():
                    self._beat()

    def stop(self) -> None:
        """No heartbeat after this returns: waits for one in flight (it may wait on etcd up to its own limit)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _state_of(formed: Formed, alive: set[str], waiting: Iterable[Node], closed: bool) -> RoundView:
    participants = {member.node: rank for rank, member in enumerate(formed.members) if member.key in alive}
    return RoundView(formed.round, participants, set(waiting), closed)


class EtcdRendezvousHandler(RendezvousHandler):
    """torch's rendezvous contract (``RendezvousHandler``) as the rounds protocol of :mod:`.rounds`: ``min:max``
    nodes with a last call, early close, spares beyond ``max_nodes``, waiting nodes, heartbeats as lease
    keep-alives, and the agents' store in etcd; plus: an agent that exits leaves the round at once, a node that
    the round went on without re-joins, and nodes that cannot reach each other are left out of a round.

    **Worker stores.** :attr:`use_agent_store` is ``False``: every attempt's rank-0 worker hosts a fresh
    TCPStore on a port published through the round's agents' store, so no key of a failed attempt reaches the
    next (``RESTARTS.md``). Nothing in the process's environment is changed for it.

    **Leaving.** torchrun's agent does not shut the rendezvous down when a signal ends it (that
    would close the rendezvous for every node), so a preempted node (SIGTERM, or a spot notice's
    SIGTERM from its own worker) would stay a participant until its lease expired
    (``keep_alive_interval * keep_alive_max_attempt``); the survivors' next round would wait that long.
    At interpreter exit, unless :meth:`shutdown` ran, this handler takes its node out of the round,
    bounded by :data:`LEAVE_TIMEOUT_S`. A node killed outright is removed when its lease expires.

    **Leaving as the job ends.** torchrun's agent waits in an exit barrier (up to 300 s) until
    every agent of the round has checked in, and an agent ended by a signal never gets there. So
    the exiting node checks in on its way out (before it leaves the round), unless its agent
    already did: a node preempted just after its workers finished does not hold the others. A
    check-in by a node that left mid-training is harmless: the survivors' next round has a barrier
    of its own.

    **Liveness.** A node is alive while its key's lease is (:mod:`.rounds`): its agent's heartbeat
    (every ``keep_alive_interval``) is a lease keep-alive, and etcd drops the node's key once it has
    missed ``keep_alive_max_attempt`` of them. Heartbeats cost no raft writes.

    **etcd outages.** Workers never use etcd; only membership changes need it. While etcd does not
    answer, :meth:`num_nodes_waiting` (the agent's poll of a healthy group) reports no waiting
    node, with one warning per outage, instead of failing the agent and stopping a training job.
    :meth:`shutdown` (a finished job) gives up closing the rendezvous, with a warning, when etcd does
    not answer within ``connect_timeout``. etcd renews every lease when it elects a leader, so an
    outage of etcd itself drops no node.

    **Unreachable nodes.** A node cut off from its peers but not from etcd keeps its lease, so
    every round would include it and forming the process group would wait for it. With
    ``reach_check`` (the default), every completed round is checked first (:mod:`.reach`, a bounded
    number of probes per node): the nodes of a cut pair that the agents agree to leave out step out of
    the round and wait until they reach every other node of the job again, then re-join; the others
    re-form at once without them.

    **Re-joining.** A node whose lease expired while it lived (cut off from etcd longer than its
    TTL, a frozen agent) is no longer in the round, although its workers still train, and torch's
    agent restarts them only when other nodes wait; the next node to join would then form a round,
    and a second job, of its own on the same checkpoints. Counting this node as waiting makes its
    agent stop its workers and re-join, so every node is again in one round.
    """

    def __init__(self, node: Node, settings: RendezvousSettings, store: EtcdStore, rounds: Rounds,
                 reach_timeout: float | None = None, local_addr_given: bool = True,
                 in_process: InProcess | None = None) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if not 1 <= settings.min_nodes <= settings.max_nodes:
            raise ValueError(f"min_nodes must be > 0 and <= max_nodes, got min_nodes={settings.min_nodes}, "
                             f"max_nodes={settings.max_nodes}")
        self._this_node = node
        self._settings = settings
        self._etcd_store = store
        self._rounds = rounds
        self._state_holder = _RoundsState()
        self._heartbeat_lock = threading.Lock()
        """Held by a heartbeat while its keep-alive waits on etcd; the agent's poll takes it with a time limit."""
        self._heartbeats: _Heartbeats | None = None
        self._shut_down = False
        self._outage_since: float | None = None
        self._last_probe = 0.0
        self._listener: reach.ProbeListener | None = None
        self._reach_timeout = reach_timeout
        self._fork_server_started = False
        self._local_addr_given = local_addr_given
        self._members: tuple[int, frozenset[Node]] | None = None
        """The round this node trains in, and its participants (a peer missing from them later is gone)."""
        self._probes: dict[Node, str] = {}
        """Each member's probe listener (``host:port``) in that round: whether a gone peer's agent still runs."""
        self._answered_until = 0.0
        """Until then (monotonic), the gone peers' agents are taken to run, as they answered last time."""
        self._report: tuple[int, _Background[reach.Report]] | None = None
        """This node's reachability report for a round, being made since the round formed."""
        self._job_end: job_end.JobEnd | None = None
        """Why a worker of this node ended the job (a configuration mistake): what closing the rendezvous says."""
        self._in_process = in_process
        """The in-process mode's workers' store and what they need to reach it (``in_process=true``), or None."""
        self._said_in_process = False
        self._joined_membership = False
        """This agent trains in a round of its own, its workers members of the running membership
        (:meth:`_join_the_running_membership`): it is in no agents' round, so none waits for it."""
        atexit.register(_leave_at_exit, weakref.ref(self))

    @classmethod
    def build(
        cls, settings: EtcdRendezvousSettings, client: EtcdClient, min_nodes: int, max_nodes: int,
        local_addr: str | None, local_addr_given: bool | None = None, config: dict[str, str] | None = None,
    ) -> EtcdRendezvousHandler:
        """The handler of one node on ``client``, its agents' store and its rounds (:mod:`.rounds`)."""
        handler_settings = RendezvousSettings(
            settings.run_id, min_nodes, max_nodes, settings.rendezvous_timeout(),
            keep_alive_interval=timedelta(seconds=settings.keep_alive_interval),
            keep_alive_max_attempt=settings.keep_alive_max_attempt,
        )  # fmt: skip
        records = LeaseKeeper(client, settings.ttl)
        liveness = LeaseKeeper(client, liveness_ttl(settings))
        store = EtcdStore(client, settings.run_prefix + "store/", liveness, timedelta(seconds=settings.read_timeout),
                          probe_timeout=settings.connect_timeout, records=records, exit_barrier=not settings.in_process)
        rules = RoundRules(min_nodes, max_nodes, handler_settings.timeout.last_call,
                           handler_settings.keep_alive_interval, early_close=settings.early_close)
        rounds = Rounds(client, settings.run_prefix, rules, liveness, records)
        node = Node.of_this_process(local_addr)
        in_process = None
        if settings.in_process:
            in_process = InProcess(worker_store(client, settings), client, settings, {
                "endpoint": ",".join(settings.endpoints), "run_id": settings.run_id, "config": config, "addr": node.addr})
        return cls(node, handler_settings, store, rounds,
                   reach_timeout=settings.reach_timeout if settings.reach_check else None,
                   local_addr_given=bool(local_addr) if local_addr_given is None else local_addr_given,
                   in_process=in_process)

    @property
    def settings(self) -> RendezvousSettings:
        """The run id, node counts, timeouts and keep-alive settings of this rendezvous."""
        return self._settings

    def get_backend(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """See base class: never (see the class docstring, "Worker stores")."""
        return False

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    def member(self) -> Member:
        """This node as its key describes it: descriptor and probe address."""
        listener = self._probe_listener()
        return Member(self._this_node, listener.address if listener is not None else "")

    def _probe_listener(self) -> reach.ProbeListener | None:
        """This agent's probe listener, opened before its first join (its address goes into the node's key);
        ``None`` without the check or when this node's address cannot be bound."""
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
        self._end_if_a_worker_said_so()
        joining = self._join_the_running_membership()
        if joining is not None:
            return joining
        self._joined_membership = False
        try:
            info = self._form(time.monotonic() + self._settings.timeout.join.total_seconds())
        except RendezvousClosedError:
            self._end_if_closed_with_a_reason()
            raise
        if self._in_process is not None:  # where this round's workers meet (they inherit the agent's environment)
            os.environ[membership.LAUNCH_ENV] = json.dumps(
                {**self._in_process.spec, "round": self._state_holder.state.round})
        return info

    def _join_the_running_membership(self) -> RendezvousInfo | None:
        """In-process mode, before a rendezvous: while the job's workers go on in their own processes (a member
        of their newest generation answers), the other agents will not re-form, so this node's workers join that
        membership instead (a restart after a crash, or a node added to the job). This agent then trains in a
        round of its own: one node, on a store of its own, for torchrun to assign its workers' local ranks; the
        workers are told to join (``"join"`` in ``ELASTIC_DDP_MEMBERSHIP``) and by which node rank their replicas
        know this node: its rank in the round it trained in, else a new one. None: no membership answers (a
        job's start, or every worker gone): the agents form a round as without the mode."""
        if self._in_process is None:
            return None
        running = self._in_process.running_round()
        if running is None:
            return None
        formed = self._state_holder.formed
        node_rank = formed.rank_of(self._this_node) if formed is not None else None
        if node_rank is None:
            node_rank = NEW_NODE_RANKS + self._in_process.workers.add(f"round-{running}/nodes-joined", 1)
        store = dist.PrefixStore(f"joining/{node_key(self._this_node)}/{time.time_ns()}/", self._etcd_store)
        bootstrap = RendezvousStoreInfo.build(0, store, local_addr=self._this_node.addr)
        os.environ[membership.LAUNCH_ENV] = json.dumps(
            {**self._in_process.spec, "round": running, "join": True, "node_rank": node_rank})
        message = (f"etcd-v3: in-process mode: the job's workers go on in their own processes (round {running}); "
                   f"this node's workers join them as node {node_rank}")
        self._record("next_rendezvous", message)
        logger.info(message)
        self._joined_membership = True
        return RendezvousInfo(store, 0, 1, bootstrap)

    def _form(self, deadline: float) -> RendezvousInfo:
        """The round this node trains in, once every pair of its nodes reaches each other."""
        while True:
            info = self._join_round()
            listener = self._probe_listener() if info.world_size > 1 else None
            if listener is None or self._reach_timeout is None:
                return self._training_in(info)
            left_out = reach.agree(info.store, self._my_report(info))
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

    def _end_if_a_worker_said_so(self) -> None:
        """Before a restart's rendezvous: when a worker of this node ended as a configuration mistake (its
        job-end record, :mod:`elastic_ddp.job_end`), close the rendezvous with that record as the reason, so
        every agent ends instead of restarting, and end this one.

        Raises:
            JobEnded: with the worker's status.
        """
        directory = os.environ.get(job_end.DIR_ENV)
        end = job_end.read(directory, self._settings.run_id) if directory else None
        if end is None:
            return
        self._job_end = end
        with self._heartbeat_lock:
            self._close()
        self._end_job(end)

    def _end_if_closed_with_a_reason(self) -> None:
        """The rendezvous is closed: when a worker on some node ended the job, end this agent as that node's did."""
        try:
            reason = self._rounds.closed_reason()
        except EtcdConnectionError:
            return
        if reason is None or reason == PLAIN_CLOSE:
            return
        try:
            end = job_end.JobEnd.decode(reason)
        except job_end.JobEndRecordError as exc:
            logger.warning("etcd-v3: rendezvous %s was closed with %s", self._settings.run_id, exc)
            return
        self._end_job(end)

    def _end_job(self, end: job_end.JobEnd) -> None:
        message = f"rank {end.rank} ended the job ({end.reason}, exit status {end.status}): {end.detail}"
        logger.error("etcd-v3: %s; not restarting the workers", message)
        sys.stderr.write(f"torchrun: error: {message}\n")
        sys.stderr.flush()
        raise JobEnded(message, end.status)

    def _join_round(self) -> RendezvousInfo:
        """Join the next round (:meth:`.Rounds.join`), watch it, start heartbeats, and publish or read rank 0's
        address for the workers' store (``RendezvousStoreInfo``: rank 0's worker hosts a fresh one).

        Raises:
            RendezvousError: the join failed (closed, timed out, etcd does not answer); recorded as a failed event.
        """
        message = "The node '%s' attempts to join the next round of the rendezvous '%s'." % (
            self._this_node, self._settings.run_id)
        self._record("next_rendezvous", message)
        logger.info(message)
        holder = self._state_holder
        try:
            self._stop_heartbeats()
            if holder.formed is None:  # a first join: spread the nodes of a job started at once over 0.3 s
                time.sleep(random.uniform(0, 0.3))
            holder.stop_watching()
            me = self.member()
            formed = self._rounds.join(me, time.monotonic() + self._settings.timeout.join.total_seconds(), holder.formed)
            holder.formed_round(formed, self._rounds.watch(formed, me))
            self.start_report(formed)
            self._start_heartbeats()
            rank, world_size = holder.state.participants[self._this_node], len(formed.members)
            store = dist.PrefixStore(_round_store_prefix(self._settings.run_id, formed.round), self._etcd_store)
            bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._this_node.addr)
        except Exception as exc:
            self._record("next_rendezvous", "%s: %s" % (type(exc).__name__, exc), NodeState.FAILED)
            raise
        message = "The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d." % (
            self._this_node, formed.round, self._settings.run_id, rank, world_size)
        self._record("next_rendezvous", message, rank=rank)
        logger.info(message)
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def _start_heartbeats(self) -> None:
        self._heartbeats = _Heartbeats(self._settings.keep_alive_interval.total_seconds(), self._keep_alive,
                                       self._heartbeat_lock, "RendezvousKeepAliveTimer_%d" % self._this_node.local_id)

    def _stop_heartbeats(self) -> None:
        """No heartbeat after this returns (one in flight is waited for)."""
        heartbeats, self._heartbeats = self._heartbeats, None
        if heartbeats is not None:
            heartbeats.stop()

    def _keep_alive(self) -> None:
        """One heartbeat: a keep-alive of this node's leases; a failure is logged (the lease rule judges)."""
        try:
            self._rounds.keep_alive()
        except RendezvousError as exc:
            logger.warning("The node '%s' has failed to send a keep-alive heartbeat to the rendezvous '%s' due to an "
                           "error of type %s.", self._this_node, self._settings.run_id, type(exc).__name__)
            self._record("_keep_alive", "keep-alive failed: %s" % type(exc).__name__, NodeState.FAILED)
        else:
            logger.debug("The node '%s' has sent a keep-alive heartbeat to the rendezvous '%s'.",
                         self._this_node, self._settings.run_id)

    def _depart(self) -> None:
        """Take this node's keys out of etcd: marked as leaving in the round it trained in, else just revoked."""
        trained_in = self._state_holder.formed
        if trained_in is not None:  # tell the members of its round it leaves (it holds a key there)
            self._rounds.depart(trained_in, self.member())
        else:
            self._rounds.leave()
        self._state_holder.left()

    def start_report(self, formed: Formed) -> None:
        """Probe this node's ring successors and publish its reachability report on a thread, as soon as the
        round's membership is known: the handler then waits for rank 0's ``MASTER_ADDR``, and the
        judge's wait for every report overlaps that wait instead of following it."""
        self._report = None
        rank = formed.rank_of(self._this_node)
        if self._reach_timeout is None or rank is None or len(formed.members) < 2 or self._probe_listener() is None:
            return
        store = dist.PrefixStore(_round_store_prefix(self._settings.run_id, formed.round), self._etcd_store)
        addresses = [member.probe for member in formed.members]
        timeout, world_size = self._reach_timeout, len(formed.members)
        self._report = (formed.round, _Background(lambda: reach.report(store, rank, world_size, addresses, timeout)))

    def _my_report(self, info: RendezvousInfo) -> reach.Report:
        """This node's report for the round ``info`` is of: the one :meth:`start_report` began, else made now."""
        assert self._reach_timeout is not None
        pending, self._report = self._report, None
        if pending is not None and pending[0] == self._state_holder.state.round:
            return pending[1].result()
        formed = self._rounds_state().formed
        addresses = [member.probe for member in formed.members] if formed is not None else []
        return reach.report(info.store, info.rank, info.world_size, addresses, self._reach_timeout)

    def _training_in(self, info: RendezvousInfo) -> RendezvousInfo:
        state = self._state_holder.state
        self._members = (state.round, frozenset(state.participants))
        formed = self._rounds_state().formed
        self._probes = {member.node: member.probe for member in formed.members} if formed is not None else {}
        self._answered_until = 0.0
        return info

    def _step_out(self, left_out: frozenset[int], world_size: int) -> None:
        """Leave the round as a node that the others must not wait for (no heartbeat), but not for good."""
        logger.warning(
            "etcd-v3: this node (%s) cannot reach every other node of round %d of rendezvous %s (agents %s of %d "
            "are left out); it steps out and re-joins once it reaches them all",
            self._this_node, self._state_holder.state.round, self._settings.run_id, sorted(left_out), world_size,
        )  # fmt: skip
        self._stop_heartbeats()
        self._depart()

    def _rounds_state(self) -> _RoundsState:
        holder = self._state_holder
        assert isinstance(holder, _RoundsState)
        return holder

    def _wait_until_reachable(self, deadline: float) -> None:
        """Return once this node reaches the nodes of the job nearest to it (at most ``reach.PROBES`` of them, in
        node-key order after this one's; at once when there is none); probe every ``keep_alive_interval``.

        Raises:
            RendezvousClosedError: the job ended meanwhile.
            RendezvousTimeoutError: still cut off after ``join_timeout``.
        """
        assert self._reach_timeout is not None and self._rounds is not None
        started = time.monotonic()
        me = node_key(self._this_node)
        while True:
            try:
                if self._rounds.is_closed():
                    raise RendezvousClosedError()
                others = self._rounds.job_nodes(exclude=me)
                if not others:
                    return
                nearest = reach.successors(me, sorted(others), reach.PROBES)
                addresses = {key: address for key in nearest
                             if (address := reach.parse_address(others[key].encode())) is not None}
                reached = reach.probe(addresses, self._reach_timeout)
                if len(reached) == len(nearest):
                    logger.warning("etcd-v3: this node reaches %d other node(s) of the job again after %.1f s; "
                                   "re-joining", len(nearest), time.monotonic() - started)
                    return
                logger.debug("etcd-v3: cannot reach %s", sorted(set(nearest) - reached))
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
        if store.exit_barrier_given_up or not store.answers():
            # torch's stop joins the heartbeat thread, which may be waiting read_timeout on etcd
            stopper = threading.Thread(target=self._stop_heartbeats, name="etcd-v3-stop-heartbeats", daemon=True)
            stopper.start()
            stopper.join(store.probe_timeout)
            logger.warning(
                "etcd-v3: etcd did not answer within %s s at shutdown; rendezvous %s is not closed (its "
                "keys expire with their lease)", store.probe_timeout, self._settings.run_id,
            )  # fmt: skip
            return False
        self._stop_heartbeats()
        try:
            self._close()
        except RendezvousError as exc:
            message = "The node '%s' has failed to shutdown the rendezvous '%s' due to an error of type %s." % (
                self._this_node, self._settings.run_id, type(exc).__name__)
            self._record("shutdown", message, NodeState.FAILED)
            logger.warning(message)
            return False
        try:
            self._rounds.leave()  # the job is over: its keys go now, not when the lease expires
        except EtcdConnectionError as exc:
            logger.info("etcd-v3: could not revoke this node's lease at shutdown (it expires): %s", exc)
        return True

    def is_closed(self) -> bool:
        """See base class (one read of etcd)."""
        return self._rounds.is_closed()

    def set_closed(self) -> None:
        """See base class: the job is over for every node (one write)."""
        with self._heartbeat_lock:
            self._close()

    def _close(self) -> None:
        self._rounds.close_job(PLAIN_CLOSE if self._job_end is None else self._job_end.encode())
        self._state_holder.close()
        message = "The node '%s' has closed the rendezvous '%s'." % (self._this_node, self._settings.run_id)
        self._record("_close", message, NodeState.SUCCEEDED)
        logger.info(message)

    def leave(self) -> None:
        """Take this node out of the current round, so the others re-form without waiting for its
        heartbeats to expire; check in at the round's exit barrier first (see the class
        docstring). Does nothing if it is not a participant (as last seen)."""
        state = self._state_holder.state
        if self._this_node not in state.participants:
            return
        self._stop_heartbeats()
        self._check_in_at_exit_barrier(state.round, len(state.participants))
        self._depart()
        logger.info("etcd-v3: node %s left rendezvous %s", self._this_node, self._settings.run_id)

    def _check_in_at_exit_barrier(self, round_: int, agents: int) -> None:
        prefix = _round_store_prefix(self._settings.run_id, round_)
        if any(key.startswith(prefix + "/") for key in self._etcd_store.exit_barrier_check_ins):
            return  # the agent got there itself
        store = dist.PrefixStore(prefix, self._etcd_store)
        if store.add(EXIT_BARRIER_COUNT, 1) == agents:
            store.set(EXIT_BARRIER_DONE, "<val_ignored>")

    def _record(self, operation: str, message: str, node_state: NodeState = NodeState.RUNNING,
                rank: int | None = None) -> None:
        _record_event(operation, self._this_node, self._settings.run_id, message, node_state, rank)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round; at least 1 when this node is no longer in the round;
        0 while etcd does not answer (see the class docstring)."""
        if self._outage_since is not None and not self._etcd_back():
            return 0
        if self._joined_membership:  # in no agents' round: its workers fail, and it re-joins, if the membership ends
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
            waiting = 1
        if waiting and self._in_process is not None and self._in_process.alive():
            if not self._said_in_process:
                self._said_in_process = True
                logger.info("etcd-v3: in-process mode: the workers go on in their own processes; their agents do "
                            "not restart them for a membership change")
            return 0
        return waiting

    def _poll_timeout(self) -> float:
        """How long one poll may wait on etcd: ``connect_timeout``, as a probe during an outage."""
        return self._etcd_store.probe_timeout

    def _waiting_within(self, limit: float) -> int:
        """The nodes waiting (sync the view, count its wait list) in about ``limit`` seconds at most.

        The agent polls this while its workers train, and a poll that lands as they exit delays the
        agent's exit by as long as it takes. So it does not wait behind a heartbeat (which holds the
        heartbeat lock while its keep-alive waits on etcd) longer than ``limit``.

        Raises:
            EtcdConnectionError: etcd did not answer within ``limit``.
        """
        if not self._heartbeat_lock.acquire(timeout=limit):
            raise EtcdConnectionError(f"a heartbeat has waited on etcd for over {limit:g} s")
        try:
            self._state_holder.sync()  # the round's watch's view: no etcd call (raises while the watch gets no answer)
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
        if now - self._last_probe < self._settings.keep_alive_interval.total_seconds():
            return False
        self._last_probe = now
        return self._etcd_store.answers()

    def _left_behind(self) -> bool:
        state = self._state_holder.state
        if self._this_node in state.participants:
            return False
        logger.warning(
            "etcd-v3: this node (%s) is no longer a participant of round %d of rendezvous %s: its lease "
            "expired (its keep-alives did not reach etcd for keep_alive_interval*keep_alive_max_attempt); "
            "restarting the worker group to re-join",
            self._this_node, state.round, self._settings.run_id,
        )  # fmt: skip
        return True

    def _peer_gone(self) -> bool:
        """A peer of this node's round is no longer a participant: its lease expired (a node killed, frozen or
        cut off from etcd), or it left. A peer gone silently may leave this node's workers blocked in
        a collective that never fails (NCCL's; gloo's when the peer's connections stay open), and torch's
        agent restarts its workers only when they fail or other nodes wait. Counting a waiting node makes it
        stop them (their group watch abandons the blocked step) and re-form without the peer.

        A peer whose lease expired while its agent still answers this node's probe lost etcd alone
        (:meth:`_agents_answer`): its workers train on with this node's, and it re-joins by itself once it reaches
        etcd. A peer that marked its key as leaving (:meth:`.Rounds.depart`) is gone whether its agent answers or
        not."""
        if self._members is None:
            return False
        round_, members = self._members
        state = self._state_holder.state
        if state.round != round_:
            return False  # a later round began: torch's own wait list speaks for it
        if len(state.participants) >= len(members):  # the round's participants only ever lose members: a
            return False  # count, not a set difference, on each of the agent's ten polls a second
        gone = members - state.participants.keys()
        if not gone:
            return False
        watch = self._rounds_state().watch
        left = watch.view.left if watch is not None else set()
        if not any(node_key(node) in left for node in gone) and self._agents_answer(gone):
            return False  # lost etcd alone, still training with this node
        names = sorted(map(str, gone))
        logger.warning(
            "etcd-v3: %s of round %d of rendezvous %s left the round (lease expired or left); restarting "
            "this node's worker group to re-form without it",
            ", ".join(names[:3]) + (" and %d more" % (len(names) - 3) if len(names) > 3 else ""), round_,
            self._settings.run_id,
        )  # fmt: skip
        self._members = None  # once per round: the agent restarts the group and re-joins
        return True

    def _agents_answer(self, gone: frozenset[Node]) -> bool:
        """Whether every gone peer's agent still runs and this node reaches it: its probe listener answers
        (``reach.answers``, within a second). Such a peer lost only etcd (its keep-alives, so its lease):
        its workers still train with this node's, and restarting them would stop the job for nothing; it
        re-joins by itself once it reaches etcd again. A killed agent refuses, a frozen or unreachable one
        does not answer: those are gone. Asked again every ``keep_alive_interval``, not on every poll."""
        now = time.monotonic()
        if now < self._answered_until:
            return True
        addresses = [reach.parse_address(self._probes.get(node, "").encode()) for node in gone]
        timeout = min(1.0, self._reach_timeout or 1.0)
        if any(address is None or not reach.answers(address, timeout) for address in addresses):
            return False
        if not self._answered_until:
            logger.warning(
                "etcd-v3: %s left round %d of rendezvous %s in etcd without leaving (its lease expired, or it is "
                "re-joining), and its agent answers: it trains on with this node, and re-joins once it reaches etcd",
                ", ".join(sorted(map(str, gone))[:3]), self._members[0] if self._members else -1, self._settings.run_id,
            )  # fmt: skip
        self._answered_until = now + self._settings.keep_alive_interval.total_seconds()
        return True


def _round_store_prefix(run_id: str, round_: int) -> str:
    """The prefix of one round's agents' store, where its ranks, its workers' address and torchrun's exit barrier are."""
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


def liveness_ttl(settings: EtcdRendezvousSettings) -> int:
    """The TTL of a node's liveness lease: ``keep_alive_interval * keep_alive_max_attempt`` (etcd grants at
    least its own minimum, about 2 s with its default election timeout)."""
    return max(1, settings.keep_alive_interval * settings.keep_alive_max_attempt)


WORKERS_PREFIX = "workers/"
"""Under the run's prefix: the in-process mode's worker memberships, one namespace per agents' round."""


def worker_store(client: EtcdClient, settings: EtcdRendezvousSettings, namespace: str = "") -> EtcdStore:
    """The store the workers of the in-process mode agree on (:mod:`elastic_ddp.membership`), under
    ``namespace`` (a store of its own, not a ``PrefixStore``: torch's C++ wrapper cannot call every method of
    a store written in Python). Its keys are attached to no lease, so a generation's member list outlives
    the worker that wrote it."""
    return EtcdStore(client, settings.run_prefix + WORKERS_PREFIX + namespace, NoLease(client),
                     timedelta(seconds=settings.read_timeout), probe_timeout=settings.connect_timeout)


def create_worker_store(spec: dict[str, Any], namespace: str = "") -> EtcdStore:
    """A worker's side of :func:`worker_store`, from what the handler exported (``ELASTIC_DDP_MEMBERSHIP``)."""
    settings = EtcdRendezvousSettings.from_config(spec["endpoint"], spec["run_id"], spec["config"])
    return worker_store(GrpcEtcdClient(settings.client_options()), settings, namespace)


@dataclass
class InProcess:
    """The handler's side of the in-process mode: the workers' store and what the workers need to reach it."""

    workers: EtcdStore
    client: EtcdClient
    settings: EtcdRendezvousSettings
    spec: dict[str, Any]

    def alive(self) -> bool:
        """Whether the job's worker membership lives: a member of its newest generation answers or finished
        its training (:func:`elastic_ddp.membership.alive`)."""
        return self._running(finished_counts=True) is not None

    def running_round(self) -> int | None:
        """The agents' round whose workers' membership a newcomer can join (a member of its newest generation
        answers), or None."""
        return self._running(finished_counts=False)

    def _running(self, *, finished_counts: bool) -> int | None:
        try:
            if not self.workers.check([RUNNING_KEY]):
                return None
            round_ = int(self.workers.get(RUNNING_KEY).decode())
            store = worker_store(self.client, self.settings, f"round-{round_}/")
            return round_ if membership.alive(store, finished_counts=finished_counts) else None
        except (EtcdConnectionError, dist.DistError, OSError, ValueError) as exc:
            logger.debug("etcd-v3: whether the worker membership lives is unknown: %s", exc)
            return None


RUNNING_KEY = "running"
"""In the workers' store: the agents' round whose namespace holds the job's worker membership."""
NEW_NODE_RANKS = 1 << 16
"""The node ranks given to nodes that join a running membership without having trained in a round (above any
round's)."""


def create_store(params: RendezvousParameters) -> EtcdStore:
    """The agents' store alone, from torchrun's rendezvous parameters (for tools and tests).

    Raises:
        EtcdConfigError: an endpoint or ``--rdzv-conf`` value is invalid (a ``ValueError``).
    """
    settings = _settings(params)
    client = GrpcEtcdClient(settings.client_options())
    return EtcdStore(client, settings.run_prefix + "store/", LeaseKeeper(client, settings.ttl),
                     timedelta(seconds=settings.read_timeout), probe_timeout=settings.connect_timeout)


def _settings(params: RendezvousParameters) -> EtcdRendezvousSettings:
    settings = EtcdRendezvousSettings.from_config(params.endpoint, params.run_id, params.config)
    logger.info(
        "etcd-v3 rendezvous %s on %s under %s (ttl=%ds, read_timeout=%ds, tls=%s, auth=%s)",
        settings.run_id, ",".join(settings.endpoints), settings.run_prefix, settings.ttl,
        settings.read_timeout, settings.client_options().secure, settings.user is not None,
    )  # fmt: skip
    return settings


def create_rdzv_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """The ``etcd-v3`` handler for torchrun's rendezvous parameters (what torchrun calls).

    Raises:
        EtcdConfigError: an endpoint or ``--rdzv-conf`` value is invalid (a ``ValueError``).
    """
    report_own_errors_in_one_line()
    settings = _settings(params)
    _hear_from_workers()
    client = GrpcEtcdClient(settings.client_options())
    _first_contact(client, settings)
    return EtcdRendezvousHandler.build(settings, client, params.min_nodes, params.max_nodes, params.local_addr,
                                       config={key: str(value) for key, value in params.config.items()})


def _hear_from_workers() -> None:
    """Give this agent's workers a place to say the job must end (:mod:`elastic_ddp.job_end`): a directory of this
    process's own, named in ``ELASTIC_DDP_JOB_END_DIR`` (the one variable the handler sets: torchrun's workers
    and the fork server inherit the agent's environment), removed at exit."""
    if os.environ.get(job_end.DIR_ENV, "").startswith(_own_job_end_prefix()):
        return  # this process's own, set by an earlier handler
    directory = tempfile.mkdtemp(prefix=f"elastic-ddp-job-end-{os.getpid()}-")
    atexit.register(shutil.rmtree, directory, True)
    os.environ[job_end.DIR_ENV] = directory


def _own_job_end_prefix() -> str:
    return os.path.join(tempfile.gettempdir(), f"elastic-ddp-job-end-{os.getpid()}-")


def _first_contact(client: EtcdClient, settings: EtcdRendezvousSettings) -> None:
    """Fail within ``connect_timeout`` when no etcd member answers at all: a wrong endpoint or a
    closed port is a start-up error, not ``read_timeout`` of silence in the first join."""
    try:
        status = client.status(timeout=settings.connect_timeout)
    except EtcdAuthError as exc:
        # a member did answer: it refused who we said we are, which is no connection failure
        raise EtcdAuthError(f"etcd-v3: etcd at {','.join(settings.endpoints)} refused the credentials of user "
                            f"{settings.user!r}: {exc}") from exc
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


def handler_factory() -> RendezvousHandlerCreator:
    """Entry point ``torchrun.handlers: etcd-v3``: returns the handler creator. torchrun loads it whatever the
    backend, so this is also where its one-line error reports are installed."""
    report_own_errors_in_one_line()
    return create_rdzv_handler
