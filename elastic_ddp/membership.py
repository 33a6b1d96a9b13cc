"""Worker-level membership: which workers form the next process group, agreed on a store.

A membership is a *generation*: generation 0 is the launch's (its ranks as given); each later one is opened by
the first member to find the group broken (or to be told of a change) and holds the workers that *arrive* at it
in time. Every worker runs a watcher thread that arrives as soon as a generation opens, even while its training
thread is still inside a failing collective or a long step, so every live worker arrives within a poll interval
and a dead one never does.

A generation closes when every member of the one before has arrived or is known to be dead, or when no worker
has arrived for ``last_call_s``; whoever sees that first writes the member list with one ``compare_set``, so the
list all read is one list. A member is known dead when its *liveness socket* (a listening TCP socket each worker
holds for as long as its process lives, at the address it published) refuses a connection: the kernel closes it
when the process dies, even by SIGKILL, so a crashed worker is left out at once, and only a member that does not
answer at all (its node gone) costs the last call. A worker that arrived too late to be on the list arrives at
the next generation, which it opens. Ranks keep the order of the generation before (survivors first, in their
old rank order; then newcomers in arrival order), so rank 0 stays rank 0 while it lives.

Keys, under ``elastic_ddp/generations/<n>/`` of the store: ``open`` (why it was opened), ``arrivals`` (a
counter), ``arrival/<i>`` (``<old rank>:<uid>`` of the i-th arrival; old rank -1 for a newcomer), ``without``
(the members agreed to leave, written before ``open``), ``planned`` (the change was agreed at a step boundary,
not a loss; written before ``open``), ``closed`` (the member list, one ``uid`` per line in
rank order) and, for generation 0, ``rank/<r>`` (the uid of launch rank r);
``elastic_ddp/generations/addr/<uid>`` holds each worker's liveness address (``host:port``),
``elastic_ddp/generations/finished/<uid>`` says it ended its training as planned, and
``elastic_ddp/generations/latest`` the newest closed generation a closer wrote (a hint: a worker that joins a
running job reads on from it).
Only ``TCPStore`` semantics are used (``add``, ``compare_set``, ``check``, ``get``), so the launch's TCPStore and
the etcd-backed store (:mod:`elastic_ddp.rendezvous.store`) both serve (docs/design.md, "In-process recovery").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

logger = logging.getLogger(__name__)

PREFIX = "elastic_ddp/generations/"
LAUNCH_ENV = "ELASTIC_DDP_MEMBERSHIP"
"""Set by the etcd-v3 handler's in-process mode for its workers: where they meet (:mod:`elastic_ddp.inprocess`)."""
PROBE_EVERY_S = 0.01
"""The most often one waiter probes one member's liveness socket."""
ENTRY_WAIT_S = 1.0
"""The longest a closer waits for a counted arrival's entry (written just after the count; a worker that died
between the two is left out after this)."""
STORE_RETRY_S = 0.5
"""How often a watcher asks a store that did not answer again."""
STORE_ERRORS = (dist.DistError, RuntimeError, OSError, RendezvousError)
"""What a store raises when it cannot answer: TCPStore's errors, and the etcd store's (a RendezvousError)."""


def in_process_launch() -> bool:
    """Whether this worker runs under the etcd-v3 handler's in-process mode (its agent exported where to meet)."""
    return bool(os.environ.get(LAUNCH_ENV))


class MembershipError(RuntimeError):
    """No membership was agreed within the timeout (the in-process path gives up; the restart path runs)."""


@dataclass(frozen=True)
class Membership:
    """One generation's members, in rank order, as seen by the worker ``uid``."""

    generation: int
    members: tuple[str, ...]
    uid: str

    @property
    def rank(self) -> int:
        return self.members.index(self.uid)

    @property
    def world_size(self) -> int:
        return len(self.members)


class Generations:
    """This worker's side of the agreement on ``store`` (shared by every worker of the run)."""

    def __init__(self, store: dist.Store, uid: str, *, host: str = "127.0.0.1", last_call_s: float = 0.1,
                 timeout_s: float = 60.0, poll_s: float = 0.002, watch_poll_s: float = 0.005,
                 watch_wait_s: float | None = None) -> None:
        """``host``: the address of this worker's liveness socket, one its peers reach (its node's address in the
        job; the loopback for workers of one machine). The watcher looks for the next generation's ``open`` every
        ``watch_poll_s`` (a ``check``), or, with ``watch_wait_s``, waits for it on the store in slices of that many
        seconds: on the etcd-backed store a wait is a watch, which sees the key at once and costs a few requests
        per slice instead of a read per poll (TCPStore logs every wait that times out, so it polls)."""
        if not uid or "\n" in uid or ":" in uid:
            raise ValueError(f"a worker's uid must be non-empty, without ':' or newlines: {uid!r}")
        for name, value in (("last_call_s", last_call_s), ("timeout_s", timeout_s), ("poll_s", poll_s),
                            ("watch_poll_s", watch_poll_s), ("watch_wait_s", 1.0 if watch_wait_s is None else watch_wait_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        self.store, self.uid = store, uid
        self.last_call_s, self.timeout_s, self.poll_s, self.watch_poll_s = last_call_s, timeout_s, poll_s, watch_poll_s
        self.watch_wait_s = watch_wait_s
        self.current: Membership | None = None
        self._arrived: set[int] = set()
        self._lock = threading.Lock()
        self._newer: Membership | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._listener = socket.create_server((host, 0), backlog=128)  # the liveness socket
        self._listener.setblocking(False)
        self.store.set(f"{PREFIX}addr/{uid}", "%s:%d" % self._listener.getsockname()[:2])
        self._addresses: dict[str, tuple[str, int]] = {}
        self._probed: dict[str, float] = {}

    # -- generation 0 ---------------------------------------------------------

    def first(self, rank: int, world_size: int) -> Membership:
        """Generation 0, the launch's ranks: publish this worker's uid as ``rank`` and read the others'."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.store.set(self._key(0, f"rank/{rank}"), self.uid)
        keys = [self._key(0, f"rank/{r}") for r in range(world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
            members = tuple(self.store.get(key).decode() for key in keys)
        except dist.DistStoreError as exc:
            raise MembershipError(f"the launch's {world_size} workers did not all publish their uid within "
                                  f"{self.timeout_s:g} s") from exc
        self.current = Membership(0, members, self.uid)
        if rank == 0:  # generation 0 is closed as the launch formed it: a joiner reads it like any other
            self.store.compare_set(self._key(0, "closed"), "", "\n".join(members))
            self.store.compare_set(f"{PREFIX}latest", "", "0")
        return self.current

    # -- a change ------------------------------------------------------------

    def next(self, reason: str, *, leaving: Iterable[int] = (), planned: bool = False) -> Membership:
        """The next membership that holds this worker: open the generation after the current one (unless a peer
        did), arrive, and wait for it to close; arriving late, go on to the one after. ``leaving``: ranks of the
        current membership that leave it (every member agreed on them): the generation is closed without them,
        whether or not they arrive, and without waiting for them. ``planned``: a change agreed at a step boundary
        (a join, a departure), not a loss; :meth:`lost_member` does not count its generation. Raises
        :class:`MembershipError` when none closes with this worker within ``timeout_s``."""
        current = self._require_current()
        newer = self.changed()
        if newer is not None:
            return self._adopt(newer)
        deadline = time.monotonic() + self.timeout_s
        generation = current.generation + 1
        without = "\n".join(current.members[rank] for rank in sorted(set(leaving)))
        while True:
            if without:  # before it opens: whoever waits for it reads who is not to be waited for
                self.store.compare_set(self._key(generation, "without"), "", without)
            if planned:  # before it opens, as ``without``
                self.store.compare_set(self._key(generation, "planned"), "", "1")
            if self.uid not in current.members:
                # a newcomer counts itself before it opens: the members' watchers close the generation as soon as
                # every member is there, and a newcomer is none of theirs
                self._arrive(generation)
            self.store.compare_set(self._key(generation, "open"), "", reason)
            membership = self._arrive_and_wait(generation, deadline)
            if membership is not None:
                return self._adopt(membership)
            if time.monotonic() > deadline:  # each closed without it: never wait past the timeout for one with it
                raise MembershipError(f"no generation closed with worker {self.uid} within {self.timeout_s:g} s "
                                      f"(the last, {generation}, closed without it)")
            logger.info("worker %s arrived after generation %d closed; opening generation %d", self.uid, generation,
                        generation + 1)
            generation += 1

    def join(self, reason: str = "joining") -> Membership:
        """A worker that was not in the launch (a new node, a restarted worker): find the running generation and
        arrive at the next one, which its members' watchers join at once; the membership that holds this worker.

        Raises :class:`MembershipError` when no generation is running (the store holds none)."""
        if self.current is not None:
            raise RuntimeError("Generations.join() is for a worker without a membership")
        running = self._running()
        if running is None:
            raise MembershipError("no membership is running on this store to join")
        self.current = Membership(running[0], running[1], self.uid)
        joined = self.next(reason, planned=True)
        if not set(joined.members) & set(running[1]):  # never a membership of newcomers alone
            raise MembershipError(f"the running membership ended before worker {self.uid} joined it "
                                  f"(generation {joined.generation} holds newcomers only)")
        return joined

    def _running(self) -> tuple[int, tuple[str, ...]] | None:
        return newest(self.store)

    def changed(self) -> Membership | None:
        """A newer membership that holds this worker, closed while this worker trained (its watcher arrived):
        call at every step boundary; every member goes on in it. None: no change."""
        with self._lock:
            newer = self._newer
        current = self.current
        return newer if newer is not None and current is not None and newer.generation > current.generation else None

    def news(self) -> int:
        """:meth:`changed` as a number, for the runtime's agreement (``runtime.follow(generations.news)``): the
        newer membership's generation, 0 if none."""
        newer = self.changed()
        return newer.generation if newer is not None else 0

    def lost_member(self) -> str | None:
        """What the control plane says of the current membership after a collective raised words that name no
        cause (a backend's timeout, an aborted communicator whose reason is not a peer): a one-line account when
        a member's process is gone (its liveness socket refuses) or a peer opened the next generation because its
        own collective failed, else None. A join's generation does not count: a planned change, never a loss."""
        current = self._require_current()
        generation = current.generation + 1
        key = self._key(generation, "open")
        try:
            if self.store.check([key]) and not self.store.check([self._key(generation, "planned")]):
                return f"a peer opened generation {generation}: {self.store.get(key).decode()}"
            for uid in current.members:
                if uid != self.uid and self._probe(uid):
                    return f"worker {uid}'s process is gone"
        except STORE_ERRORS as exc:  # the store is gone too: nothing to re-form on
            logger.warning("the membership of %s could not be read: %s", self.uid, exc)
        return None

    def _adopt(self, membership: Membership) -> Membership:
        with self._lock:
            self.current = membership
            if self._newer is not None and self._newer.generation <= membership.generation:
                self._newer = None
        return membership

    # -- the watcher ----------------------------------------------------------

    def start_watch(self) -> None:
        """Arrive at every generation opened after the current one as soon as it opens (a daemon thread)."""
        self._require_current()
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(self._stop,), name="elastic-ddp-membership",
                                             daemon=True)
            self._watcher.start()

    def stop_watch(self) -> None:
        """Stop the watcher thread (this worker then arrives only when its training thread calls :meth:`next`)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5 * self.watch_poll_s + (self.watch_wait_s or 0) + 1)
        self._watcher = None
        self._stop = threading.Event()

    def close(self) -> None:
        """Stop the watcher and close the liveness socket: to its peers, this worker is gone."""
        self.stop_watch()
        self._listener.close()

    def finish(self) -> None:
        """This worker ended its training as planned (not lost): say so, then :meth:`close`. A membership whose
        members all finished or live is still :func:`alive`, so the rendezvous does not take the end of
        training for a loss."""
        self.store.set(f"{PREFIX}finished/{self.uid}", "1")
        self.close()

    def __enter__(self) -> Generations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self, stop: threading.Event) -> None:
        """Arrive at each generation as it opens. A store that does not answer (an etcd outage, a lost
        connection) is asked again every STORE_RETRY_S; the watcher stops only after ``timeout_s`` without an
        answer (then the training thread finds out for itself)."""
        generation = self._require_current().generation + 1
        failing_since: float | None = None
        while not stop.is_set():
            current = self._require_current()
            generation = max(generation, current.generation + 1)
            self._answer_probes()
            membership: Membership | None = None
            try:
                opened = self._opened(generation, stop)
                if opened:
                    membership = self._arrive_and_wait(generation, time.monotonic() + self.timeout_s)
            except MembershipError as exc:  # this generation never closed: watch for the next
                logger.warning("membership watcher of %s: %s", self.uid, exc)
                opened, membership = True, None
            except STORE_ERRORS as exc:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    logger.warning("membership watcher of %s cannot read the store (%s); asking again every %g s",
                                   self.uid, _one_line(exc), STORE_RETRY_S)
                if now - failing_since >= self.timeout_s:
                    logger.warning("membership watcher of %s stopped: the store did not answer for %g s: %s",
                                   self.uid, self.timeout_s, _one_line(exc))
                    return
                stop.wait(STORE_RETRY_S)
                continue
            if failing_since is not None:
                logger.info("membership watcher of %s reads the store again after %.1f s", self.uid,
                            time.monotonic() - failing_since)
                failing_since = None
            if not opened:
                continue
            if membership is not None:
                with self._lock:
                    self._newer = membership
            generation += 1

    def _opened(self, generation: int, stop: threading.Event) -> bool:
        """Whether ``generation`` opened within one watch interval (a poll, or a wait on the store)."""
        key = self._key(generation, "open")
        if self.watch_wait_s is None:
            if self.store.check([key]):
                return True
            stop.wait(self.watch_poll_s)
            return False
        try:
            self.store.wait([key], timedelta(seconds=self.watch_wait_s))
        except dist.DistStoreError:  # not within the slice (a lost store raises something else)
            return False
        return True

    # -- arriving and closing -------------------------------------------------

    def _arrive(self, generation: int) -> None:
        """Count this worker's arrival at ``generation`` and write its entry, once per process (by whichever thread
        gets here first)."""
        with self._lock:
            first_time = generation not in self._arrived
            self._arrived.add(generation)
        if not first_time:
            return
        try:
            index = self.store.add(self._key(generation, "arrivals"), 1)
        except BaseException:  # not counted: a retry arrives again
            with self._lock:
                self._arrived.discard(generation)
            raise
        # counted but this entry lost to a failure: the closer leaves this worker out, which then finds itself off
        # the list and opens the next generation, as any late arrival does
        self.store.set(self._key(generation, f"arrival/{index}"), f"{self._old_rank()}:{self.uid}")

    def _arrive_and_wait(self, generation: int, deadline: float) -> Membership | None:
        """Arrive at ``generation`` (once per process, by whichever thread gets here first) and wait until it is
        closed; the membership if this worker is on its list, else None."""
        self._arrive(generation)
        without = self._without(generation)
        members = set(self._require_current().members) - without
        arrived: set[str] = set()
        dead: set[str] = set()
        seen, changed_at = 0, time.monotonic()
        while True:
            closed = self._closed(generation)
            if closed is not None:
                return Membership(generation, closed, self.uid) if self.uid in closed else None
            count = self.store.add(self._key(generation, "arrivals"), 0)
            now = time.monotonic()
            if count != seen:
                arrived |= self._arrivals(generation, seen + 1, count)
                seen, changed_at = count, now
            dead |= {uid for uid in members - arrived - dead if self._refuses(uid)}
            # the last call counts once a member is here: a joiner's generation waits for the members' watchers
            quiet = now - changed_at >= self.last_call_s and bool(members & arrived)
            if members <= arrived | dead or quiet:
                self._close(generation, count, without)
                continue
            if now > deadline:
                raise MembershipError(f"generation {generation} did not close within {self.timeout_s:g} s "
                                      f"({count} worker(s) arrived)")
            time.sleep(self.poll_s)

    def _arrivals(self, generation: int, first: int, last: int) -> set[str]:
        """The uids of arrivals ``first`` to ``last`` whose entries are written (one being written is read later:
        its counter moved first)."""
        uids = set()
        for index in range(first, last + 1):
            key = self._key(generation, f"arrival/{index}")
            if self.store.check([key]):
                uids.add(self.store.get(key).decode().partition(":")[2])
        return uids

    def _refuses(self, uid: str) -> bool:
        """Whether ``uid``'s liveness socket refuses a connection: its process is gone. A member that does not
        answer within the last call (its node unreachable) or has no address yet is not known dead."""
        now = time.monotonic()
        if now - self._probed.get(uid, -1.0) < PROBE_EVERY_S:
            return False
        self._probed[uid] = now
        return self._probe(uid)

    def _probe(self, uid: str) -> bool:
        address = self._addresses.get(uid)
        if address is None:
            key = f"{PREFIX}addr/{uid}"
            if not self.store.check([key]):
                return False
            host, _, port = self.store.get(key).decode().rpartition(":")
            address = self._addresses[uid] = (host, int(port))
        try:
            with socket.create_connection(address, timeout=self.last_call_s):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _answer_probes(self) -> None:
        """Accept and drop the peers' probes waiting on the liveness socket (the kernel completed them already;
        this only keeps its queue short)."""
        while True:
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                return
            connection.close()

    def _without(self, generation: int) -> set[str]:
        key = self._key(generation, "without")
        return set(self.store.get(key).decode().split("\n")) if self.store.check([key]) else set()

    def _close(self, generation: int, count: int, without: set[str]) -> None:
        """Propose the first ``count`` arrivals but those ``without`` as the members (an arrival whose entry does
        not appear within ENTRY_WAIT_S is left out: it died between counting itself and writing its entry)."""
        entries: list[tuple[tuple[int, int], str]] = []
        for index in range(1, count + 1):
            key = self._key(generation, f"arrival/{index}")
            try:
                self.store.wait([key], timedelta(seconds=max(self.last_call_s, ENTRY_WAIT_S)))
            except dist.DistStoreError:
                continue
            old_rank, _, uid = self.store.get(key).decode().partition(":")
            if uid in without:
                continue
            survivor = int(old_rank) >= 0  # survivors first, in their old order; then newcomers as they came
            entries.append(((0, int(old_rank)) if survivor else (1, index), uid))
        members = [uid for _, uid in sorted(entries)]
        agreed = self.store.compare_set(self._key(generation, "closed"), "", "\n".join(members))
        if agreed == "\n".join(members).encode():
            self.store.set(f"{PREFIX}latest", str(generation))  # a hint for joiners (see _running)

    def _closed(self, generation: int) -> tuple[str, ...] | None:
        return _closed_list(self.store, generation)

    def _old_rank(self) -> int:
        current = self._require_current()
        return current.rank if self.uid in current.members else -1

    def _require_current(self) -> Membership:
        current = self.current
        if current is None:
            raise RuntimeError("Generations.first() must be called before any change")
        return current

    @staticmethod
    def _key(generation: int, name: str) -> str:
        return f"{PREFIX}{generation}/{name}"


def newest(store: dist.Store) -> tuple[int, tuple[str, ...]] | None:
    """The newest closed generation on ``store`` and its members; None if none (``latest`` is a hint: the
    generations closed after it are found by reading on)."""
    latest = f"{PREFIX}latest"
    if not store.check([latest]):
        return None
    generation = int(store.get(latest).decode())
    members = _closed_list(store, generation)
    if members is None:
        return None
    while (newer := _closed_list(store, generation + 1)) is not None:
        generation, members = generation + 1, newer
    return generation, members


def alive(store: dist.Store, timeout_s: float = 1.0, *, finished_counts: bool = True) -> bool:
    """Whether a member of the newest generation on ``store`` still lives (its liveness socket accepts a
    connection within ``timeout_s``) or finished its training (:meth:`Generations.finish`; unless not
    ``finished_counts``, as for a worker that would join): for the rendezvous, while one does, the workers go on
    in-process."""
    running = newest(store)
    if running is None:
        return False
    for uid in running[1]:
        if finished_counts and store.check([f"{PREFIX}finished/{uid}"]):
            return True
        key = f"{PREFIX}addr/{uid}"
        if not store.check([key]):
            continue
        host, _, port = store.get(key).decode().rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


def _closed_list(store: dist.Store, generation: int) -> tuple[str, ...] | None:
    key = f"{PREFIX}{generation}/closed"
    if not store.check([key]):
        return None
    return tuple(store.get(key).decode().split("\n"))


def describe(membership: Membership, before: Membership | None) -> str:
    """One line for the log: generation, world size and who left or joined."""
    if before is None:
        return f"generation {membership.generation}: {membership.world_size} worker(s)"
    left = sorted(set(before.members) - set(membership.members))
    joined = sorted(set(membership.members) - set(before.members))
    return (f"generation {membership.generation}: {membership.world_size} worker(s) (was {before.world_size}"
            + (f"; left: {', '.join(left)}" if left else "") + (f"; joined: {', '.join(joined)}" if joined else "")
            + ")")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
