"""The etcd lease that bounds the life of every key one rendezvous participant writes.

etcd deletes the keys attached to a lease when the lease is not refreshed for its
TTL. The backend attaches the rendezvous state, and the store its keys, to the
writer's lease, refreshed at most every ``ttl / 10`` seconds, so a key lives at
least ``0.9 * ttl`` after its last write. A run id that is reused after all its
agents are gone therefore starts from an empty rendezvous once ``ttl`` has passed,
instead of seeing stale (closed) rounds forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elastic_ddp.rendezvous.client import EtcdClient
from elastic_ddp.rendezvous.errors import EtcdLeaseNotFoundError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_REFRESH_FRACTION = 10


class LeaseKeeper:
    """Grants one lease lazily, refreshes it, and replaces it when etcd has dropped it.

    Thread-safe; shared by the backend and the store of one handler.
    """

    def __init__(self, client: EtcdClient, ttl: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._ttl = ttl
        self._clock = clock
        self._refresh_interval = ttl / _REFRESH_FRACTION
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._refreshed_at = 0.0

    @property
    def ttl(self) -> int:
        """The lease TTL in seconds."""
        return self._ttl

    @property
    def granted(self) -> int | None:
        """The lease id as last granted (``None``: none), without asking etcd whether it still lives."""
        with self._lock:
            return self._lease_id

    def write(self, put: Callable[[int], T]) -> T:
        """Call ``put(lease_id)``; on a lease that etcd no longer knows, grant a new one and call it again."""
        lease_id = self.current()
        try:
            return put(lease_id)
        except EtcdLeaseNotFoundError:
            logger.info("etcd lease %x expired, granting a new one", lease_id)
            self._forget(lease_id)
            return put(self.current())

    def current(self) -> int:
        """The live lease id, granting it, or refreshing it when ``ttl / 10`` has passed since the last refresh."""
        with self._lock:
            now = self._clock()
            if self._lease_id is not None and now - self._refreshed_at >= self._refresh_interval:
                if self._client.lease_refresh(self._lease_id) <= 0:
                    logger.info("etcd lease %x expired, granting a new one", self._lease_id)
                    self._lease_id = None
                self._refreshed_at = now
            if self._lease_id is None:
                self._lease_id = self._client.lease_grant(self._ttl)
                self._refreshed_at = now
            return self._lease_id

    def refresh(self) -> None:
        """Refresh the lease if one was granted and ``ttl / 10`` has passed since its last refresh (a
        keep-alive, not a raft write); grants none. A lease etcd no longer knows is forgotten: the next
        write grants a new one."""
        with self._lock:
            now = self._clock()
            if self._lease_id is None or now - self._refreshed_at < self._refresh_interval:
                return
            if self._client.lease_refresh(self._lease_id) <= 0:
                logger.info("etcd lease %x expired", self._lease_id)
                self._lease_id = None
            self._refreshed_at = now

    def revoke(self) -> None:
        """End the lease now (etcd deletes its keys at once); the next write grants a new one."""
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            self._client.lease_revoke(lease_id)

    def _forget(self, lease_id: int) -> None:
        with self._lock:
            if self._lease_id == lease_id:
                self._lease_id = None


class NoLease(LeaseKeeper):
    """Writes attached to no lease: keys that must outlive the process that wrote them (a worker membership's
    generations, :mod:`elastic_ddp.membership`, whose member list a dead closer wrote stays the list)."""

    def __init__(self, client: EtcdClient) -> None:
        super().__init__(client, ttl=1)

    def write(self, put: Callable[[int], T]) -> T:
        return put(0)

    def current(self) -> int:
        return 0

    def revoke(self) -> None:
        pass
