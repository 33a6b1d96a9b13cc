"""Reachability between the nodes of a round: the ``etcd-v3`` rendezvous's ``reach_check``.

A node cut off from its peers but not from etcd keeps its lease, so without this check every round
includes it again and forming the process group waits for a peer that nobody can reach. With it,
each agent, once a round completes:

1. knows every member's probe address from the round's membership (each node put the address of
   its probe listener, a TCP socket the agent holds open for its whole life, into its node key);
2. connects to the listeners of the :data:`PROBES` members after it on the ring of ranks, all at
   once, each within ``reach_timeout`` (a connection needs packets both ways, so a one-way cut is a
   cut too): a node makes at most :data:`PROBES` probes per round and receives at most as many,
   whatever the size of the job;
3. publishes the ranks it could not reach as ``reach/report/<rank>`` in the round's store (steps 2 and 3
   are :func:`report`, which the handler runs as soon as the membership is known);
4. rank 0, the judge, waits for every report until ``2 * reach_timeout`` after it started (a node
   that published none is left out), computes which nodes to leave out (:func:`exclusions`) and
   writes it with a compare-and-set on ``reach/verdict``; every agent acts on that verdict. A node
   that sees no verdict in time (the judge died) computes one itself from the reports and proposes
   it with the same compare-and-set: the first proposal wins, so all still agree.

A node cut off from everyone is reported by its :data:`PROBES` predecessors and reports its
successors: it has twice as many cut links as anyone else and is the one left out. A cut between two
nodes that are not within :data:`PROBES` of each other on the ring is not seen here; forming the
process group then fails and the agents restart it.

A node left out steps out of the round and re-joins once it reaches the nodes of the job nearest to
it again; the others re-form at once without it (see ``etcd.EtcdRendezvousHandler``). When every node
reaches its neighbours, the check costs one write per node and one for the verdict, and no wait.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)
T = TypeVar("T")

REPORT_KEY = "reach/report/%d"
VERDICT_KEY = "reach/verdict"
PROBES = 3
"""How many ring neighbours each node probes per round (and at most how many probe it)."""
JUDGE = 0
ALIVE = b"+"
"""What a running agent's listener writes to every connection."""
_NONE = "-"
"""How an empty rank list is written (a store value must not be empty: compare-and-set reads b"" as missing)."""


class ProbeListener:
    """A TCP listener that accepts every connection, writes :data:`ALIVE` to it and closes it: the other agents'
    probe target.

    The kernel completes a connection before ``accept`` runs, so a busy agent is reached as fast as its network
    allows (:func:`reaches`); the byte comes from the agent itself, so only a running agent answers
    (:func:`answers`): a frozen one's kernel still completes connections."""

    def __init__(self, host: str, bind: str | None = None) -> None:
        """Listen on ``bind`` (default ``host``; ``""``: every interface) and advertise ``host``."""
        bind = host if bind is None else bind
        if bind:
            self._socket = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
            self._socket.bind((bind, 0))
        else:
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True) \
                if socket.has_dualstack_ipv6() else socket.create_server(("", 0))
        self._socket.listen(64)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="etcd-v3-reach-listener", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            try:
                connection.sendall(ALIVE)
            except OSError:
                pass  # a reachability probe closes at once
            finally:
                connection.close()

    def close(self) -> None:
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()


def parse_address(value: bytes) -> tuple[str, int] | None:
    """``host:port`` as a listener publishes it; ``None`` for anything else (values from etcd are checked)."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    host, _, port = text.rpartition(":")
    if not host or len(host) > 255 or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if any(char.isspace() for char in host):
        return None
    return host, int(port)


def reaches(address: tuple[str, int], timeout: float) -> bool:
    """Whether a TCP connection to ``address`` completes within ``timeout`` seconds."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def answers(address: tuple[str, int], timeout: float) -> bool:
    """Whether the agent listening at ``address`` is running: it sends :data:`ALIVE` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection(address, timeout=timeout) as connection:
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            return connection.recv(len(ALIVE)) == ALIVE
    except OSError:
        return False


def probe(addresses: Mapping[T, tuple[str, int]], timeout: float) -> frozenset[T]:
    """The keys (ranks, nodes) whose address accepted a TCP connection within ``timeout``; all probed at once
    from this thread (non-blocking connects, one wait for all of them)."""
    pending: dict[socket.socket, T] = {}
    reached: set[T] = set()
    with selectors.DefaultSelector() as selector:
        try:
            for key, address in addresses.items():
                try:
                    infos = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)
                    family, kind, proto, _, target = infos[0]
                    sock = socket.socket(family, kind, proto)
                except OSError:
                    continue
                sock.setblocking(False)
                pending[sock] = key
                if sock.connect_ex(target) not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                    continue  # refused at once: not reached
                selector.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + timeout
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for selected, _ in selector.select(remaining):
                    sock = selected.fileobj  # type: ignore[assignment]
                    selector.unregister(sock)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        reached.add(pending[sock])
        finally:
            for sock in pending:
                sock.close()
    return frozenset(reached)


def successors(item: T, ring: list[T], count: int) -> list[T]:
    """The ``count`` items after ``item`` on ``ring`` (wrapping; never ``item`` itself; ``item`` need not be on
    it: then those after where it would sort)."""
    others = [other for other in ring if other != item]
    if not others:
        return []
    start = next((index for index, other in enumerate(others) if other > item), 0)  # type: ignore[operator]
    return [others[(start + offset) % len(others)] for offset in range(min(count, len(others)))]


def ring_targets(rank: int, world_size: int, count: int = PROBES) -> list[int]:
    """The ranks ``rank`` probes: the ``count`` after it on the ring of ranks."""
    return [(rank + offset) % world_size for offset in range(1, min(count, world_size - 1) + 1)]


def exclusions(world_size: int, reports: Mapping[int, frozenset[int] | None]) -> frozenset[int]:
    """Which ranks to leave out so that no reported cut remains.

    ``reports[r]`` is the set of ranks rank ``r`` probed and could not reach (``None`` or missing: ``r``
    published no report, so it is left out). Greedy and deterministic: the node with the most cut links
    goes first, the higher rank on a tie (so in a two-node cut rank 0 stays).
    """
    excluded = {rank for rank in range(world_size) if reports.get(rank) is None}
    cut: set[tuple[int, int]] = set()
    for rank, unreached in reports.items():
        if unreached is None or rank in excluded:
            continue
        for other in unreached:
            if other not in excluded and other != rank:
                cut.add((min(rank, other), max(rank, other)))
    while cut:
        links = Counter(rank for pair in cut for rank in pair)
        worst = max(links, key=lambda rank: (links[rank], rank))
        excluded.add(worst)
        cut = {pair for pair in cut if worst not in pair}
    return frozenset(excluded)


def encode_ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return ",".join(map(str, ordered)) if ordered else _NONE


def decode_ranks(value: bytes, world_size: int) -> frozenset[int] | None:
    """The ranks in a published list; ``None`` if it is malformed or names a rank outside the world."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    if text == _NONE:
        return frozenset()
    parts = text.split(",")
    if not all(part.isdigit() and len(part) <= 6 for part in parts):
        return None
    ranks = frozenset(int(part) for part in parts)
    return ranks if all(rank < world_size for rank in ranks) else None


@dataclass(frozen=True)
class Report:
    """What one agent found and published for one round (steps 2-3 of the module docstring)."""

    rank: int
    world_size: int
    unreached: frozenset[int]
    started: float
    """When the check began (monotonic): the judge waits for the reports until ``2 * timeout`` after it."""
    timeout: float


def report(store: dist.Store, rank: int, world_size: int, addresses: Sequence[str], timeout: float) -> Report:
    """Probe this agent's ring successors and publish which it could not reach (steps 2-3)."""
    started = time.monotonic()
    targets = ring_targets(rank, world_size)
    known = {target: address for target in targets
             if target < len(addresses) and (address := parse_address(addresses[target].encode())) is not None}
    reached = probe(known, timeout)
    unreached = frozenset(targets) - reached
    store.set(REPORT_KEY % rank, encode_ranks(unreached))
    return Report(rank, world_size, unreached, started, timeout)


def agree(store: dist.Store, mine: Report) -> frozenset[int]:
    """The ranks every agent of the round agrees to leave out (step 4), after this agent's :func:`report`."""
    rank, world_size, timeout = mine.rank, mine.world_size, mine.timeout
    deadline = mine.started + 2 * timeout
    agreed: frozenset[int] | None = None
    if rank == JUDGE:
        agreed = _propose(store, world_size, deadline)
    else:
        verdict = _read_present(store, [VERDICT_KEY], deadline + timeout)[0]
        agreed = decode_ranks(verdict, world_size) if verdict is not None else _propose(store, world_size, 0.0)
    if agreed is None:
        raise ValueError(f"etcd-v3: the round's reachability verdict is malformed in the store (key {VERDICT_KEY})")
    if agreed or mine.unreached:
        logger.warning(
            "etcd-v3: reachability check of rank %d in %.2f s: unreached %s; the round leaves out %s",
            rank, time.monotonic() - mine.started, sorted(mine.unreached) or "none", sorted(agreed) or "nobody",
        )  # fmt: skip
    return agreed


def check_round(
    store: dist.Store, rank: int, world_size: int, addresses: Sequence[str], timeout: float
) -> frozenset[int]:
    """Run the check for one completed round (steps 2-4 of the module docstring) on the round's store;
    ``addresses[r]`` is rank ``r``'s probe address (empty: it has no listener). Returns the ranks every
    agent of the round agreed to leave out."""
    return agree(store, report(store, rank, world_size, addresses, timeout))


def _propose(store: dist.Store, world_size: int, deadline: float) -> frozenset[int] | None:
    """Read the reports (waiting for all of them until ``deadline``), propose a verdict, return the one agreed."""
    values = _read_present(store, [REPORT_KEY % other for other in range(world_size)], deadline)
    reports = {other: decode_ranks(value, world_size) if value is not None else None for other, value in enumerate(values)}
    proposal = encode_ranks(exclusions(world_size, reports))
    return decode_ranks(store.compare_set(VERDICT_KEY, "", proposal), world_size)


def _read_present(store: dist.Store, keys: list[str], deadline: float) -> list[bytes | None]:
    """Each key's value, waiting for all of them until ``deadline`` (monotonic; a past one: no wait); then
    ``None`` for those still missing."""
    if not keys:
        return []
    remaining = deadline - time.monotonic()
    if remaining > 0:
        try:
            store.wait(keys, timedelta(seconds=remaining))
            return [bytes(value) for value in store.multi_get(keys)]
        except dist.DistStoreError:
            pass
    return [bytes(store.get(key)) if store.check([key]) else None for key in keys]
