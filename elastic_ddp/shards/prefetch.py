"""Plan-driven prefetch: fetch ahead exactly the pieces this rank's next steps will read.

The global cursor knows the future: from the committed position, :meth:`ElasticSampler.plan` gives every
next step, and the sampler's split gives this rank's samples of each at the current world size. A
:class:`Prefetcher` walks the next ``steps`` steps, maps this rank's samples to the pieces that hold them,
and has the node's cache fetch the missing ones in order of need, at most ``inflight`` at a time (each holds
one piece in memory), and at most ``max_bytes`` ahead of where its window starts (a quarter of the cache's
budget, shared by the node's ranks). The first window starts at the committed position; later ones after
the steps the DataLoader was handed (``sampler.dispatched``; its workers read those, up to
``num_workers × prefetch_factor`` micro-batches ahead), and each is planned again when that moves, looking
only at pieces new to the window: one read by a worker may have been evicted since, and fetching it again
would be for nothing.
After a world-size change the new workers build a new sampler and a new prefetcher, so the plan is the new
split's from their first step.

A piece a DataLoader worker needs while the prefetcher fetches it is not fetched twice: the worker waits
on the piece's lock in the cache and then reads the file.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from elastic_ddp.data import DataPosition, ElasticSampler
from elastic_ddp.errors import DataError

logger = logging.getLogger(__name__)

POLL_S = 0.01
"""How often the thread looks whether the committed position moved (a read of one attribute)."""
HOLD_S = 60.0
"""A planned piece's use time is set this far ahead, so least-recently-used eviction takes every piece read
until then first: what was fetched ahead is not evicted before it is read (a read sets its use time to the
read's). A piece the plan dropped (a world-size change) is held at most this long."""


class Prefetcher:
    """Fetches this rank's next pieces in the background; see the module's docstring."""

    def __init__(self, dataset: Any, sampler: ElasticSampler, *, steps: int = 8, inflight: int = 4,
                 max_bytes: int = 0) -> None:
        if steps < 1 or inflight < 1 or max_bytes < 0:
            raise DataError(f"prefetch needs steps >= 1, inflight >= 1 and max_bytes >= 0 (got {steps}, {inflight}, {max_bytes})")
        self.dataset, self.sampler = dataset, sampler
        self.reader = dataset.reader
        self.steps, self.inflight = steps, inflight
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        self.max_bytes = max_bytes or max(self.reader.index.piece_bytes, self.reader.cache.budget // (4 * local_ranks))
        """Bytes of pieces planned ahead at most. Default: a quarter of the cache's budget, shared by the node's ranks
        (torchrun's ``LOCAL_WORLD_SIZE``): the pieces fetched ahead must not evict those the workers read now, or
        they are evicted themselves before they are read, and everything is downloaded twice."""
        self.error: BaseException | None = None
        """The first fetch that failed (logged; a worker that needs that piece fetches it itself, and raises)."""
        self.settled_at: DataPosition | None = None
        """The position whose window is fetched (or failed): nothing planned is left in flight."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic_ddp-prefetch", daemon=True)

    def start(self) -> Prefetcher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def plan(self, position: DataPosition) -> list[tuple[int, int]]:
        """The ``(shard, piece)`` pairs this rank's next ``steps`` steps from ``position`` read, in order of need,
        cut at ``max_bytes``."""
        ranges = []
        for _ in range(self.steps):
            plan = self.sampler.plan(position)
            start, stop = self.sampler.local_share(plan)
            for sample in self.sampler.global_ids(plan)[start:stop].tolist():
                ranges.extend(self.dataset.byte_ranges(sample))
            position = plan.next_position
        pieces: list[tuple[int, int]] = []
        total = 0
        for shard, piece in self.reader.pieces(ranges):
            start, stop = self.reader.index.piece_range(self.reader.index.shards[shard], piece)
            total += stop - start
            if total > self.max_bytes and pieces:
                break
            pieces.append((shard, piece))
        return pieces

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=self.inflight, thread_name_prefix="elastic_ddp-fetch") as pool:
            position: DataPosition | None = None
            todo: deque[tuple[int, int]] = deque()
            seen: set[tuple[int, int]] = set()
            running: set[Future[str]] = set()
            while not self._stop.is_set():
                # The first window starts at the committed position: nothing is read yet, and fetching several
                # pieces at once beats a worker's reads one after another. Later ones start after the steps the
                # loader was handed (its workers load up to num_workers x prefetch_factor micro-batches ahead):
                # those were read, and may have been evicted since.
                now = self.sampler.position if position is None else (self.sampler.dispatched or self.sampler.position)
                if now != position:
                    position = now
                    window = self.plan(position)
                    # Each piece is looked at once while it stays in the window: one found cached (and held) or
                    # fetched for an earlier position may since have been read by a worker and evicted, and
                    # fetching it again would be for nothing; a worker that still needs it fetches it itself.
                    # Pieces still to fetch from the window before stay queued (the first window's above all:
                    # the workers are reading those steps now, slower than the fetches at once).
                    seen.intersection_update(set(window) | set(todo))
                    for planned in window:
                        if planned in seen:
                            continue
                        seen.add(planned)
                        if not self.reader.cache.touch(self.reader.piece_key(*planned), HOLD_S):
                            todo.append(planned)
                running = {future for future in running if not future.done()}
                if not todo and not running:
                    self.settled_at = position
                while todo and len(running) < self.inflight:
                    shard, piece = todo.popleft()
                    future = pool.submit(self.reader.ensure, shard, piece, HOLD_S)
                    future.add_done_callback(self._failed)
                    running.add(future)
                self._stop.wait(POLL_S)

    def _failed(self, future: Future[str]) -> None:
        error = future.exception()
        if error is not None and self.error is None:
            self.error = error
            logger.warning("shard prefetch: %s (a worker that needs the piece will fetch it and raise if it fails again)", error)

