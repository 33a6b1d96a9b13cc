"""A ``torch.distributed.Store`` kept in etcd (v3 API), for torchrun's agents.

The ``etcd-v3`` handler gives this store to the elastic agents; torch wraps it in a
``PrefixStore("torch.rendezvous.<run_id>.<round>")`` per rendezvous round. Agents
use it to publish ``MASTER_ADDR``/``MASTER_PORT``, to assign worker ranks
(``set``, ``multi_get``, ``multi_set``, blocking ``get``) and for the exit barrier
(``add``, ``wait``, ``set_timeout``). Workers do not use it: with torch's default
they connect to the TCPStore that the rank-0 agent hosts (see ``etcd.py``).

Semantics follow ``TCPStore``: ``get``/``multi_get``/``wait`` block until every
key exists or the store timeout passes (then :class:`EtcdStoreTimeoutError`, a
``DistStoreError``); ``add`` is an atomic counter stored as decimal text;
``compare_set`` with ``expected=b""`` creates a missing key. ``add`` is a
compare-and-swap loop that adds exactly once even when the client retries a swap
that etcd applied but did not answer (see :meth:`EtcdStore.add`). Every key, the
markers of ``add`` included, is attached to the participant's lease
(:mod:`elastic_ddp.rendezvous.lease`).

The exit barrier (keys under :data:`EXIT_BARRIER_PREFIX`) is best effort: an agent gets there
once its own workers have finished, and waiting for the other agents protects nothing that lives
in etcd. So when etcd does not answer a quick probe (``probe_timeout``), or fails while the agent
waits, the barrier is given up with one warning and the agent exits as its workers did; it never
spends ``read_timeout`` (and then the barrier's 300 s) on an etcd that is gone.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from elastic_ddp.rendezvous._torch_compat import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS
from elastic_ddp.rendezvous.client import (
    Absent,
    Condition,
    EtcdClient,
    KeyValue,
    ModRevisionIs,
    TxnOutcome,
    ValueIs,
)
from elastic_ddp.rendezvous.errors import EtcdConnectionError, EtcdRendezvousError, EtcdStoreTimeoutError
from elastic_ddp.rendezvous.lease import LeaseKeeper

logger = logging.getLogger(__name__)

_WATCH_SLICE_S = 10.0

EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"
"""Where torchrun's agent keeps its exit barrier in the (per-round) agents' store: it ``add`` s 1 to
``<prefix>/num_members`` and waits for ``<prefix>/last_member``, which the last agent sets. torch's
``_TERMINAL_STATE_SYNC_ID``, restated: see :mod:`elastic_ddp.rendezvous._torch_compat`."""
EXIT_BARRIER_COUNT = EXIT_BARRIER_PREFIX + _NUM_MEMBERS
EXIT_BARRIER_DONE = EXIT_BARRIER_PREFIX + _LAST_MEMBER_CHECKIN


class EtcdStoreValueError(EtcdRendezvousError, ValueError):
    """``add`` was called on a key whose value is not a decimal integer."""


class EtcdStore(dist.Store):
    """c10d ``Store`` over an :class:`EtcdClient`, every key under ``prefix``.

    Python ``Store`` subclasses are called by torch's C++ ``PrefixStore`` through
    pybind's trampoline, whose method names are ``deleteKey`` and ``getNumKeys``.
    """

    def __init__(
        self, client: EtcdClient, prefix: str, leases: LeaseKeeper, timeout: timedelta, probe_timeout: float = 5.0,
        records: LeaseKeeper | None = None, exit_barrier: bool = True,
    ) -> None:
        """``exit_barrier``: False skips the wait of torch's exit barrier (the handler's in-process mode, where a
        node that left checks in nowhere)."""
        super().__init__()
        self._exit_barrier = exit_barrier
        self._client = client
        self._probe_timeout = probe_timeout
        self.exit_barrier_check_ins: list[str] = []
        """The (round-prefixed) exit-barrier counters this process added itself to."""
        self._exit_barrier_given_up = False
        self._prefix = prefix.encode()
        self._marker_prefix = self._prefix.rstrip(b"/") + b".adds/"
        self._instance = uuid.uuid4().hex.encode()
        self._add_calls = itertools.count()
        self._leases = leases
        self._records = records or leases
        """The lease of the exit barrier's keys: the barrier's count must outlive an agent that checked in and exited."""
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        """The etcd key prefix of this store."""
        return self._prefix.decode()

    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``."""
        leases = self._records if EXIT_BARRIER_PREFIX in key else self._leases
        leases.write(lambda lease: self._client.put(self._key(key), _as_bytes(value), lease))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Write all pairs in one etcd transaction."""
        items = [(self._key(key), _as_bytes(value)) for key, value in zip(keys, values, strict=True)]
        self._leases.write(lambda lease: self._client.put_many(items, lease))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store timeout."""
        return self._wait_for([key], self._deadline())[0].value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of all ``keys`` read at one revision, waiting for each up to the store timeout."""
        return [kv.value for kv in self._wait_for(keys, self._deadline())]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists; raise :class:`EtcdStoreTimeoutError` after ``timeout``.

        The exit barrier's wait returns (with a warning) when etcd cannot be reached."""
        exit_barrier = any(key.endswith(EXIT_BARRIER_DONE) for key in keys)
        if exit_barrier and (self._exit_barrier_given_up or not self._exit_barrier):
            return
        try:
            self._wait_for(keys, self._deadline(timeout))
        except EtcdConnectionError as exc:
            if not exit_barrier:
                raise
            self._give_up_exit_barrier(exc)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists now."""
        values, _ = self._client.get_many([self._key(key) for key in keys])
        return all(value is not None for value in values)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (missing counts as 0); returns the new value.

        Each call writes a marker key of its own in the same transaction as the
        counter. When the client retried a swap whose first attempt etcd applied
        but did not answer, the retry's compare fails on our own write; the marker
        tells that apart from a competing ``add``, so the amount is added once.

        On the exit barrier's counter: returns 0 without adding when etcd does not answer
        (the barrier is given up, see the module docstring).
        """
        if not key.endswith(EXIT_BARRIER_COUNT):
            return self._add(key, amount)
        self.exit_barrier_check_ins.append(key)
        try:
            self.probe()
            return self._add(key, amount)
        except EtcdConnectionError as exc:
            self._give_up_exit_barrier(exc)
            return 0

    @property
    def probe_timeout(self) -> float:
        """Seconds :meth:`probe` waits for an etcd member to answer."""
        return self._probe_timeout

    def probe(self) -> None:
        """Raise :class:`EtcdConnectionError` unless an etcd member answers within :attr:`probe_timeout`."""
        self._client.status(timeout=self._probe_timeout)

    def answers(self) -> bool:
        """Whether an etcd member answers within :attr:`probe_timeout`."""
        try:
            self.probe()
        except EtcdConnectionError:
            return False
        return True

    @property
    def exit_barrier_given_up(self) -> bool:
        """Whether this agent gave up its exit barrier because etcd did not answer."""
        return self._exit_barrier_given_up

    def _give_up_exit_barrier(self, exc: EtcdConnectionError) -> None:
        if not self._exit_barrier_given_up:
            logger.warning(
                "etcd-v3: etcd did not answer at the exit barrier; this agent's workers have finished, "
                "so it exits without waiting for the other agents (%s)", exc,
            )  # fmt: skip
        self._exit_barrier_given_up = True

    def _add(self, key: str, amount: int) -> int:
        etcd_key, marker = self._key(key), self._add_marker()
        deadline = self._deadline()
        current = self._client.get(etcd_key)
        while True:
            new_value = str(_counter_value(key, current) + amount).encode()
            outcome = self._put_if(etcd_key, new_value, _unchanged(current), also=[(marker, new_value)])
            if outcome.succeeded:
                return int(new_value)
            applied = self._client.get(marker)
            if applied is not None:
                return int(applied.value)
            current = outcome.current
            self._check_deadline(deadline, [key], "add to")

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (``b""``: if it is missing).

        Returns the value the key holds afterwards; like ``TCPStore``, returns
        ``expected_value`` when the key is missing and ``expected_value`` is not empty.
        """
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        condition: Condition = Absent() if expected == b"" else ValueIs(expected)
        outcome = self._put_if(self._key(key), desired, condition)
        if outcome.succeeded:
            return desired
        return outcome.current.value if outcome.current is not None else expected

    def deleteKey(self, key: str) -> bool:
        """Delete ``key``; ``True`` if it existed."""
        return self._client.delete(self._key(key))

    def getNumKeys(self) -> int:
        """How many keys this store holds (all rounds)."""
        return self._client.count_prefix(self._prefix)

    def _put_if(
        self, etcd_key: bytes, value: bytes, condition: Condition, also: Sequence[tuple[bytes, bytes]] = ()
    ) -> TxnOutcome:
        leases = self._records if EXIT_BARRIER_PREFIX.encode() in etcd_key else self._leases
        return leases.write(lambda lease: self._client.put_if(etcd_key, value, condition, lease, also))

    def _add_marker(self) -> bytes:
        """A key no other ``add`` call writes, outside the store's prefix (``num_keys`` ignores it)."""
        return b"%s%s-%d" % (self._marker_prefix, self._instance, next(self._add_calls))

    def _wait_for(self, keys: Sequence[str], deadline: float) -> list[KeyValue]:
        """All keys' values once all exist. Reads them once; if some are missing, watches the range that spans
        them from now, reads those again (a write between the read and the watch) and takes each from the event
        that writes it: waiting for N keys costs two reads and N events, not a read of all N per arrival (rank
        0's agent waits for every agent's key each round)."""
        names = {self._key(key): key for key in keys}
        etcd_keys = [self._key(key) for key in keys]
        values, _ = self._client.get_many(etcd_keys)
        found = {key: value for key, value in zip(etcd_keys, values) if value is not None}
        if len(found) == len(names):
            return [found[key] for key in etcd_keys]
        missing = sorted(names.keys() - found.keys())
        with self._client.watch(missing[0], missing[-1] + b"\x00") as watch:
            fresh = True
            while len(found) < len(names):
                missing = sorted(names.keys() - found.keys())
                if fresh:  # right after the watch began, or a quiet slice (read again, as an outage check)
                    values, _ = self._client.get_many(missing)
                    found.update((key, value) for key, value in zip(missing, values) if value is not None)
                    fresh = False
                    continue
                self._check_deadline(deadline, [names[key] for key in missing], "wait for")
                slice_s = max(min(deadline - time.monotonic(), _WATCH_SLICE_S), 0.001)
                changes = watch.next(slice_s)
                fresh = changes.compacted or not changes.events
                for event in changes.events:
                    if not event.deleted and event.kv.key in names:
                        found[event.kv.key] = event.kv
        return [found[key] for key in etcd_keys]

    def _check_deadline(self, deadline: float, keys: Sequence[str], action: str) -> None:
        if time.monotonic() >= deadline:
            raise EtcdStoreTimeoutError(
                "etcd store timed out after %s trying to %s key(s) %s under %s on %s"
                % (self._store_timeout(), action, ", ".join(keys), self.prefix, ",".join(self._client.endpoints))
            )

    def _store_timeout(self) -> timedelta:
        return self.timeout  # type: ignore[attr-defined]  # a pybind property torch's stubs omit

    def _deadline(self, timeout: timedelta | None = None) -> float:
        """``now + timeout`` (default: the store timeout); a zero timeout means no deadline, as in c10d."""
        seconds = (self._store_timeout() if timeout is None else timeout).total_seconds()
        return time.monotonic() + seconds if seconds > 0 else math.inf

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _unchanged(current: KeyValue | None) -> Condition:
    return Absent() if current is None else ModRevisionIs(current.mod_revision)


def _counter_value(key: str, current: KeyValue | None) -> int:
    if current is None:
        return 0
    try:
        return int(current.value)
    except ValueError as exc:
        raise EtcdStoreValueError("store key %s holds %r, not a counter" % (key, current.value[:32])) from exc
