"""torch's elastic internals that the ``etcd-v3`` handler (:mod:`elastic_ddp.rendezvous.etcd`) builds on.

The handler subclasses torch's ``DynamicRendezvousHandler``, gives it a state holder and an operation
executor of its own (the rounds protocol behind torch's join, exit, close and keep-alive operations),
and checks in at torchrun's exit barrier for an agent ended by a signal; none of that is torch's
public API. Every private
name it uses comes from here, under torch's own name, and importing this module checks them all
(with the attributes the subclasses read and the signatures they call or override), raising
:class:`~elastic_ddp._compat.IncompatibleLibraryError` in one line when one changed. Only the
rendezvous package imports this module: see :mod:`elastic_ddp._compat`.

Two values are restated rather than taken from torch. The exit barrier's prefix is
``torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID``, and that module imports
torch's rendezvous package (which imports this package) before it defines the name, so it cannot
be read here: :data:`elastic_ddp.rendezvous.store.EXIT_BARRIER_PREFIX` restates it. The prefix of
a round's agents' store is built inside ``DynamicRendezvousHandler._wrap_store`` (probed below)
and restated by ``etcd._round_store_prefix``. ``tests/unit/test_compat.py`` compares both with torch's.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.utils import store as store_util

from elastic_ddp._compat import Behaviour, Private, check
from elastic_ddp._torch_compat import SUPPORTED

_HANDLER = "etcd.EtcdRendezvousHandler"
_EXECUTOR = "etcd._RoundsExecutor"
_HOLDER = "etcd._RoundsState"


def _round_stores_are_prefixed_by_run_and_round(module: ModuleType) -> bool:
    """Whether torch still names a round's agents' store ``torch.rendezvous.<run_id>.<round>``."""
    return "torch.rendezvous." in module.DynamicRendezvousHandler._wrap_store.__code__.co_consts


REQUIRED = (
    Private(
        name="_RendezvousOpExecutor",
        attributes=("run",),
        used_in=f"{_EXECUTOR} implements it: torch's handler runs its join, exit, close and keep-alive through it",
    ),
    Private(
        name="_RendezvousOpExecutor.run",
        parameters=("self", "state_handler", "deadline", "update_deadline"),
        used_in=f"{_EXECUTOR}.run implements it; {_HANDLER}.leave runs the exit operation with it",
    ),
    Private(
        name="_RendezvousStateHolder",
        attributes=("state", "sync", "mark_dirty"),
        used_in=f"{_HOLDER} implements it: torch's handler reads the round (rank, world size, round) through it",
    ),
    Private(
        name="_NodeDesc",
        parameters=("addr", "pid", "local_id"),
        attributes=("addr", "pid", "local_id"),
        used_in="rounds.Member: a node's descriptor, written into its key and read back",
    ),
    Private(
        name="_RendezvousContext",
        parameters=("node", "state", "settings"),
        used_in=f"{_EXECUTOR}.run's signature (torch passes operations that take one)",
    ),
    Private(name="_RendezvousExitOp", parameters=(), used_in=f"{_EXECUTOR}.run: the exit (a leave) deletes the node's keys"),
    Private(name="_RendezvousJoinOp", parameters=(), used_in=f"{_EXECUTOR}.run: the join is the rounds protocol's join"),
    Private(name="_RendezvousCloseOp", parameters=(), used_in=f"{_EXECUTOR}.run: closing writes the job's closed key"),
    Private(name="_RendezvousKeepAliveOp", parameters=(), used_in=f"{_EXECUTOR}.run: a heartbeat is a lease keep-alive"),
    Private(
        name="_RendezvousState",
        attributes=("round", "complete", "closed", "participants", "wait_list", "redundancy_list", "last_heartbeats"),
        used_in=f"{_HOLDER} builds one from the round; {_HANDLER} (leave, _left_behind, _peer_gone) reads it",
    ),
    Private(
        name="RendezvousSettings",
        parameters=("run_id", "min_nodes", "max_nodes", "timeout", "keep_alive_interval", "keep_alive_max_attempt"),
        attributes=("min_nodes", "max_nodes", "run_id", "timeout", "keep_alive_interval"),
        used_in=f"{_HANDLER}.build constructs it; the reachability check and outage probes read run_id, timeout.join "
                "and keep_alive_interval",
    ),
    Private(
        name="DynamicRendezvousHandler",
        parameters=("node", "settings", "backend_name", "store", "state_holder"),
        attributes=("_this_node", "_settings", "_state_holder", "_op_executor", "_heartbeat_lock", "_node_desc_generator"),
        used_in=f"{_HANDLER} subclasses it, builds it with a {_HOLDER}, reads these and replaces _op_executor with an "
                f"{_EXECUTOR}; its poll takes _heartbeat_lock as torch's num_nodes_waiting does, with a time limit",
    ),
    Private(
        name="DynamicRendezvousHandler._stop_heartbeats",
        parameters=("self",),
        used_in=f"{_HANDLER}.leave: no heartbeat after the node left",
    ),
    Private(
        name="DynamicRendezvousHandler._record",
        parameters=("self", "message", "node_state", "rank"),
        used_in=f"{_HANDLER}._record overrides it (events named without inspect.stack())",
    ),
    Private(
        name="DynamicRendezvousHandler._wrap_store",
        parameters=("self", "store"),
        used_in=f"{_HANDLER}._check_in_at_exit_barrier: the round's store, whose prefix etcd._round_store_prefix restates",
    ),
    Behaviour(
        description="DynamicRendezvousHandler._wrap_store prefixes a round's store torch.rendezvous.<run_id>.<round>",
        holds=_round_stores_are_prefixed_by_run_and_round,
        used_in=f"{_HANDLER}._check_in_at_exit_barrier checks in under that prefix",
    ),
)

REQUIRED_IN_STORE_UTIL = (
    Private(
        name="_NUM_MEMBERS",
        used_in="store.EXIT_BARRIER_COUNT: the exit barrier's counter, which EtcdStore recognises and a leaving node adds to",
    ),
    Private(
        name="_LAST_MEMBER_CHECKIN",
        used_in="store.EXIT_BARRIER_DONE: the key the last agent at the exit barrier sets",
    ),
)

check({dynamic_rendezvous: REQUIRED, store_util: REQUIRED_IN_STORE_UTIL},
      version=torch.__version__, supported=SUPPORTED)

_Action = dynamic_rendezvous._Action
_NodeDesc = dynamic_rendezvous._NodeDesc
_RendezvousCloseOp = dynamic_rendezvous._RendezvousCloseOp
_RendezvousContext = dynamic_rendezvous._RendezvousContext
_RendezvousExitOp = dynamic_rendezvous._RendezvousExitOp
_RendezvousJoinOp = dynamic_rendezvous._RendezvousJoinOp
_RendezvousKeepAliveOp = dynamic_rendezvous._RendezvousKeepAliveOp
_RendezvousOpExecutor = dynamic_rendezvous._RendezvousOpExecutor
_RendezvousState = dynamic_rendezvous._RendezvousState
_RendezvousStateHolder = dynamic_rendezvous._RendezvousStateHolder
_NUM_MEMBERS = store_util._NUM_MEMBERS
_LAST_MEMBER_CHECKIN = store_util._LAST_MEMBER_CHECKIN
