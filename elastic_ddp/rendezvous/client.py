"""A thin etcd v3 client: only the operations the rendezvous and its store use.

:class:`EtcdClient` is the interface the backend and the store are written against,
so the etcd library behind it can be swapped (the unit tests use an in-memory fake).
:class:`GrpcEtcdClient` implements it with the generated gRPC stubs of
``etcd-sdk-python`` (``pyetcd.etcdrpc``) and adds what the rendezvous needs and
``pyetcd.MultiEndpointEtcd3Client`` lacks (checked against etcd 3.5.1):

- fail-over inside one call: an unreachable member or one without a leader is
  skipped and the next endpoint is tried until the operation's deadline; the
  pyetcd client fails the call and then blacklists the member for
  ``time_retry`` (300 s by default), so a single-member etcd that was down for
  10 s stays unusable for 5 minutes;
- a re-login when etcd drops an auth token (simple tokens expire after 5 minutes
  by default; pyetcd authenticates once, in its constructor);
- errors that name the endpoints tried, raised ``from`` the gRPC error.

Every operation gets one deadline (``request_timeout``) for all endpoint attempts
together; each attempt gets an equal share of it, at least one second.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from elastic_ddp.rendezvous.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdLeaseNotFoundError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_TXN_OPS = 128
"""The most operations etcd takes in one transaction by default (``--max-txn-ops``)."""
_MIN_ATTEMPT_TIMEOUT_S = 1.0
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# gRPC's own reconnect backoff grows to 120 s by default; a member that comes back
# must be reachable again within about a second.
# A silent partition leaves the TCP connection open, and TCP's retransmission timer backs off
# (0.2 s doubling to tens of seconds), so a call in flight when the link comes back would wait
# up to the cut's length again over the old connection. While a call is in flight, keep-alive
# pings (every 10 s; etcd refuses pings more often than every 5 s by default) declare a
# connection that does not answer within 5 s lost: the call fails over and reconnects.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)
_RETRY_ON_NEXT_ENDPOINT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_INVALID_TOKEN_MARKERS = ("invalid auth token", "auth token is expired")
_AUTH_FAILURE_MARKERS = ("authentication failed", "user name is empty", "authentication is not enabled")


# ---------------------------------------------------------------------------
# Values exchanged through the interface


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it."""

    key: bytes
    value: bytes
    create_revision: int
    """Revision of the write that created the key (0 never occurs for an existing key)."""
    mod_revision: int
    """Revision of the last write to the key; the rendezvous uses it as fencing token."""
    lease: int
    """Id of the lease the key is attached to, 0 when none."""


@dataclass(frozen=True)
class TxnOutcome:
    """Result of a conditional put."""

    succeeded: bool
    revision: int
    """Store revision after the transaction; for a successful put, the key's new mod revision."""
    current: KeyValue | None = None
    """The key as it was when the condition failed (``None`` when it succeeded or the key is absent)."""


@dataclass(frozen=True)
class MemberStatus:
    """What one etcd member reports about itself."""

    endpoint: str
    version: str
    member_id: int
    leader_id: int
    raft_term: int
    revision: int


@dataclass(frozen=True)
class Absent:
    """Condition: the key does not exist (its create revision is 0)."""


@dataclass(frozen=True)
class ModRevisionIs:
    """Condition: the key's last write happened at ``revision``."""

    revision: int


@dataclass(frozen=True)
class ValueIs:
    """Condition: the key exists and holds exactly ``value``."""

    value: bytes


Condition = Absent | ModRevisionIs | ValueIs


@dataclass(frozen=True)
class Put:
    """Transaction operation: write ``key`` (under ``lease``, 0: none)."""

    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """Transaction operation: delete ``key`` (nothing happens if it is absent)."""

    key: bytes


@dataclass(frozen=True)
class Read:
    """Transaction operation: read ``key`` at the transaction's revision."""

    key: bytes


Op = Put | Delete | Read


@dataclass(frozen=True)
class TxnResult:
    """Result of :meth:`EtcdClient.transact`."""

    succeeded: bool
    """Whether every condition held (the ``success`` operations ran) or not (``failure`` ran)."""
    revision: int
    """Store revision after the transaction."""
    reads: tuple[KeyValue | None, ...]
    """What each :class:`Read` of the operations that ran found, in order (``None``: absent)."""


@dataclass(frozen=True)
class Event:
    """One change seen by a watch."""

    deleted: bool
    """``True`` for a deletion (``kv.value`` is then empty), ``False`` for a put."""
    kv: KeyValue
    """The key as the change left it; ``mod_revision`` is the change's revision."""


@dataclass(frozen=True)
class Changes:
    """What one wait on a key range saw (:meth:`Watch.next`, :meth:`EtcdClient.wait_for_changes`)."""

    events: tuple[Event, ...]
    """The changes, in revision order; empty when the wait timed out."""
    compacted: bool = False
    """etcd no longer has the history from the revision asked for: the watch goes on from now; read the
    range again."""


class Watch(Protocol):
    """A watch on a key range (:meth:`EtcdClient.watch`): every change after :attr:`revision`, in order,
    batch by batch, until it is closed. A connection lost meanwhile is resumed from the last change seen,
    on whichever endpoint answers."""

    @property
    def revision(self) -> int:
        """Changes after this revision are delivered; at the start, the revision asked for or, for a
        watch from now, the store's revision when it began."""

    def next(self, timeout: float) -> Changes:
        """The next batch of changes, waiting up to ``timeout`` seconds (none came: no events). Raises
        :class:`EtcdConnectionError` while no endpoint answers; the watch can be asked again."""

    def close(self) -> None:
        """End the watch (idempotent)."""

    def __enter__(self) -> Watch: ...

    def __exit__(self, *exc_info: object) -> None: ...


class EtcdClient(Protocol):
    """The etcd operations the rendezvous backend and store need.

    Implementations raise :class:`EtcdConnectionError` (or a subclass) when etcd
    cannot be reached before the operation's deadline, and
    :class:`EtcdLeaseNotFoundError` when a write names a lease etcd no longer has.
    """

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The ``host:port`` endpoints this client may talk to."""

    def get(self, key: bytes, timeout: float | None = None) -> KeyValue | None:
        """The key, or ``None`` when it does not exist (within ``timeout`` seconds, default the operation deadline)."""

    def get_many(self, keys: Sequence[bytes]) -> tuple[list[KeyValue | None], int]:
        """The keys (``None`` for absent ones) read at one revision, and that revision."""

    def count_prefix(self, prefix: bytes) -> int:
        """How many keys start with ``prefix``."""

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write unconditionally; returns the new revision."""

    def put_many(self, items: Sequence[tuple[bytes, bytes]], lease: int = 0) -> int:
        """Write all items in one transaction; returns the new revision."""

    def put_if(
        self, key: bytes, value: bytes, condition: Condition, lease: int = 0, also: Sequence[tuple[bytes, bytes]] = ()
    ) -> TxnOutcome:
        """Write ``key`` (and the ``also`` pairs) only if ``condition`` holds on ``key``.

        One transaction, which reads ``key`` when the condition fails.
        """

    def delete(self, key: bytes) -> bool:
        """Delete the key; ``True`` if it existed."""

    def transact(self, conditions: Sequence[tuple[bytes, Condition]], success: Sequence[Op],
                 failure: Sequence[Op] = ()) -> TxnResult:
        """One transaction: ``success`` if every condition holds on its key, else ``failure``."""

    def range_prefix(
        self, prefix: bytes, timeout: float | None = None, end: bytes | None = None
    ) -> tuple[list[KeyValue], int]:
        """Every key starting with ``prefix`` (or in ``[prefix, end)``), in key order, and the revision read at."""

    def wait_for_changes(self, key: bytes, range_end: bytes, after_revision: int, timeout: float) -> Changes:
        """The first batch of changes to ``[key, range_end)`` after ``after_revision``, or none once ``timeout``
        seconds pass. The watch ends as its first batch arrives, before its caller runs: on a range that
        many nodes write to at once, it receives none of the others' changes."""

    def watch(self, key: bytes, range_end: bytes, after_revision: int | None = None) -> Watch:
        """Watch ``[key, range_end)`` for changes after ``after_revision``, or from now (``None``): etcd serves
        a watch from now at once, while one from a past revision waits for its catch-up (every 100 ms), so a
        wait for a state starts a watch from now and then reads the state. Returns once etcd started it."""

    def watch_keys(self, keys: Sequence[bytes], after_revision: int) -> Watch:
        """Watch each of ``keys`` (single keys) for changes after ``after_revision``, as one :class:`Watch`."""

    def lease_grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""

    def lease_refresh(self, lease_id: int) -> int:
        """Restart the lease's TTL; returns the TTL in seconds, 0 if the lease is gone."""

    def lease_revoke(self, lease_id: int) -> None:
        """End the lease now, deleting every key attached to it (nothing happens if it is gone)."""

    def status(self, timeout: float | None = None) -> MemberStatus:
        """Status of the member that answers (within ``timeout`` seconds, default the operation deadline)."""

    def close(self) -> None:
        """Release connections."""


# ---------------------------------------------------------------------------
# gRPC implementation


@dataclass(frozen=True)
class ClientOptions:
    """How to reach etcd: endpoints, per-operation deadline, TLS and credentials."""

    endpoints: tuple[str, ...]
    """``host:port`` of each member to try, in order."""
    request_timeout: float
    """Seconds one operation may take across all endpoint attempts before it fails."""
    ca_cert: str | None = None
    """PEM file of the CA that signed the members' certificates; enables TLS."""
    cert: str | None = None
    """PEM client certificate for mutual TLS (needs ``key``)."""
    key: str | None = None
    """PEM private key of ``cert``."""
    use_tls: bool = False
    """Use TLS even without a CA file (then the system's root CAs verify the members)."""
    user: str | None = None
    """etcd user name; with ``password`` enables etcd authentication."""
    password: str | None = field(default=None, repr=False)
    """Password of ``user``; never logged or put into a message."""

    @property
    def secure(self) -> bool:
        """Whether channels use TLS."""
        return self.use_tls or any((self.ca_cert, self.cert, self.key))


class GrpcEtcdClient:
    """:class:`EtcdClient` over gRPC, with fail-over across ``options.endpoints``.

    Thread-safe: the rendezvous handler's keep-alive timer and the agent's main
    thread share one client.
    """

    def __init__(self, options: ClientOptions) -> None:
        if not options.endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self._options = options
        self._credentials = _channel_credentials(options) if options.secure else None
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._preferred = 0
        self._token: str | None = None
        self._streams: dict[grpc.Channel, _WatchStream] = {}

    @property
    def endpoints(self) -> tuple[str, ...]:
        """See :class:`EtcdClient`."""
        return self._options.endpoints

    # -- KV ---------------------------------------------------------------

    def get(self, key: bytes, timeout: float | None = None) -> KeyValue | None:
        """See :class:`EtcdClient`."""
        response = self._unary("get", etcdrpc.KVStub, "Range", etcdrpc.RangeRequest(key=key), timeout)
        return _to_key_value(response.kvs[0]) if response.kvs else None

    def get_many(self, keys: Sequence[bytes]) -> tuple[list[KeyValue | None], int]:
        """See :class:`EtcdClient`. More keys than etcd takes in one transaction (``--max-txn-ops``, 128 by
        default) are read in several; the revision is then the first one's (the oldest)."""
        values: list[KeyValue | None] = []
        revision = 0
        for start in range(0, max(len(keys), 1), MAX_TXN_OPS):
            ops = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key)) for key in keys[start:start + MAX_TXN_OPS]]
            response = self._txn("get_many", etcdrpc.TxnRequest(success=ops))
            values.extend(_first_key_value(op.response_range.kvs) for op in response.responses)
            revision = revision or int(response.header.revision)
        return values, revision

    def count_prefix(self, prefix: bytes) -> int:
        """See :class:`EtcdClient`."""
        request = etcdrpc.RangeRequest(key=prefix, range_end=_prefix_end(prefix), count_only=True)
        response = self._unary("count_prefix", etcdrpc.KVStub, "Range", request)
        return int(response.count)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """See :class:`EtcdClient`."""
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)
        return self._unary("put", etcdrpc.KVStub, "Put", request).header.revision

    def put_many(self, items: Sequence[tuple[bytes, bytes]], lease: int = 0) -> int:
        """See :class:`EtcdClient`. More items than etcd takes in one transaction are written in several."""
        revision = 0
        for start in range(0, max(len(items), 1), MAX_TXN_OPS):
            ops = [_put_op(key, value, lease) for key, value in items[start:start + MAX_TXN_OPS]]
            revision = int(self._txn("put_many", etcdrpc.TxnRequest(success=ops)).header.revision)
        return revision

    def put_if(
        self, key: bytes, value: bytes, condition: Condition, lease: int = 0, also: Sequence[tuple[bytes, bytes]] = ()
    ) -> TxnOutcome:
        """See :class:`EtcdClient`."""
        request = etcdrpc.TxnRequest(
            compare=[_compare(key, condition)],
            success=[_put_op(key, value, lease)] + [_put_op(k, v, lease) for k, v in also],
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))],
        )
        response = self._txn("put_if", request)
        if response.succeeded:
            return TxnOutcome(True, response.header.revision)
        current = _first_key_value(response.responses[0].response_range.kvs)
        return TxnOutcome(False, response.header.revision, current)

    def delete(self, key: bytes) -> bool:
        """See :class:`EtcdClient`."""
        response = self._unary("delete", etcdrpc.KVStub, "DeleteRange", etcdrpc.DeleteRangeRequest(key=key))
        return response.deleted > 0

    def transact(self, conditions: Sequence[tuple[bytes, Condition]], success: Sequence[Op],
                 failure: Sequence[Op] = ()) -> TxnResult:
        """See :class:`EtcdClient`."""
        request = etcdrpc.TxnRequest(
            compare=[_compare(key, condition) for key, condition in conditions],
            success=[_request_op(op) for op in success],
            failure=[_request_op(op) for op in failure],
        )
        response = self._txn("transact", request)
        ran = success if response.succeeded else failure
        reads = tuple(_first_key_value(reply.response_range.kvs)
                      for op, reply in zip(ran, response.responses) if isinstance(op, Read))
        return TxnResult(bool(response.succeeded), int(response.header.revision), reads)

    def range_prefix(
        self, prefix: bytes, timeout: float | None = None, end: bytes | None = None
    ) -> tuple[list[KeyValue], int]:
        """See :class:`EtcdClient`."""
        request = etcdrpc.RangeRequest(key=prefix, range_end=_prefix_end(prefix) if end is None else end)
        response = self._unary("range_prefix", etcdrpc.KVStub, "Range", request, timeout)
        return [_to_key_value(kv) for kv in response.kvs], int(response.header.revision)

    def wait_for_changes(self, key: bytes, range_end: bytes, after_revision: int, timeout: float) -> Changes:
        """See :class:`EtcdClient`. A watch on this client's stream that the stream cancels itself as it
        delivers the first batch."""
        deadline = time.monotonic() + timeout
        with _GrpcWatch(self, [(key, range_end)], after_revision, once=True) as watch:
            return watch.next(max(deadline - time.monotonic(), 0.0))

    def watch(self, key: bytes, range_end: bytes, after_revision: int | None = None) -> Watch:
        """See :class:`EtcdClient`. Every watch of this client to one endpoint shares one stream
        (:class:`_WatchStream`)."""
        return _GrpcWatch(self, [(key, range_end)], after_revision)

    def watch_keys(self, keys: Sequence[bytes], after_revision: int) -> Watch:
        """See :class:`EtcdClient`. One etcd watch per key, all on this client's stream."""
        return _GrpcWatch(self, [(key, b"") for key in keys], after_revision)

    # -- leases, status ---------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """See :class:`EtcdClient`."""
        response = self._unary("lease_grant", etcdrpc.LeaseStub, "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=ttl))
        if response.error:
            raise EtcdConnectionError(
                "etcd at %s refused a %ds lease: %s" % (self._endpoint_list(), ttl, response.error)
            )
        return int(response.ID)

    def lease_refresh(self, lease_id: int) -> int:
        """See :class:`EtcdClient`."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        return self._call("lease_refresh", lambda ch, t, md: _keep_alive_once(ch, request, t, md))

    def lease_revoke(self, lease_id: int) -> None:
        """See :class:`EtcdClient`."""
        try:
            self._unary("lease_revoke", etcdrpc.LeaseStub, "LeaseRevoke", etcdrpc.LeaseRevokeRequest(ID=lease_id))
        except EtcdLeaseNotFoundError:
            pass

    def status(self, timeout: float | None = None) -> MemberStatus:
        """See :class:`EtcdClient`."""
        rpc = _unary_rpc(etcdrpc.MaintenanceStub, "Status", etcdrpc.StatusRequest())
        response, endpoint = self._call_on_any("status", rpc, timeout)
        return MemberStatus(
            endpoint=endpoint,
            version=response.version,
            member_id=int(response.header.member_id),
            leader_id=int(response.leader),
            raft_term=int(response.raftTerm),
            revision=int(response.header.revision),
        )

    def close(self) -> None:
        """See :class:`EtcdClient`."""
        with self._lock:
            endpoints, self._channels = list(self._channels), {}
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        for endpoint in endpoints:
            _CHANNELS.release(self._channel_key(endpoint))

    # -- call machinery ---------------------------------------------------

    def _txn(self, what: str, request: etcdrpc.TxnRequest) -> etcdrpc.TxnResponse:
        return self._unary(what, etcdrpc.KVStub, "Txn", request)

    def _unary(self, what: str, stub: type, method: str, request: Message, timeout: float | None = None) -> Any:
        """One unary RPC ``stub(channel).method(request)`` with fail-over (within ``timeout``, default the deadline)."""
        return self._call(what, _unary_rpc(stub, method, request), timeout)

    def _call(
        self, what: str, rpc: Callable[[grpc.Channel, float, _Metadata], T], timeout: float | None = None
    ) -> T:
        """Run ``rpc`` on the preferred endpoint, failing over until the deadline."""
        return self._call_on_any(what, rpc, timeout)[0]

    def _call_on_any(
        self, what: str, rpc: Callable[[grpc.Channel, float, _Metadata], T], timeout: float | None = None
    ) -> tuple[T, str]:
        """Like :meth:`_call`; also returns the endpoint that answered."""
        budget = self._options.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempt_timeout = max(_MIN_ATTEMPT_TIMEOUT_S, budget / len(self.endpoints))
        failures: list[str] = []
        last_exc: grpc.RpcError | None = None
        for attempt, index in enumerate(self._rotation(deadline)):
            endpoint = self.endpoints[index]
            remaining = min(deadline - time.monotonic(), attempt_timeout)
            if attempt == 0:  # a thread that got the CPU only after its deadline still asks once
                remaining = max(remaining, min(_MIN_ATTEMPT_TIMEOUT_S, budget))
            try:
                result = self._attempt(endpoint, rpc, remaining)
            except grpc.RpcError as exc:
                self._raise_unless_retryable(what, endpoint, exc)
                failures.append("%s: %s" % (endpoint, _describe(exc)))
                last_exc = exc
                continue
            self._set_preferred(index)
            return result, endpoint
        raise EtcdConnectionError(
            "etcd %s failed: no endpoint answered within %.1fs (tried %s; last errors: %s)"
            % (what, budget, self._endpoint_list(), "; ".join(failures[-len(self.endpoints):]) or "no attempt")
        ) from last_exc

    def _rotation(self, deadline: float) -> Iterator[int]:
        """Endpoint indexes to try, starting at the preferred one (always tried once), cycling with backoff
        until the deadline."""
        count = len(self.endpoints)
        start = self._preferred_index()
        yield start  # at least one attempt, whatever the clock says
        cycle = 0
        first = True
        while time.monotonic() < deadline:
            for offset in range(1 if first else 0, count):
                if time.monotonic() >= deadline:
                    return
                yield (start + offset) % count
            first = False
            pause = _RETRY_BACKOFF_S[min(cycle, len(_RETRY_BACKOFF_S) - 1)]
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            cycle += 1

    def _attempt(self, endpoint: str, rpc: Callable[[grpc.Channel, float, _Metadata], T], timeout: float) -> T:
        """One RPC against one endpoint, logging in (again) when etcd wants a token."""
        channel = self._channel(endpoint)
        try:
            return rpc(channel, timeout, self._metadata(channel, timeout))
        except grpc.RpcError as exc:
            if not _is_invalid_token(exc) or not self._options.user:
                raise
            logger.info("etcd auth token rejected by %s, logging in again", endpoint)
            self._clear_token()
            return rpc(channel, timeout, self._metadata(channel, timeout))

    def _raise_unless_retryable(self, what: str, endpoint: str, exc: grpc.RpcError) -> None:
        code = exc.code()
        if code in _RETRY_ON_NEXT_ENDPOINT or _is_deadline(exc):
            logger.debug("etcd %s on %s failed (%s), trying the next endpoint", what, endpoint, _describe(exc))
            return
        detail = "etcd %s on %s failed: %s" % (what, endpoint, _describe(exc))
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (exc.details() or ""):
            raise EtcdLeaseNotFoundError(detail) from exc
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or _is_auth_failure(exc):
            raise EtcdAuthError(detail + " (check user, password and TLS settings in --rdzv-conf)") from exc
        raise EtcdConnectionError(detail) from exc

    def _metadata(self, channel: grpc.Channel, timeout: float) -> _Metadata:
        if not self._options.user:
            return None
        with self._lock:
            token = self._token
        if token is None:
            request = etcdrpc.AuthenticateRequest(name=self._options.user, password=self._options.password or "")
            token = etcdrpc.AuthStub(channel).Authenticate(request, timeout=timeout).token
            with self._lock:
                self._token = token
        return (("token", token),)

    def _clear_token(self) -> None:
        with self._lock:
            self._token = None

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = _CHANNELS.acquire(self._channel_key(endpoint), lambda: self._open_channel(endpoint))
                self._channels[endpoint] = channel
            return channel

    def _watch_stream(self, channel: grpc.Channel, metadata: _Metadata) -> _WatchStream:
        """This client's watch stream on ``channel`` (a new one when there is none, it failed, or the
        auth token changed)."""
        with self._lock:
            stream = self._streams.get(channel)
            if stream is not None and stream.usable(metadata):
                return stream
            fresh = self._streams[channel] = _WatchStream(channel, metadata)
        if stream is not None:
            stream.close()
        return fresh

    def _channel_key(self, endpoint: str) -> tuple[object, ...]:
        options = self._options
        return (endpoint, options.secure, options.ca_cert, options.cert, options.key)

    def _open_channel(self, endpoint: str) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(endpoint, self._credentials, options=_CHANNEL_OPTIONS)
        return grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)


    def _preferred_index(self) -> int:
        with self._lock:
            return self._preferred

    def _set_preferred(self, index: int) -> None:
        with self._lock:
            self._preferred = index

    def _endpoint_list(self) -> str:
        return ",".join(self.endpoints)


class _SharedChannels:
    """One gRPC channel per endpoint (and TLS identity) in a process, shared by its clients and counted: gRPC
    multiplexes calls over one HTTP/2 connection, while each channel costs a connection and a polling thread.
    A torchrun agent has one client; a process of many (tests, the scale benchmark's agents) shares one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[tuple[object, ...], tuple[grpc.Channel, int]] = {}

    def acquire(self, key: tuple[object, ...], open_channel: Callable[[], grpc.Channel]) -> grpc.Channel:
        with self._lock:
            channel, users = self._channels.get(key) or (open_channel(), 0)
            self._channels[key] = (channel, users + 1)
            return channel

    def release(self, key: tuple[object, ...]) -> None:
        with self._lock:
            channel, users = self._channels.get(key, (None, 0))
            if channel is None:
                return
            if users > 1:
                self._channels[key] = (channel, users - 1)
                return
            del self._channels[key]
        channel.close()


_CHANNELS = _SharedChannels()


_Metadata = tuple[tuple[str, str], ...] | None


def _unary_rpc(stub: type, method: str, request: Message) -> Callable[[grpc.Channel, float, _Metadata], Any]:
    """The call ``stub(channel).method(request, timeout=..., metadata=...)`` as a function of the channel."""

    def rpc(channel: grpc.Channel, timeout: float, metadata: _Metadata) -> Any:
        return getattr(stub(channel), method)(request, timeout=timeout, metadata=metadata)

    return rpc


def _keep_alive_once(
    channel: grpc.Channel, request: etcdrpc.LeaseKeepAliveRequest, timeout: float, metadata: _Metadata
) -> int:
    """Send one keep-alive on a fresh stream; the lease's TTL, 0 when etcd does not know it."""
    for response in etcdrpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout=timeout, metadata=metadata):
        return int(response.TTL)
    return 0


class _WatchFailed(grpc.RpcError):
    """A watch that etcd did not start or a stream that ended, as the fail-over machinery sees errors."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_Item = tuple[str, Any]
"""What a stream hands one watch: ("created", revision), ("events", events), ("canceled", (compact revision,
reason)) or ("failed", error)."""


class _WatchStream:
    """One bidirectional etcd Watch stream to one endpoint, carrying every watch of one client there. etcd
    answers the creations on a stream in the order they were sent, each with the id it gave the watch; a
    watch then costs two messages (create, cancel) instead of a stream of its own and the thread gRPC starts
    to feed it."""

    def __init__(self, channel: grpc.Channel, metadata: _Metadata) -> None:
        self._metadata = metadata
        self._requests: queue.SimpleQueue[etcdrpc.WatchRequest | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: deque[_WatchSlot] = deque()
        """A slot for each creation sent, in order, until etcd answers it."""
        self._slots: dict[int, _WatchSlot] = {}
        self._failure: grpc.RpcError | None = None
        self._call = etcdrpc.WatchStub(channel).Watch(iter(self._requests.get, None), metadata=metadata)
        threading.Thread(target=self._read, name="etcd-v3-watch-stream", daemon=True).start()

    def usable(self, metadata: _Metadata) -> bool:
        with self._lock:
            return self._failure is None and metadata == self._metadata

    def open(self, slot: _WatchSlot, creates: Sequence[etcdrpc.WatchCreateRequest]) -> None:
        """Create one etcd watch per request, all delivering to ``slot``."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            for create in creates:
                self._pending.append(slot)
                self._requests.put(etcdrpc.WatchRequest(create_request=create))

    def cancel(self, slot: _WatchSlot) -> None:
        with self._lock:
            self._cancel(slot)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()

    def _cancel(self, slot: _WatchSlot) -> None:
        """(Lock held.) Cancel the slot's watches; those not created yet are cancelled as their creation arrives."""
        slot.cancelled = True
        for watch_id in slot.watch_ids:
            if self._slots.pop(watch_id, None) is not None and self._failure is None:
                self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def _read(self) -> None:
        failure: grpc.RpcError
        try:
            for response in self._call:
                self._dispatch(response)
            failure = _WatchFailed(grpc.StatusCode.UNAVAILABLE, "the watch stream ended")
        except grpc.RpcError as exc:
            failure = exc
        with self._lock:
            self._failure = failure
            slots = {id(slot): slot for slot in (*self._pending, *self._slots.values())}
            self._pending.clear()
            self._slots.clear()
        self._requests.put(None)  # ends gRPC's thread that feeds the request stream
        for slot in slots.values():
            slot.put(("failed", failure))

    def _dispatch(self, response: Any) -> None:
        watch_id = int(response.watch_id)
        with self._lock:
            if response.created:
                if not self._pending:
                    return
                slot = self._pending.popleft()
                if response.canceled:  # refused, or compacted: no watch to cancel later
                    pass
                elif slot.cancelled:
                    self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))
                    return
                else:
                    slot.watch_ids.append(watch_id)
                    self._slots[watch_id] = slot
            else:
                found = self._slots.get(watch_id)
                if found is None:
                    return
                slot = found
                if response.canceled:
                    del self._slots[watch_id]
                elif slot.once and response.events:
                    self._cancel(slot)
        if response.created and not response.canceled:
            slot.put(("created", int(response.header.revision)))
        if response.events:
            slot.put(("events", tuple(Event(event.type == kv_pb2.Event.DELETE, _to_key_value(event.kv))
                                      for event in response.events)))
        if response.canceled:
            slot.put(("canceled", (int(response.compact_revision), response.cancel_reason)))


class _WatchSlot:
    """One watch's side of a stream (one or several etcd watches): what the stream handed it, in order."""

    def __init__(self, once: bool = False) -> None:
        self.watch_ids: list[int] = []
        self.cancelled = False
        self.once = once
        """Cancelled by the stream as it delivers the first batch of events."""
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()

    def put(self, item: _Item) -> None:
        self._items.put(item)

    def get(self, timeout: float) -> _Item | None:
        try:
            return self._items.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None


class _GrpcWatch:
    """:class:`Watch` of one or several key ranges on the client's stream to the endpoint that answered;
    resumed from the last change seen (on any endpoint) when the stream fails."""

    def __init__(self, client: GrpcEtcdClient, ranges: Sequence[tuple[bytes, bytes]], after_revision: int | None,
                 once: bool = False) -> None:
        self._client, self._ranges = client, tuple(ranges)
        self._once = once
        self._stream: _WatchStream | None = None
        self._slot: _WatchSlot | None = None
        self._early: deque[_Item] = deque()
        """What the slot delivered while the watch was being started (events of a range created first)."""
        self._compacted = False
        self._closed = False
        self._revision = 0
        self._start(after_revision, None)

    @property
    def revision(self) -> int:
        return self._revision

    def next(self, timeout: float) -> Changes:
        deadline = time.monotonic() + timeout
        while not self._closed:
            if self._compacted:
                self._compacted = False
                return Changes((), compacted=True)
            if self._slot is None:  # not running since the stream failed: resume
                self._start(self._revision, max(deadline - time.monotonic(), 0.0))
                continue
            item = self._early.popleft() if self._early else self._slot.get(deadline - time.monotonic())
            if item is None or self._closed:
                return Changes(())
            kind, value = item
            if kind == "events":
                self._revision = max(self._revision, *(event.kv.mod_revision for event in value))
                return Changes(value)
            if kind == "canceled":
                compact_revision, reason = value
                self._drop()
                if not compact_revision:
                    raise EtcdConnectionError("etcd ended a watch on %r: %s" % (self._ranges[0][0], reason or "no reason"))
                self._start(None, max(deadline - time.monotonic(), 0.0))  # from now; the caller reads again
                return Changes((), compacted=True)
            if kind == "failed":
                self._slot = None
                self._early.clear()
                logger.debug("etcd-v3: watch stream failed (%s); resuming after revision %d", value, self._revision)
        return Changes(())

    def close(self) -> None:
        """Cancel the watch and wake a thread waiting in :meth:`next` (which then returns no events)."""
        if self._closed:
            return
        self._closed = True
        slot = self._slot
        if slot is not None:
            if self._stream is not None:
                self._stream.cancel(slot)
            slot.put(("closed", None))

    def __enter__(self) -> _GrpcWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drop(self) -> None:
        if self._stream is not None and self._slot is not None:
            self._stream.cancel(self._slot)
        self._slot = None
        self._early.clear()

    def _start(self, after_revision: int | None, timeout: float | None) -> None:
        """Start the watch on any endpoint; raises :class:`EtcdConnectionError` when none answers in time."""
        start = 0 if after_revision is None else after_revision + 1
        creates = [etcdrpc.WatchCreateRequest(key=key, range_end=end, start_revision=start) for key, end in self._ranges]

        def rpc(channel: grpc.Channel, attempt_timeout: float, metadata: _Metadata
                ) -> tuple[_WatchStream, _WatchSlot, int, list[_Item]]:
            stream = self._client._watch_stream(channel, metadata)
            slot = _WatchSlot(self._once)
            stream.open(slot, creates)
            deadline = time.monotonic() + attempt_timeout
            created: list[int] = []
            early: list[_Item] = []
            while len(created) < len(creates):
                item = slot.get(deadline - time.monotonic())
                if item is None:
                    stream.cancel(slot)
                    raise _WatchFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "etcd did not start the watch in time")
                kind, value = item
                if kind == "created":
                    created.append(int(value))
                elif kind == "failed":
                    raise value
                elif kind == "canceled":
                    stream.cancel(slot)
                    compact_revision, reason = value
                    if compact_revision:
                        return stream, slot, -1, []
                    raise _WatchFailed(grpc.StatusCode.PERMISSION_DENIED if "permission" in reason
                                       else grpc.StatusCode.UNKNOWN, reason or "etcd refused the watch")
                else:
                    early.append(item)
            return stream, slot, max(created), early

        stream, slot, revision, early = self._client._call("watch", rpc, timeout)
        if revision < 0:  # the history after after_revision is compacted: from now, and say so
            self._compacted = True
            self._start(None, timeout)
            return
        if self._closed:
            stream.cancel(slot)
            return
        self._stream, self._slot = stream, slot
        self._early.extend(early)
        self._revision = revision if after_revision is None else max(after_revision, self._revision)


def _request_op(op: Op) -> etcdrpc.RequestOp:
    if isinstance(op, Put):
        return _put_op(op.key, op.value, op.lease)
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=op.key))
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=op.key))


def _channel_credentials(options: ClientOptions) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read_optional(options.ca_cert),
        private_key=_read_optional(options.key),
        certificate_chain=_read_optional(options.cert),
    )


def _read_optional(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as handle:
        return handle.read()


def _compare(key: bytes, condition: Condition) -> etcdrpc.Compare:
    equal = etcdrpc.Compare.EQUAL
    if isinstance(condition, Absent):
        return etcdrpc.Compare(key=key, result=equal, target=etcdrpc.Compare.CREATE, create_revision=0)
    if isinstance(condition, ModRevisionIs):
        return etcdrpc.Compare(key=key, result=equal, target=etcdrpc.Compare.MOD, mod_revision=condition.revision)
    return etcdrpc.Compare(key=key, result=equal, target=etcdrpc.Compare.VALUE, value=condition.value)


def _put_op(key: bytes, value: bytes, lease: int) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def _to_key_value(kv: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(kv.key, kv.value, int(kv.create_revision), int(kv.mod_revision), int(kv.lease))


def _first_key_value(kvs: Sequence[kv_pb2.KeyValue]) -> KeyValue | None:
    return _to_key_value(kvs[0]) if kvs else None


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return b"\x00"
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def _describe(exc: grpc.RpcError) -> str:
    return "%s %s" % (exc.code().name, exc.details() or "")


def _is_deadline(exc: grpc.RpcError) -> bool:
    """The deadline passed; etcd reports its side of that as UNKNOWN "context deadline exceeded"."""
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or "deadline exceeded" in (exc.details() or "")


def _is_invalid_token(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return any(marker in details for marker in _INVALID_TOKEN_MARKERS)


def _is_auth_failure(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return any(marker in details for marker in _AUTH_FAILURE_MARKERS)
