"""torch's elastic internals that the ``etcd-v3`` handler (:mod:`elastic_ddp.rendezvous.etcd`) builds on.

The handler subclasses torch's ``DynamicRendezvousHandler`` and its operation executor, runs
torch's exit operation to leave a round, reads the rendezvous state, and checks in at torchrun's
exit barrier for an agent ended by a signal; none of that is torch's public API. Every private
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
_EXECUTOR = "etcd._OpExecutor"


def _deadlines_are_timezone_aware(module: ModuleType) -> bool:
    """Whether torch sets a round's deadline from ``datetime.now(timezone.utc)`` (torch 2.6 on),
    not from the naive ``datetime.utcnow()`` of 2.4 and 2.5."""
    names = module._DistributedRendezvousOpExecutor._add_to_participants.__code__.co_names
    return "timezone" in names and "utcnow" not in names


def _round_stores_are_prefixed_by_run_and_round(module: ModuleType) -> bool:
    """Whether torch still names a round's agents' store ``torch.rendezvous.<run_id>.<round>``."""
    return "torch.rendezvous." in module.DynamicRendezvousHandler._wrap_store.__code__.co_consts


REQUIRED = (
    Private(
        name="_Action",
        attributes=("SYNC", "MARK_RENDEZVOUS_COMPLETE"),
        used_in=f"{_EXECUTOR}.run: a participant told to re-read the state waits for the last call instead, "
                "or completes the round early",
    ),
    Private(
        name="_DistributedRendezvousOpExecutor",
        parameters=("node", "state_holder", "settings"),
        attributes=("_node", "_state", "_state_holder", "_settings"),
        used_in=f"{_EXECUTOR} subclasses it; {_HANDLER} builds one",
    ),
    Private(
        name="_DistributedRendezvousOpExecutor.run",
        parameters=("self", "state_handler", "deadline", "update_deadline"),
        used_in=f"{_EXECUTOR}.run overrides it; {_HANDLER}.leave runs the exit operation with it",
    ),
    Private(
        name="_DistributedRendezvousOpExecutor._remove_from_participants",
        parameters=("self",),
        used_in=f"{_EXECUTOR}._remove_from_participants overrides it (a re-joining node keeps its heartbeat)",
    ),
    Private(
        name="_DistributedRendezvousOpExecutor._record",
        parameters=("self", "message", "node_state"),
        used_in=f"{_EXECUTOR}._record overrides it (events named without inspect.stack())",
    ),
    Private(
        name="_NodeDesc",
        attributes=("addr", "pid", "local_id"),
        used_in="etcd._record_event: the node an event is about",
    ),
    Private(
        name="_RendezvousContext",
        parameters=("node", "state", "settings"),
        attributes=("state",),
        used_in=f"{_EXECUTOR}.run: a fresh context after each re-read of the state",
    ),
    Private(
        name="_RendezvousExitOp",
        parameters=(),
        used_in=f"{_HANDLER}.leave: the node takes itself out of the round",
    ),
    Private(
        name="_RendezvousState",
        attributes=("round", "complete", "closed", "deadline", "participants", "wait_list", "redundancy_list",
                    "last_heartbeats"),
        used_in=f"{_HANDLER} (leave, _left_behind), etcd._pause_until_last_call_ends, etcd._may_close_early and "
                "etcd._job_nodes read it",
    ),
    Private(
        name="_RendezvousJoinOp",
        parameters=(),
        used_in=f"{_EXECUTOR}.run: only a join may complete a round early",
    ),
    Private(
        name="RendezvousSettings",
        attributes=("min_nodes", "max_nodes", "run_id", "timeout", "keep_alive_interval"),
        used_in="etcd._may_close_early (min_nodes to max_nodes participants); the handler's reachability check "
                "and outage probes (run_id, timeout.join, keep_alive_interval)",
    ),
    Private(
        name="_RendezvousStateHolder",
        attributes=("state", "sync"),
        used_in=f"{_EXECUTOR}.run and {_HANDLER} read the state through it",
    ),
    Private(
        name="DynamicRendezvousHandler",
        attributes=("_this_node", "_settings", "_state_holder", "_op_executor", "_heartbeat_lock"),
        used_in=f"{_HANDLER} subclasses it, reads these and replaces _op_executor with an {_EXECUTOR}; its poll "
                "takes _heartbeat_lock as torch's num_nodes_waiting does, with a time limit",
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
    Behaviour(
        description="rendezvous deadlines are timezone-aware (datetime.now(timezone.utc))",
        holds=_deadlines_are_timezone_aware,
        used_in="etcd._pause_until_last_call_ends subtracts datetime.now(timezone.utc) from the round's deadline",
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

REQUIRED_STATE_HOLDER = Private(
    name="_BackendRendezvousStateHolder",
    attributes=("_last_sync_time",),
    used_in=f"{_EXECUTOR}.run: a node woken by a change of the state reads it at once, not from the cache",
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

check({dynamic_rendezvous: (*REQUIRED, REQUIRED_STATE_HOLDER), store_util: REQUIRED_IN_STORE_UTIL},
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
