"""Reachability between the nodes of a round: the ``etcd-v3`` rendezvous's ``reach_check``.

A node cut off from its peers but not from etcd keeps heartbeating, so without this check
every round includes it again and forming the process group waits for a peer that nobody can
reach. With it, each agent, once a round completes:

1. publishes the address of its probe listener (a TCP socket the agent holds open for its
   whole life, on its ``--local-addr``, or on every interface when torchrun was given none, as
   the workers' store does) under the round's store as ``reach/addr/<rank>``;
2. connects to every other agent's listener, all at once, each within ``reach_timeout``
   (a connection needs packets both ways, so a one-way cut is a cut too);
3. publishes the ranks it reached as ``reach/seen/<rank>``, and waits for the others' lists
   until ``2 * reach_timeout`` after it started;
4. computes which nodes to leave out (:func:`exclusions`) and proposes it with a
   compare-and-set on ``reach/verdict``: the first proposal wins and every agent acts on that
   one, so all agree even when a late list reached some of them and not others.

A node left out steps out of the round and re-joins once it reaches every other node of the job
again (those of the round, waiting for the next, or heartbeating); the others re-form without it
at once (see ``etcd.EtcdRendezvousHandler``). When every node reaches every other, the check
costs a few etcd round trips and no wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)
T = TypeVar("T")

ADDRESS_KEY = "reach/addr/%d"
SEEN_KEY = "reach/seen/%d"
VERDICT_KEY = "reach/verdict"
NODE_KEY = "reach/node/%s"
"""Outside any round: a node's probe address by its rendezvous descriptor, for a node that stepped out."""
_NONE = "-"
"""How an empty rank list is written (a store value must not be empty: compare-and-set reads b"" as missing)."""


class ProbeListener:
    """A TCP listener that accepts and closes every connection: the other agents' probe target.

    The kernel completes a connection before ``accept`` runs, so a busy agent answers as fast as
    its network does."""

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


def probe(addresses: Mapping[T, tuple[str, int]], timeout: float) -> frozenset[T]:
    """The keys (ranks, nodes) whose address accepted a connection within ``timeout``; all probed at once."""
    if not addresses:
        return frozenset()
    with ThreadPoolExecutor(max_workers=min(32, len(addresses)), thread_name_prefix="etcd-v3-reach") as pool:
        outcomes = dict(zip(addresses, pool.map(lambda key: reaches(addresses[key], timeout), addresses)))
    return frozenset(key for key, ok in outcomes.items() if ok)


def exclusions(world_size: int, seen: Mapping[int, frozenset[int] | None]) -> frozenset[int]:
    """Which ranks to leave out so that every remaining pair reaches each other.

    ``seen[r]`` is the set of ranks rank ``r`` reached (``None`` or missing: ``r`` published no list,
    so it is left out). A pair is cut when either side failed to reach the other. Greedy and
    deterministic: the node with the most cut links goes first, the higher rank on a tie (so in a
    two-node cut rank 0 stays).
    """
    excluded = {rank for rank in range(world_size) if seen.get(rank) is None}
    cut: set[tuple[int, int]] = set()
    for a in range(world_size):
        for b in range(a + 1, world_size):
            if a in excluded or b in excluded:
                continue
            seen_a, seen_b = seen[a], seen[b]
            assert seen_a is not None and seen_b is not None
            if b not in seen_a or a not in seen_b:
                cut.add((a, b))
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


def check_round(store: dist.Store, rank: int, world_size: int, listener: ProbeListener, timeout: float) -> frozenset[int]:
    """Run the check for one completed round (steps 1-4 of the module docstring) on the round's store;
    the ranks every agent of the round agreed to leave out."""
    started = time.monotonic()
    deadline = started + 2 * timeout
    others = [other for other in range(world_size) if other != rank]
    store.set(ADDRESS_KEY % rank, listener.address)
    targets = _addresses(others, _read_present(store, [ADDRESS_KEY % other for other in others], deadline - timeout))
    reached = probe(targets, timeout) | {rank}
    store.set(SEEN_KEY % rank, encode_ranks(reached))
    lists = _read_present(store, [SEEN_KEY % other for other in range(world_size)], deadline)
    seen = {other: decode_ranks(value, world_size) if value is not None else None for other, value in enumerate(lists)}
    proposal = encode_ranks(exclusions(world_size, seen))
    agreed = decode_ranks(store.compare_set(VERDICT_KEY, "", proposal), world_size)
    if agreed is None:
        raise ValueError(f"etcd-v3: the round's reachability verdict is malformed in the store (key {VERDICT_KEY})")
    unreached = sorted(set(targets) - reached)
    if agreed or unreached:
        logger.warning(
            "etcd-v3: reachability check of rank %d in %.2f s: unreached %s, unpublished %s; the round leaves out %s",
            rank, time.monotonic() - started, unreached or "none",
            sorted(set(others) - set(targets)) or "none", sorted(agreed) or "nobody",
        )  # fmt: skip
    return agreed


def node_addresses(store: dist.Store, nodes: list[str]) -> dict[str, tuple[str, int]]:
    """The probe addresses the given nodes published under :data:`NODE_KEY` (those present and well formed)."""
    return _addresses(nodes, _read_present(store, [NODE_KEY % node for node in nodes], deadline=0.0))


def _addresses(ids: Iterable[T], values: Iterable[bytes | None]) -> dict[T, tuple[str, int]]:
    """Each id's address from the value read for it, leaving out the missing and the malformed."""
    return {key: address for key, value in zip(ids, values)
            if value is not None and (address := parse_address(value)) is not None}


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
