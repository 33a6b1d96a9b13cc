"""A node-local cache of shard pieces: a byte budget, least-recently-used eviction, one download per piece per
node, and nothing served that did not verify (docs/design.md, "Sharded data").

Every process of a node (ranks, their DataLoader workers, prefetch threads) opens the same directory:

- a piece is fetched by one process at a time: the others wait on its lock (``flock``) and then find it;
- its bytes are checked against the index's SHA-256 before they are written; they are written to a
  private partial file and renamed into place, so a piece file that exists is whole and verified. A
  corrupt or short download is fetched again (a few times), then refused with the shard and piece named;
- before a download, its size is reserved under the directory's lock: least-recently-used pieces are
  evicted until the pieces present plus every reservation fit in the budget. The cache therefore never
  holds more than its budget, downloads in flight included. A reservation of a process that died is
  dropped at the next scan. A reader that already opened an evicted piece keeps reading it (the file
  is unlinked, not changed).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from elastic_ddp.errors import DataError

logger = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3
"""Downloads of one piece before a bad one is refused (a corrupt transfer is fetched again)."""
FULL_WAIT_S = 120.0
"""How long a download waits for room when the budget is taken by other processes' reservations."""
_LOCKS, _PARTIAL, _RESERVED = ".locks", ".partial", ".reserved"
_DIRLOCK = ".cache.lock"


class ShardIntegrityError(DataError):
    """A piece read from storage does not match the index after every attempt."""


class CacheFullError(DataError):
    """The budget cannot hold a piece (too small, or taken by downloads in flight for too long)."""


@dataclass
class CacheStats:
    """What this process did with the cache (each process counts its own)."""

    hits: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    waited_for_peer: int = 0
    """Pieces another process of the node was fetching: this one waited and downloaded nothing."""
    evicted: int = 0
    refetched_corrupt: int = 0


class ShardCache:
    """Pieces under ``root``, at most ``limit_bytes`` in all (see the module's docstring)."""

    def __init__(self, root: str | os.PathLike[str], limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise DataError(f"shard cache budget must be >= 1 byte, got {limit_bytes}")
        self.root = Path(root)
        self.budget = limit_bytes
        self.stats = CacheStats()
        for name in (_LOCKS, _PARTIAL, _RESERVED):
            (self.root / name).mkdir(parents=True, exist_ok=True)

    # -- public --------------------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        """Where piece ``key`` (``NAME`` or ``FOLDER/NAME``) lies when cached."""
        return self.root / key

    def get(self, key: str, size: int, sha256: str, fetch: Callable[[], bytes], *, hold_s: float = 0.0) -> Path:
        """The verified piece ``key`` (``size`` bytes, SHA-256 ``sha256``), fetched with ``fetch`` by this process
        or another of the node when it is not cached yet. Its use time is refreshed (LRU); with ``hold_s`` it is
        set that far ahead, so the piece is evicted after every piece used until then (a piece fetched ahead is
        held until it is read, when its use time becomes the read's)."""
        if key.startswith(".") or "/." in key or key.count("/") > 1 or key.endswith("/"):
            raise DataError(f"shard cache key {key!r} is not NAME or FOLDER/NAME (neither starting with '.')")
        target = self.root / key
        if _touch(target, hold_s):
            self.stats.hits += 1
            return target
        if size > self.budget:
            raise CacheFullError(f"piece {key} has {size:,} bytes, more than the shard cache's whole budget "
                                 f"({self.budget:,} bytes): raise the budget or build the index with smaller pieces")
        target.parent.mkdir(parents=True, exist_ok=True)
        with _flock(self.root / _LOCKS / _flat(key)):
            if _touch(target, hold_s):
                self.stats.waited_for_peer += 1
                return target
            with self._reservation(key, size):
                data = self._verified(key, size, sha256, fetch)
                partial = self.root / _PARTIAL / f"{_flat(key)}.{os.getpid()}"
                with open(partial, "wb") as handle:
                    handle.write(data)
                os.replace(partial, target)
                _touch(target, hold_s)
        self.stats.fetched += 1
        self.stats.fetched_bytes += size
        return target

    def usage(self) -> int:
        """Bytes the cache holds or has reserved now: what the budget bounds."""
        reserved = sum(self._reservations().values())  # first: see _make_room
        return reserved + sum(size for _, size, _ in self._pieces())

    def touch(self, key: str, ahead_s: float = 0.0) -> bool:
        """Set piece ``key``'s use time to now plus ``ahead_s`` (see :meth:`get`); False when it is not cached."""
        return _touch(self.root / key, ahead_s)

    def cached(self, key: str) -> bool:
        return (self.root / key).exists()

    # -- inside ----------------------------------------------------------------------------------------------

    def _verified(self, key: str, size: int, sha256: str, fetch: Callable[[], bytes]) -> bytes:
        why = ""
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            data = fetch()
            if len(data) != size:
                why = f"{len(data):,} bytes instead of {size:,}"
            elif hashlib.sha256(data).hexdigest() != sha256:
                why = "its SHA-256 does not match the index"
            else:
                return data
            self.stats.refetched_corrupt += 1
            logger.warning("shard piece %s: attempt %d of %d: %s; fetching it again", key, attempt, FETCH_ATTEMPTS, why)
        raise ShardIntegrityError(f"shard piece {key}: {why}, in {FETCH_ATTEMPTS} downloads: the shard in storage no "
                                  "longer matches its index (rebuild the index, or restore the shard)")

    @contextmanager
    def _reservation(self, key: str, size: int) -> Iterator[None]:
        marker = self.root / _RESERVED / f"{_flat(key)}.{os.getpid()}"
        deadline = time.monotonic() + FULL_WAIT_S
        while True:
            with _flock(self.root / _DIRLOCK):
                if self._make_room(size):
                    with open(marker, "wb") as handle:
                        handle.truncate(size)  # a sparse file: its length is the reservation
                    break
            if time.monotonic() > deadline:
                raise CacheFullError(f"no room for piece {key} ({size:,} bytes) in the shard cache ({self.budget:,} "
                                     f"bytes) for {FULL_WAIT_S:.0f} s: other downloads hold it; raise the budget")
            time.sleep(0.05)
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)

    def _make_room(self, size: int) -> bool:
        """Under the directory lock: evict least-recently-used pieces until ``size`` more bytes fit; False when
        the reservations of downloads in flight leave no room yet."""
        # Reservations first, then pieces: a download renames its piece into place outside this lock and then
        # drops its reservation, so read in this order it is counted once or twice, never missed.
        reserved = sum(self._reservations().values())
        pieces = sorted(self._pieces(), key=lambda item: item[2])
        used = reserved + sum(item[1] for item in pieces)
        for path, piece_size, _ in pieces:
            if used + size <= self.budget:
                break
            path.unlink(missing_ok=True)
            used -= piece_size
            self.stats.evicted += 1
        return used + size <= self.budget

    def _pieces(self) -> Iterator[tuple[Path, int, int]]:
        """``(path, bytes, last use)`` of every cached piece: the files under ``root`` and in its folders, one level
        down (a key is ``NAME`` or ``FOLDER/NAME``), leaving out the cache's own (``.locks``, ``.partial``, ...)."""
        for entry in os.scandir(self.root):
            if entry.name.startswith("."):
                continue
            for item in os.scandir(entry.path) if entry.is_dir() else (entry,):
                try:
                    stat = item.stat()
                except FileNotFoundError:
                    continue
                if not item.name.startswith("."):
                    yield Path(item.path), stat.st_size, stat.st_mtime_ns

    def _reservations(self) -> dict[str, int]:
        """Reserved bytes by marker; markers (and partial files) of processes that are gone are removed."""
        found: dict[str, int] = {}
        for folder in (_RESERVED, _PARTIAL):
            for entry in os.scandir(self.root / folder):
                pid = entry.name.rsplit(".", 1)[-1]
                if not pid.isdigit() or not _alive(int(pid)):
                    Path(entry.path).unlink(missing_ok=True)
                elif folder == _RESERVED:
                    try:
                        found[entry.name] = entry.stat().st_size
                    except FileNotFoundError:
                        pass
        return found


def _flat(key: str) -> str:
    return key.replace("/", "__")


def _touch(path: Path, ahead_s: float = 0.0) -> bool:
    """Set ``path``'s use time to now (plus ``ahead_s``); False when it is not there."""
    now = time.time_ns() + int(ahead_s * 1e9)  # explicit: the kernel's own stamp is coarser than two reads apart
    try:
        os.utime(path, ns=(now, now))
        return True
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
