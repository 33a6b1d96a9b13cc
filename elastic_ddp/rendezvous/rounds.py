"""The ``etcd-v3`` rendezvous's rounds: one key per node under its own lease, one closer per round.

Every operation here costs etcd work that grows linearly with the number of nodes N (docs/design.md,
"Rendezvous"):

- **Joining** a round is one transaction per node: it puts the node's key under the node's
  *liveness lease* and, in the same transaction, deletes the key it held in an earlier round. The
  first node to join a round also creates the round's closer key in that transaction (compare on
  the key's create revision): that node is the round's **closer**.
- **Liveness** is the lease. Its keep-alive goes to etcd's leader and is not a raft write; a node
  that dies disappears when its lease expires (``keep_alive_interval * keep_alive_max_attempt``),
  one that leaves deletes its key at once.
- **Closing**: only the closer watches the joins. It applies torch's rules (``min_nodes`` opens a
  last call of ``last_call_timeout``, ``max_nodes`` closes at once; after a running round, the round
  closes as soon as every live node of the job joined it: see :meth:`Rounds._decide`) and writes the
  round's membership once. If the closer dies, its key vanishes with its lease, and the first waiting
  node to re-create the key takes over.
- **Everyone else** watches the round's two control keys and learns the membership from the one
  event that writes it. A node that trains watches a constant number of keys from the revision the
  membership was decided at (:class:`RoundWatch`): its own, its ring successors' (a peer gone) and
  the next round's closer key (a node waiting).

Keys (``<p>`` = the run's prefix, ``<n>`` = the round, ten digits)::

    <p>closed                 the job is over (set_closed, shutdown)
    <p>latest                 the newest formed round's number
    <p>round/<n>/c/closer     round n's closer (its descriptor; liveness lease)
    <p>round/<n>/c/members    round n's membership in rank order, written once by its closer
    <p>round/<n>/j/<node>     a node joining or training in round n (its descriptor; liveness lease)
    <p>round/<n>/s/<node>     a spare: it came when max_nodes were training; joins round n when it opens

``closed``, ``latest`` and the membership are written under the writer's long lease (``ttl``), so a
run id used again after its nodes are gone starts afresh once ``ttl`` has passed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elastic_ddp.rendezvous.client import Absent, Delete, EtcdClient, KeyValue, Op, Put, Read, TxnResult, Watch
from elastic_ddp.rendezvous.errors import EtcdConnectionError, EtcdLeaseNotFoundError, EtcdStateError
from elastic_ddp.rendezvous.lease import LeaseKeeper

logger = logging.getLogger(__name__)

_ROUND_DIGITS = 10
_MAX_VALUE_BYTES = 1024
"""The most a node key's value may hold (a descriptor and a probe address)."""
_MAX_MEMBERS = 1_000_000
_LEAVING = "leaving"


_local_ids = itertools.count()
"""Numbers the handlers of one process (a process may run several agents: tests, the scale harness)."""
_local_ids_lock = threading.Lock()


PLAIN_CLOSE = b"1"
"""The closed key's value when the job is simply over (every node's agent then ends as torchrun does)."""


@dataclass(frozen=True, order=True)
class Node:
    """One agent of the job: its host, process and handler within the process. Rank order is this order."""

    addr: str
    pid: int
    local_id: int

    @staticmethod
    def of_this_process(local_addr: str | None) -> Node:
        """A new handler's node: ``local_addr`` (torchrun's ``--local-addr``), else this host's FQDN, as torchrun names
        its nodes."""
        with _local_ids_lock:
            local_id = next(_local_ids)
        return Node(local_addr or socket.getfqdn(), os.getpid(), local_id)

    def __str__(self) -> str:
        return node_key(self)


def node_key(node: Node) -> str:
    """The node's name in keys: ``<addr>_<pid>_<local_id>``."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


@dataclass(frozen=True)
class Member:
    """A node as its key describes it."""

    node: Node
    probe: str = ""
    """``host:port`` of the node's reachability probe listener; empty without one."""
    leaving: bool = False
    """The node is leaving its round on purpose (:meth:`Rounds.depart`): its key goes next."""

    @property
    def key(self) -> str:
        return node_key(self.node)

    def encode(self) -> list[object]:
        """``[addr, pid, local_id, probe]``, and ``"leaving"`` after them when :attr:`leaving`: every agent decodes
        every member of each round it is in, so the form is a flat list (half the bytes of an object, and a decode
        without lookups)."""
        fields: list[object] = [self.node.addr, self.node.pid, self.node.local_id, self.probe]
        return [*fields, _LEAVING] if self.leaving else fields

    @staticmethod
    def decode(value: object) -> Member:
        """Raises ``ValueError`` unless ``value`` is a well-formed descriptor (:meth:`encode`)."""
        if type(value) is not list or len(value) not in (4, 5) or value[4:] not in ([], [_LEAVING]):
            raise ValueError('a node descriptor is not a list [addr, pid, local_id, probe] (or [..., "leaving"])')
        addr, pid, local_id, probe = value[:4]
        if type(addr) is not str or not addr or len(addr) > 255:
            raise ValueError("a node descriptor's addr is not a host name")
        if type(pid) is not int or type(local_id) is not int or pid < 0 or local_id < 0:  # type() excludes bool
            raise ValueError("a node descriptor's pid or local_id is not a non-negative integer")
        if type(probe) is not str or len(probe) > 300:
            raise ValueError("a node descriptor's probe address is not a string")
        return Member(Node(addr, pid, local_id), probe, leaving=len(value) == 5)


@dataclass(frozen=True)
class Formed:
    """A round's membership, as its closer wrote it."""

    round: int
    members: tuple[Member, ...]
    """In rank order: sorted by :class:`Node`, as torch's own rendezvous ranks its nodes."""
    revision: int
    """The etcd revision the closer's view was at: a node that trains in the round watches from there."""

    def rank_of(self, node: Node) -> int | None:
        for rank, member in enumerate(self.members):
            if member.node == node:
                return rank
        return None

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "revision": self.revision,
                           "members": [member.encode() for member in self.members]}, separators=(",", ":")).encode()

    @staticmethod
    def decode(payload: bytes, where: str) -> Formed:
        """Raises :class:`EtcdStateError` naming ``where`` unless ``payload`` is a membership this module wrote.

        A process decodes one membership once: the agents of a process (tests, the scale benchmark's) share
        the immutable result, as each agent on a machine of its own decodes it once."""
        return _decode_formed(bytes(payload), where)

    @staticmethod
    def _decode(payload: bytes, where: str) -> Formed:
        try:
            value = json.loads(payload)
            if not isinstance(value, dict):
                raise ValueError("not an object")
            round_, revision, members = value.get("round"), value.get("revision"), value.get("members")
            if not isinstance(round_, int) or round_ < 0 or not isinstance(revision, int) or revision < 0:
                raise ValueError("round or revision is not a non-negative integer")
            if not isinstance(members, list) or not 0 < len(members) <= _MAX_MEMBERS:
                raise ValueError("members is not a non-empty list")
            decoded = tuple(Member.decode(member) for member in members)
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise EtcdStateError(f"etcd-v3: the round membership at etcd key {where} is corrupt ({exc}); delete "
                                 "the run's keys or use another --rdzv-id") from exc
        return Formed(round_, decoded, revision)


@functools.lru_cache(maxsize=8)
def _decode_formed(payload: bytes, where: str) -> Formed:
    return Formed._decode(payload, where)


@dataclass(frozen=True)
class RoundRules:
    """torch's rendezvous settings that decide when a round closes."""

    min_nodes: int
    max_nodes: int
    last_call: timedelta
    keep_alive_interval: timedelta
    early_close: bool = True


@dataclass
class RunningView:
    """What a node training in a round knows about it: kept by :class:`RoundWatch` from etcd's events."""

    formed: Formed
    alive: set[str] = field(default_factory=set)
    """Node keys of the round's members whose key still exists."""
    left: set[str] = field(default_factory=set)
    """Node keys of the watched members that marked their key as leaving (:meth:`Rounds.depart`): gone on purpose."""
    waiting: dict[str, Node] = field(default_factory=dict)
    """The next round's closer, once it exists: the first node waiting for that round."""
    error: EtcdConnectionError | None = None
    """Set while etcd does not answer the watch."""


class Rounds:
    """One node's side of the protocol (module docstring). Thread-safe for one joining thread plus
    keep-alives and leaves from others."""

    def __init__(
        self, client: EtcdClient, prefix: str, rules: RoundRules, liveness: LeaseKeeper, records: LeaseKeeper,
    ) -> None:
        self._client = client
        self._prefix = prefix.encode()
        self._rules = rules
        self._liveness = liveness
        self._records = records
        self._held: set[bytes] = set()
        """Keys this node holds under its liveness lease (a join or spare key, a closer key)."""
        self._lock = threading.Lock()
        self.closer_of: int | None = None
        """The round this node closed last (for logs and tests)."""

    # -- keys ----------------------------------------------------------------------------

    @property
    def prefix(self) -> bytes:
        return self._prefix

    def round_prefix(self, round_: int) -> bytes:
        return self._prefix + b"round/%0*d/" % (_ROUND_DIGITS, round_)

    def join_prefix(self, round_: int) -> bytes:
        return self.round_prefix(round_) + b"j/"

    def _control(self, round_: int) -> bytes:
        return self.round_prefix(round_) + b"c/"

    def _closer_key(self, round_: int) -> bytes:
        return self._control(round_) + b"closer"

    def _members_key(self, round_: int) -> bytes:
        return self._control(round_) + b"members"

    def _spare_key(self, round_: int, member: Member) -> bytes:
        return self.round_prefix(round_) + b"s/" + member.key.encode()

    def _join_key(self, round_: int, member: Member) -> bytes:
        return self.join_prefix(round_) + member.key.encode()

    @property
    def _closed_key(self) -> bytes:
        return self._prefix + b"closed"

    @property
    def _latest_key(self) -> bytes:
        return self._prefix + b"latest"

    # -- what the handler calls -------------------------------------------------------------

    def join(self, me: Member, deadline: float, previous: Formed | None) -> Formed:
        """Join the next round this node can train in and return it once formed.

        ``previous``: the round this node trained in, if any (a re-join goes to a later round).

        Raises:
            RendezvousClosedError: the job is over.
            RendezvousGracefulExitError: the job ended while this node waited as a spare.
            RendezvousTimeoutError: no round formed with this node before ``deadline`` (monotonic).
        """
        while True:
            if previous is None:  # a node's first join: where is the job?
                latest = self._latest()
                target = 0 if latest is None else latest.round + 1
            else:  # a re-join: the round after this node's last (a later one formed meanwhile: the loop moves on)
                latest, target = previous, previous.round + 1
            if latest is not None and latest.rank_of(me.node) is None:
                training = self._client.count_prefix(self.join_prefix(latest.round))
                with self._lock:  # this node's own key, left there by an entry that found the round formed
                    training -= self._join_key(latest.round, me) in self._held
                if training >= self._rules.max_nodes:
                    self._wait_as_spare(me, target)
            result = self._enter(me, target)
            members, closed = result.reads
            if closed is not None:
                self.leave()
                raise RendezvousClosedError()
            if members is not None:  # formed before this node's key landed (the key stays until the next entry
                # drops it, and is no member's): try the next round
                previous = Formed.decode(members.value, self._members_key(target).decode())
                continue
            if result.succeeded:
                formed = self._close(target, deadline, me)
            else:
                formed = self._await_members(target, deadline, me)
            if formed.rank_of(me.node) is not None:
                return formed
            logger.info("etcd-v3: round %d formed with max_nodes=%d others; this node waits for the next",
                        formed.round, self._rules.max_nodes)
            previous = formed

    def depart(self, formed: Formed, me: Member) -> None:
        """Leave ``formed``, the round this node trains in, on purpose (its agent leaves the job, or the node steps
        out): mark its key as leaving, then :meth:`leave`. The members that watch the key (:class:`RoundWatch`) so
        tell a node that left from one whose lease expired, which may have lost etcd alone and still train with
        them. One write more than :meth:`leave`; none when the key or the lease is gone already."""
        key = self._join_key(formed.round, me)
        with self._lock:
            held = key in self._held
        lease = self._liveness.granted
        if held and lease is not None:
            try:
                self._client.put(key, _descriptor(dataclasses.replace(me, leaving=True)), lease)
            except EtcdLeaseNotFoundError:
                pass  # expired: etcd deleted the key with it
        self.leave()

    def leave(self) -> None:
        """Revoke this node's liveness lease: etcd deletes every key under it at once, in one write (its node
        leaves the job, steps out, or the job is over)."""
        with self._lock:
            self._held = set()
        self._liveness.revoke()

    def keep_alive(self) -> None:
        """Refresh this node's leases (keep-alives: not raft writes)."""
        self._liveness.refresh()
        self._records.refresh()

    def close_job(self, reason: bytes = PLAIN_CLOSE) -> None:
        """Close the rendezvous for every node. ``reason``: what the closed key holds, PLAIN_CLOSE for a job
        that is over, or a job-end record (:mod:`elastic_ddp.job_end`) for one a worker ended; a plain close
        never replaces a reason already there, so every node reads the first node's word."""
        if reason == PLAIN_CLOSE:
            self._records.write(lambda lease: self._client.put_if(self._closed_key, reason, Absent(), lease))
        else:
            self._records.write(lambda lease: self._client.put(self._closed_key, reason, lease))

    def is_closed(self, timeout: float | None = None) -> bool:
        return self._client.get(self._closed_key, timeout=timeout) is not None

    def closed_reason(self, timeout: float | None = None) -> bytes | None:
        """What the closed key holds (see :meth:`close_job`); None while the rendezvous is open."""
        found = self._client.get(self._closed_key, timeout=timeout)
        return None if found is None else found.value

    def job_nodes(self, exclude: str) -> dict[str, str]:
        """The probe address of every node of the job but ``exclude`` (training in the newest round,
        joining the next, or waiting as a spare)."""
        latest = self._latest()
        rounds = [0] if latest is None else [latest.round, latest.round + 1]
        found: dict[str, str] = {}
        for round_ in rounds:
            kvs, _ = self._client.range_prefix(self.round_prefix(round_))
            for kv in kvs:
                if kv.key.startswith(self._control(round_)):
                    continue
                member = self._member(kv)
                if member is not None and member.key != exclude:
                    found[member.key] = member.probe
        return found

    def watch(self, formed: Formed, me: Member) -> RoundWatch:
        """Start watching ``formed`` for a peer gone and a node waiting (see :class:`RoundWatch`)."""
        return RoundWatch(self, formed, me)

    # -- joining -------------------------------------------------------------------------------

    def _latest(self) -> Formed | None:
        """The newest formed round (``None`` before the first). Raises RendezvousClosedError when closed."""
        (closed, latest), _ = self._client.get_many([self._closed_key, self._latest_key])
        if closed is not None:
            raise RendezvousClosedError()
        if latest is None:
            return None
        try:
            round_ = int(latest.value.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise EtcdStateError(f"etcd-v3: etcd key {self._latest_key.decode()} holds no round number") from exc
        members = self._client.get(self._members_key(round_))
        if members is None:
            return None if round_ == 0 else Formed(round_, (), 0)
        return Formed.decode(members.value, self._members_key(round_).decode())

    def _enter(self, me: Member, round_: int) -> TxnResult:
        """One transaction: put this node's key in ``round_`` (the closer key too if it is the first), drop its
        older keys, and read the round's membership (present: formed without this node) and ``closed``."""
        key = self._join_key(round_, me)
        value = _descriptor(me)
        with self._lock:
            drop: list[Op] = [Delete(old) for old in sorted(self._held) if old != key]
        closer = self._closer_key(round_)

        def transact(lease: int) -> TxnResult:
            common = [Put(key, value, lease), *drop, Read(self._members_key(round_)), Read(self._closed_key)]
            return self._client.transact([(closer, Absent())], [Put(closer, value, lease), *common], common)

        result = self._liveness.write(transact)
        with self._lock:
            self._held = {key, closer} if result.succeeded else {key}
        return result

    def _wait_as_spare(self, me: Member, round_: int) -> None:
        """Wait as a spare until ``round_`` opens (some node joins it): max_nodes train without this node."""
        key = self._spare_key(round_, me)
        value = _descriptor(me)
        with self._lock:
            drop: list[Op] = [Delete(old) for old in sorted(self._held) if old != key]
        result = self._liveness.write(lambda lease: self._client.transact([], [Put(key, value, lease), *drop]))
        with self._lock:
            self._held = {key}
        logger.info("etcd-v3: %d nodes train already (max_nodes); this node waits as a spare for round %d",
                    self._rules.max_nodes, round_)
        del result
        prefix = self.round_prefix(round_)
        joins = (self.join_prefix(round_), self._control(round_))
        with self._client.watch(prefix, _prefix_end(prefix)) as watch:
            fresh = True
            while True:
                if fresh:  # the watch just began, or a quiet slice: look at the keys themselves
                    if self.is_closed():
                        raise RendezvousGracefulExitError(f"the rendezvous is closed; spare {me.key} exits")
                    kvs, _ = self._client.range_prefix(prefix)
                    if any(kv.key.startswith(joins) for kv in kvs):
                        return
                changes = watch.next(self._rules.keep_alive_interval.total_seconds())
                self.keep_alive()
                if any(not event.deleted and event.kv.key.startswith(joins) for event in changes.events):
                    return
                fresh = changes.compacted or not changes.events

    def _await_members(self, round_: int, deadline: float, me: Member) -> Formed:
        """Wait for ``round_``'s membership; take over as closer if the closer's key vanishes."""
        control = self._control(round_)
        with self._client.watch(control, _prefix_end(control)) as watch:
            check = True  # first right after the watch began: a membership written since this node's join
            next_check = time.monotonic() + self._rules.keep_alive_interval.total_seconds()
            while True:
                takeover = False
                if check:
                    (closed, closer, members), _ = self._client.get_many(
                        [self._closed_key, self._closer_key(round_), self._members_key(round_)])
                    if closed is not None:
                        self.leave()
                        raise RendezvousClosedError()
                    if members is not None:
                        return Formed.decode(members.value, self._members_key(round_).decode())
                    takeover = closer is None
                    check = False
                if not takeover:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._give_up(round_)
                    changes = watch.next(min(remaining, max(next_check - time.monotonic(), 0.001)))
                    takeover = changes.compacted
                    for event in changes.events:
                        if event.kv.key == self._members_key(round_) and not event.deleted:
                            return Formed.decode(event.kv.value, event.kv.key.decode())
                        if event.kv.key == self._closer_key(round_) and event.deleted:
                            takeover = True
                    if time.monotonic() >= next_check:  # a missed event must not stall the join
                        next_check = time.monotonic() + self._rules.keep_alive_interval.total_seconds()
                        self.keep_alive()
                        check = True
                        continue
                if takeover:
                    result = self._liveness.write(lambda lease: self._client.transact(
                        [(self._closer_key(round_), Absent())],
                        [Put(self._closer_key(round_), _descriptor(me), lease), Read(self._members_key(round_))],
                        [Read(self._members_key(round_))],
                    ))
                    if result.reads[0] is not None:
                        return Formed.decode(result.reads[0].value, self._members_key(round_).decode())
                    if result.succeeded:
                        with self._lock:
                            self._held.add(self._closer_key(round_))
                        logger.warning("etcd-v3: the closer of round %d is gone; this node closes it", round_)
                        return self._close(round_, deadline, me)

    def _give_up(self, round_: int) -> None:
        self.leave()
        raise RendezvousTimeoutError(f"etcd-v3: round {round_} did not form with this node within join_timeout")

    def _close(self, round_: int, deadline: float, me: Member) -> Formed:
        """As the round's closer: watch the joins (and the previous round's nodes) until the rules close the
        round, then write its membership once."""
        self.closer_of = round_
        low = self.join_prefix(round_ - 1) if round_ > 0 else self.round_prefix(round_)
        high = _prefix_end(self.round_prefix(round_))
        previous = self._previous_members(round_)
        view = _CloserView(self, round_)
        with self._client.watch(low, high) as watch:
            kvs, revision = self._client.range_prefix(low, end=high)
            view.reset(kvs)
            last_call: float | None = None
            next_check = time.monotonic() + self._rules.keep_alive_interval.total_seconds()
            while True:
                draining = bool(view.previous)
                if len(view.joins) < self._rules.min_nodes or draining:
                    last_call = None
                elif last_call is None:
                    last_call = time.monotonic() + self._rules.last_call.total_seconds()
                chosen = None if draining else self._decide(view, previous, last_call)
                if chosen is not None:
                    return self._write_members(round_, chosen, revision)
                now = time.monotonic()
                if now >= deadline:
                    self._give_up(round_)
                if now >= next_check:
                    next_check = now + self._rules.keep_alive_interval.total_seconds()
                    self.keep_alive()
                    if self.is_closed():
                        self.leave()
                        raise RendezvousClosedError()
                wake = min(deadline, next_check) if last_call is None else min(deadline, next_check, last_call)
                changes = watch.next(max(0.001, wake - time.monotonic()))
                if changes.compacted:
                    kvs, revision = self._client.range_prefix(low, end=high)
                    view.reset(kvs)
                    continue
                for event in changes.events:
                    revision = max(revision, event.kv.mod_revision)
                    view.apply(event.kv, event.deleted)

    def _previous_members(self, round_: int) -> frozenset[str]:
        if round_ == 0:
            return frozenset()
        current = self._client.get(self._members_key(round_ - 1))
        if current is None:
            return frozenset()
        return frozenset(member.key for member in Formed.decode(current.value, self._members_key(round_ - 1).decode()).members)

    def _decide(self, view: _CloserView, previous: frozenset[str], last_call: float | None) -> list[KeyValue] | None:
        """The joins the round closes with now, or ``None`` to wait: torch's rules, and the early close."""
        rules, count = self._rules, len(view.joins)
        if count >= rules.max_nodes:
            return view.in_order()[: rules.max_nodes]
        if count < rules.min_nodes:
            return None
        if last_call is not None and time.monotonic() >= last_call:
            return view.in_order()
        if rules.early_close and previous and not view.spares and view.names() & previous:
            # a re-formation: every live node of the job joined (none trains in the previous round any more,
            # none waits as a spare), and at least one of them trained in it
            return view.in_order()
        return None

    def _write_members(self, round_: int, chosen: list[KeyValue], revision: int) -> Formed:
        members = [member for kv in chosen if (member := self._member(kv)) is not None]
        members.sort(key=lambda member: member.node)
        formed = Formed(round_, tuple(members), revision)
        result = self._records.write(lambda lease: self._client.transact(
            [(self._members_key(round_), Absent())],
            [Put(self._members_key(round_), formed.encode(), lease), Put(self._latest_key, b"%d" % round_, lease)],
            [Read(self._members_key(round_))],
        ))
        if not result.succeeded and result.reads[0] is not None:
            return Formed.decode(result.reads[0].value, self._members_key(round_).decode())
        logger.info("etcd-v3: round %d formed with %d nodes (this node closed it)", round_, len(members))
        return formed

    def _member(self, kv: KeyValue) -> Member | None:
        """The descriptor in a node key; ``None`` (with a warning) for a value this protocol did not write."""
        try:
            if len(kv.value) > _MAX_VALUE_BYTES:
                raise ValueError("%d bytes" % len(kv.value))
            return Member.decode(json.loads(kv.value))
        except ValueError as exc:
            logger.warning("etcd-v3: ignoring etcd key %r: not a node descriptor (%s)", kv.key, exc)
            return None


class _CloserView:
    """What a round's closer knows, kept from its watch: the round's joins (valid descriptors only), the keys
    still held in the previous round, and the round's spares."""

    def __init__(self, rounds: Rounds, round_: int) -> None:
        self._rounds = rounds
        self._joins = rounds.join_prefix(round_)
        self._previous = rounds.join_prefix(round_ - 1) if round_ > 0 else None
        self._spares = rounds.round_prefix(round_) + b"s/"
        self.joins: dict[bytes, KeyValue] = {}
        self.previous: set[bytes] = set()
        self.spares: set[bytes] = set()

    def reset(self, kvs: Iterable[KeyValue]) -> None:
        self.joins, self.previous, self.spares = {}, set(), set()
        for kv in kvs:
            self.apply(kv, deleted=False)

    def apply(self, kv: KeyValue, deleted: bool) -> None:
        key = kv.key
        if key.startswith(self._joins):
            if deleted:
                self.joins.pop(key, None)
            elif self._rounds._member(kv) is not None:  # a value this protocol did not write is ignored
                self.joins[key] = kv
        elif self._previous is not None and key.startswith(self._previous):
            (self.previous.discard if deleted else self.previous.add)(key)
        elif key.startswith(self._spares):
            (self.spares.discard if deleted else self.spares.add)(key)

    def in_order(self) -> list[KeyValue]:
        """The joins in the order they were made (create revision)."""
        return sorted(self.joins.values(), key=lambda kv: kv.create_revision)

    def names(self) -> set[str]:
        return {key[len(self._joins):].decode(errors="replace") for key in self.joins}


WATCHED_PEERS = 3
"""How many members after it on the ring of ranks a training node watches (all others in smaller rounds)."""


class RoundWatch:
    """A training node's watch on its round, on a constant number of keys whatever the round's size: its own
    key (its lease expired), the keys of the :data:`WATCHED_PEERS` members after it on the ring of ranks (a
    peer gone: the member's lease expired, or it left), and the next round's closer key (a node waiting: the
    first node to join the next round creates it). A peer gone is seen by the members before it on the ring,
    which re-join at once, and that join is the next round's first: everyone else sees it as a node waiting.
    So a node learns of any change from one event, and a re-formation in which every node moves costs each
    node a few events, not every other node's moves. It stops once a node waits or this node's own key is gone
    (the agent then restarts its workers and re-joins), not at a peer gone: one whose lease expired while its
    agent answers lost etcd alone, and the node trains on with it (``EtcdRendezvousHandler._peer_gone``); the
    watch must still see the next round open. Etcd orders events per key, not across the watched keys, so a
    re-joining peer's key may be seen gone before the closer key its join created."""

    def __init__(self, rounds: Rounds, formed: Formed, me: Member) -> None:
        self.view = RunningView(formed, alive={member.key for member in formed.members})
        self._rounds = rounds
        self._me = me
        count = len(formed.members)
        rank = formed.rank_of(me.node)
        peers = [formed.members[(rank + offset) % count] for offset in range(1, min(WATCHED_PEERS, count - 1) + 1)] \
            if rank is not None else []
        self._members = {rounds._join_key(formed.round, member): member.key for member in (me, *peers)}
        """The watched keys of this round, by key: this node's and its ring successors'."""
        self._closer = rounds._closer_key(formed.round + 1)
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="etcd-v3-round-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.close()  # wakes the thread

    @property
    def settled(self) -> bool:
        """Nothing left to watch for: a node waits, or this node's own key is gone."""
        view = self.view
        return bool(view.waiting) or self._me.key not in view.alive

    def _run(self) -> None:
        client = self._rounds._client
        keys = [*self._members, self._closer]
        revision = self.view.formed.revision  # from where the membership was decided: a peer gone since counts
        slice_s = self._rounds._rules.keep_alive_interval.total_seconds()
        watch: Watch | None = None
        try:
            while not self._stop.is_set() and not self.settled:
                try:
                    if watch is None:
                        watch = self._watch = client.watch_keys(keys, revision)
                        if self._stop.is_set():
                            break
                    changes = watch.next(slice_s)
                    if changes.compacted:  # the events since revision are gone: look at the keys themselves
                        values, revision = client.get_many(keys)
                        self._rebuild(dict(zip(keys, values)))
                        watch.close()
                        watch = None
                        continue
                except EtcdConnectionError as exc:
                    self.view.error = exc
                    self._stop.wait(0.5)
                    continue
                self.view.error = None
                for event in changes.events:
                    revision = max(revision, event.kv.mod_revision)
                    self._apply(event.kv.key, None if event.deleted else event.kv)
        finally:
            if watch is not None:
                watch.close()

    def _apply(self, key: bytes, kv: KeyValue | None) -> None:
        view = self.view
        name = self._members.get(key)
        if name is not None:
            if kv is None:
                view.alive.discard(name)
            elif (member := self._rounds._member(kv)) is not None and member.leaving:
                view.left.add(name)
        elif key == self._closer:
            if kv is None:
                view.waiting.clear()
            elif (member := self._rounds._member(kv)) is not None and member.key != self._me.key:
                view.waiting = {member.key: member.node}

    def _rebuild(self, values: dict[bytes, KeyValue | None]) -> None:
        view = self.view
        view.alive = {member.key for member in view.formed.members}
        view.waiting = {}
        view.left = set()
        for key, kv in values.items():
            self._apply(key, kv)


def _descriptor(member: Member) -> bytes:
    return json.dumps(member.encode(), separators=(",", ":")).encode()


def _prefix_end(prefix: bytes) -> bytes:
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\x00"
