"""Sharded data on local storage: the index, the datasets, the node cache (budget, one download, integrity) and
plan-driven prefetch. The same code on the S3 endpoint: tests/integration/test_shards_s3.py."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import tarfile
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from elastic_ddp.data import DataPosition, ElasticSampler
from elastic_ddp.errors import DataError
from elastic_ddp.shards import (
    CacheFullError,
    ShardCache,
    ShardIntegrityError,
    ShardReader,
    TarSamples,
    TokenWindows,
    build_index,
)
from elastic_ddp.shards.cache import _flat, _flock
from elastic_ddp.shards.index import parse_index

FS = fsspec.filesystem("file")
PIECE = 4096


def _token_shards(root: Path, sizes: tuple[int, ...] = (5000, 3001, 7777), dtype: str = "uint16") -> list[np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards = []
    for number, size in enumerate(sizes):
        tokens = rng.integers(0, 50_000 if dtype != "uint8" else 256, size=size).astype(dtype)
        (root / f"train-{number:05d}.bin").write_bytes(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
        shards.append(tokens)
    return shards


def _reader(root: Path, cache: Path, budget: int = 1 << 30) -> ShardReader:
    return ShardReader(str(root), cache_dir=str(cache), cache_bytes=budget)


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    root = tmp_path / "shards"
    arrays = _token_shards(root)
    build_index(str(root), FS, kind="tokens", dtype="uint16", piece_bytes=PIECE)
    return root, arrays


# -- index ---------------------------------------------------------------------------------------------------


def test_the_index_records_each_shard_with_its_pieces_digests(tokens: tuple[Path, list[np.ndarray]]) -> None:
    root, arrays = tokens
    index = _reader(root, root.parent / "cache").index
    assert [s.name for s in index.shards] == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    for shard, array in zip(index.shards, arrays):
        data = array.tobytes()
        assert shard.tokens == len(array) and shard.bytes == len(data)
        assert shard.sha256 == hashlib.sha256(data).hexdigest()
        assert list(shard.pieces) == [hashlib.sha256(data[i : i + PIECE]).hexdigest() for i in range(0, len(data), PIECE)]


def test_a_shard_that_changed_size_after_indexing_is_refused_on_open(tokens: tuple[Path, list[np.ndarray]]) -> None:
    root, _ = tokens
    with open(root / "train-00001.bin", "ab") as handle:
        handle.write(b"\0\0")
    with pytest.raises(DataError, match="train-00001.bin has 6004 bytes in storage, the index says 6002"):
        _reader(root, root.parent / "cache")


def test_a_missing_index_names_the_command_that_builds_it(tmp_path: Path) -> None:
    _token_shards(tmp_path / "s")
    with pytest.raises(DataError, match="elastic-ddp shards index"):
        _reader(tmp_path / "s", tmp_path / "cache")


@pytest.mark.parametrize("edit, message", [
    (lambda body: body.update(version=9), "version 9"),
    (lambda body: body["shards"][0].update(name="../etc/passwd"), "not a plain file name"),
    (lambda body: body["shards"][0]["pieces"].pop(), "must list 3 hex SHA-256"),
    (lambda body: body["shards"][0].update(tokens=7), "7 tokens of 2 bytes are not its 10000 bytes"),
    (lambda body: body.update(piece_bytes=True), "piece_bytes True is not an integer"),
    (lambda body: body["shards"].append(dict(body["shards"][0])), "listed twice"),
])
def test_an_index_from_storage_is_checked_value_by_value(tokens: tuple[Path, list[np.ndarray]], edit, message: str) -> None:
    root, _ = tokens
    body = json.loads((root / "index.json").read_bytes())
    edit(body)
    with pytest.raises(DataError, match=message):
        parse_index(json.dumps(body).encode())


def test_an_index_that_is_not_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"index.json: not a valid shard index: not JSON"):
        parse_index(b"\x80not json")


# -- datasets ------------------------------------------------------------------------------------------------


def test_token_windows_serve_every_window_of_every_shard_and_none_crosses_a_shard(tokens: tuple[Path, list[np.ndarray]]) -> None:
    root, arrays = tokens
    context = 64
    data = TokenWindows(_reader(root, root.parent / "cache"), context)
    expected = [array[w * context : w * context + context + 1].astype(np.int64)
                for array in arrays for w in range((len(array) - 1) // context)]
    assert len(data) == len(expected) == 78 + 46 + 121
    for i in (0, 77, 78, 123, 124, len(data) - 1, 100):
        inputs, targets, sample = data[i]
        assert sample == i
        assert inputs.tolist() == expected[i][:-1].tolist() and targets.tolist() == expected[i][1:].tolist()
        assert inputs.dtype == torch.int64
    with pytest.raises(IndexError):
        data[len(data)]


def _tar_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as archive:
        for key, members in samples:
            for ext, body in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                archive.addfile(info, io.BytesIO(body))


def test_tar_samples_in_the_webdataset_layout_are_read_by_range(tmp_path: Path) -> None:
    root = tmp_path / "tars"
    root.mkdir()
    rng = np.random.default_rng(1)
    everything = []
    for shard in range(2):
        samples = [(f"s{shard}{n:04d}", {"input.bin": rng.bytes(int(rng.integers(1, 3000))), "cls": str(n % 7).encode()})
                   for n in range(20)]
        _tar_shard(root / f"part-{shard}.tar", samples)
        everything += samples
    build_index(str(root), FS, kind="tar", piece_bytes=PIECE)
    data = TarSamples(_reader(root, tmp_path / "cache"), lambda members, i: (members, i))
    assert len(data) == 40
    for i in (0, 19, 20, 39, 7):
        members, sample = data[i]
        assert sample == i and members == everything[i][1] and data.key(i) == everything[i][0]


def test_a_tar_whose_sample_members_are_apart_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "tars"
    root.mkdir()
    _tar_shard(root / "bad.tar", [("a", {"x": b"1"}), ("b", {"x": b"2"}), ("a", {"y": b"3"})])
    with pytest.raises(DataError, match="members of sample 'a' are not next to each other"):
        build_index(str(root), FS, kind="tar", piece_bytes=PIECE)


# -- the node cache ------------------------------------------------------------------------------------------


def _piece(n: int, size: int = 1000) -> tuple[bytes, str]:
    body = bytes([n % 251]) * size
    return body, hashlib.sha256(body).hexdigest()


def test_the_cache_evicts_the_least_recently_used_piece_to_stay_within_its_budget(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 2500)
    for n in range(2):
        body, sha = _piece(n)
        cache.get(f"d/{n}", 1000, sha, lambda body=body: body)
    cache.get("d/0", 1000, _piece(0)[1], lambda: pytest.fail("a cached piece is fetched again"))  # 0 is now newest
    body, sha = _piece(2)
    cache.get("d/2", 1000, sha, lambda: body)
    assert cache.cached("d/0") and not cache.cached("d/1") and cache.cached("d/2")
    assert cache.usage() == 2000 and cache.stats.evicted == 1


def test_a_piece_fetched_ahead_is_held_until_it_is_read_then_ages_as_any_other(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 3500)
    pieces = {n: _piece(n) for n in range(6)}
    cache.get("d/0", 1000, pieces[0][1], lambda: pieces[0][0], hold_s=60)  # the prefetcher's: read later
    for n in (1, 2, 3):  # reads of the current steps: d/1 is the oldest of them when d/3 needs room
        cache.get(f"d/{n}", 1000, pieces[n][1], lambda n=n: pieces[n][0])
    assert cache.cached("d/0") and not cache.cached("d/1")
    cache.get("d/0", 1000, pieces[0][1], lambda: pytest.fail("a held piece was fetched again"))  # read: held no more
    for n in (4, 5):
        cache.get(f"d/{n}", 1000, pieces[n][1], lambda n=n: pieces[n][0])
    assert not cache.cached("d/2") and not cache.cached("d/3") and cache.cached("d/0")
    cache.get("d/1", 1000, pieces[1][1], lambda: pieces[1][0])
    assert not cache.cached("d/0"), "once read, the piece is evicted in least-recently-used order"


def test_a_piece_larger_than_the_whole_budget_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(CacheFullError, match="more than the shard cache's whole budget"):
        ShardCache(tmp_path, 999).get("d/0", 1000, _piece(0)[1], lambda: _piece(0)[0])


def test_a_corrupt_download_is_fetched_again_and_never_served(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000)
    body, sha = _piece(3)
    answers = iter([body[:-1], b"x" * 1000, body])
    path = cache.get("d/3", 1000, sha, lambda: next(answers))
    assert path.read_bytes() == body and cache.stats.refetched_corrupt == 2


def test_a_piece_that_never_verifies_is_refused_and_nothing_is_left_in_the_cache(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000)
    with pytest.raises(ShardIntegrityError, match="shard piece d/4: its SHA-256 does not match the index, in 3 downloads"):
        cache.get("d/4", 1000, _piece(4)[1], lambda: b"y" * 1000)
    assert not cache.cached("d/4") and cache.usage() == 0
    assert not any(tmp_path.rglob("*.*[0-9]")), "a partial file or reservation was left behind"


def _fetch_in_child(root: str, log: str, peers: int) -> None:
    """Get piece d/5; the process that downloads it first waits until ``peers`` processes are blocked on the
    piece's lock (the kernel's own list of lock waiters), so every one of them races it for certain."""
    cache = ShardCache(root, 10_000)
    body, sha = _piece(5)

    def fetch() -> bytes:
        with open(log, "a") as handle:
            handle.write(f"fetched {os.getpid()}\n")
        lock = os.stat(Path(root) / ".locks" / _flat("d/5"))
        inode = f"{os.major(lock.st_dev):02x}:{os.minor(lock.st_dev):02x}:{lock.st_ino}"
        deadline = time.monotonic() + 30
        while _lock_waiters(inode) < peers:
            assert time.monotonic() < deadline, "the other processes never waited on the piece's lock"
            time.sleep(0.01)
        return body

    assert cache.get("d/5", 1000, sha, fetch).read_bytes() == body
    with open(log, "a") as handle:
        handle.write(f"waited {cache.stats.waited_for_peer}\n")


def _lock_waiters(inode: str) -> int:
    """How many processes are blocked acquiring a lock of the file ``MAJOR:MINOR:INODE`` (/proc/locks)."""
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line.split() and inode in line.split())


def test_processes_of_one_node_download_a_piece_once(tmp_path: Path) -> None:
    """While one process downloads, the 5 others wait on the piece's lock, then find it in place."""
    log = tmp_path / "fetches.log"
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_fetch_in_child, args=(str(tmp_path / "cache"), str(log), 5)) for _ in range(6)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    lines = log.read_text().splitlines()
    assert len([line for line in lines if line.startswith("fetched")]) == 1
    assert sorted(line for line in lines if line.startswith("waited")) == ["waited 0"] + ["waited 1"] * 5


def _churn(root: str, budget: int, seed: int, rounds: int) -> None:
    cache = ShardCache(root, budget)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        n = int(rng.integers(0, 40))
        body, sha = _piece(n, 700 + 37 * n)
        path = cache.get(f"d/{n}", len(body), sha, lambda body=body: body)
        try:
            assert path.read_bytes() == body
        except FileNotFoundError:
            pass  # evicted by another process after get: a reader then fetches it again


def test_the_budget_holds_while_processes_fetch_and_evict_at_once(tmp_path: Path) -> None:
    budget = 6000
    root = tmp_path / "cache"
    ShardCache(root, budget)
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_churn, args=(str(root), budget, seed, 150)) for seed in range(4)]
    for child in children:
        child.start()
    peak = 0
    while any(child.is_alive() for child in children):
        # a snapshot under the directory's lock (evictions and reservations take it; a rename into place is
        # covered by its reservation until after it): every byte on disk, pieces and partial downloads
        with _flock(root / ".cache.lock"):
            used = _bytes(root / "d") + _bytes(root / ".partial")
        peak = max(peak, used)
        assert used <= budget
    for child in children:
        child.join()
        assert child.exitcode == 0
    assert 0 < peak <= budget and ShardCache(root, budget).usage() <= budget


def _bytes(directory: Path) -> int:
    if not directory.exists():
        return 0
    total = 0
    for entry in os.scandir(directory):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:  # a partial download renamed into place while scanned: counted by neither
            pass
    return total


def test_a_small_budget_evicts_while_a_dataset_is_read_through_it_and_two_datasets_share_it(
        tokens: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    root, arrays = tokens
    other = tmp_path / "other"
    _token_shards(other, (6000,), dtype="uint16")
    build_index(str(other), FS, kind="tokens", dtype="uint16", piece_bytes=PIECE)
    budget = 5 * PIECE
    first = TokenWindows(_reader(root, tmp_path / "cache", budget), 64)
    second = TokenWindows(_reader(other, tmp_path / "cache", budget), 64)
    expected = [a[w * 64 : w * 64 + 64].astype(np.int64).tolist() for a in arrays for w in range((len(a) - 1) // 64)]
    for i in range(len(first)):
        assert first[i][0].tolist() == expected[i]
        second[i % len(second)]
        assert first.reader.cache.usage() <= budget
    assert first.reader.cache.stats.evicted + second.reader.cache.stats.evicted > 0
    on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*/*"))
    assert on_disk <= budget


@pytest.mark.parametrize("key", [".locks/x", "a/b/c", "a/.x", "a/"])
def test_a_cache_key_outside_the_layout_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(DataError, match="is not NAME or FOLDER/NAME"):
        ShardCache(tmp_path, 10_000).get(key, 1, _piece(0, 1)[1], lambda: b"\0")


# -- prefetch ------------------------------------------------------------------------------------------------


def test_prefetch_fetches_exactly_this_ranks_next_pieces_and_follows_the_cursor(tokens: tuple[Path, list[np.ndarray]]) -> None:
    root, _ = tokens
    data = TokenWindows(_reader(root, root.parent / "cache"), 16)
    sampler = ElasticSampler(len(data), global_batch_size=8, seed=3, rank=1, world_size=2)
    with data.prefetch(sampler, steps=2, inflight=2) as prefetcher:
        first = prefetcher.plan(sampler.position)
        mine = [s for step in range(2) for s in _local_ids(sampler, step)]
        assert first == data.reader.pieces([r for s in mine for r in data.byte_ranges(s)])
        _wait(lambda: all(data.reader.cache.cached(data.reader.piece_key(*p)) for p in first))
        plan = sampler.plan()
        sampler.commit(plan)
        sampler.commit(sampler.plan())
        later = prefetcher.plan(sampler.position)
        _wait(lambda: all(data.reader.cache.cached(data.reader.piece_key(*p)) for p in later))
    assert data.reader.cache.stats.fetched == len(set(first) | set(later)) and prefetcher.error is None


def test_prefetch_looks_at_a_piece_once_while_it_stays_in_the_window(tokens: tuple[Path, list[np.ndarray]]) -> None:
    """A piece fetched ahead that a worker read and the cache evicted before the position moved is not fetched
    again by the prefetcher (the worker already has its bytes); pieces new to the window are."""
    root, _ = tokens
    data = TokenWindows(_reader(root, root.parent / "cache"), 16)
    sampler = ElasticSampler(len(data), global_batch_size=8, seed=5, rank=0, world_size=1)
    with data.prefetch(sampler, steps=3, inflight=2) as prefetcher:
        first = prefetcher.plan(sampler.position)
        _wait(lambda: prefetcher.settled_at == sampler.position)
        sampler.commit(sampler.plan())
        after = prefetcher.plan(sampler.position)
        _wait(lambda: prefetcher.settled_at == sampler.position)
        kept = [p for p in first if p in after]
        assert kept, "the windows overlap"
        data.reader.cache.path(data.reader.piece_key(*kept[-1])).unlink()  # read, then evicted
        sampler.commit(sampler.plan())
        later = prefetcher.plan(sampler.position)
        _wait(lambda: prefetcher.settled_at == sampler.position)
    assert kept[-1] in later and not data.reader.cache.cached(data.reader.piece_key(*kept[-1]))
    assert data.reader.cache.stats.fetched == len(set(first) | set(after) | set(later)), "a piece was fetched twice"


def test_after_its_first_window_prefetch_starts_past_the_steps_the_loader_was_handed(tmp_path: Path) -> None:
    """The loader's workers read the steps they were handed themselves: the prefetcher's later windows start after
    them, not at the committed position (those pieces were read, and a tight cache may have evicted them)."""
    root = tmp_path / "many"
    _token_shards(root, tuple([2049] * 12))  # 12 shards of 2 pieces: most steps touch pieces the others do not
    build_index(str(root), FS, kind="tokens", dtype="uint16", piece_bytes=PIECE)
    data = TokenWindows(_reader(root, tmp_path / "cache"), 16)
    sampler = ElasticSampler(len(data), global_batch_size=4, seed=9, rank=0, world_size=1)
    batches = iter(sampler)  # what the DataLoader iterates
    for _ in range(4):
        next(batches)  # the loader takes steps 0 to 3 (one micro-batch each) before the prefetcher first looks
    handed = sampler.dispatched  # the step being handed now (3): steps 1 and 2 are the workers' alone
    assert handed is not None and handed != sampler.position
    with data.prefetch(sampler, steps=1, inflight=2) as prefetcher:
        first = prefetcher.plan(sampler.position)  # the cold start: the committed position's step
        _wait(lambda: prefetcher.settled_at == handed)
        window = prefetcher.plan(handed)
    skipped = {p for step in (1, 2) for p in _step_pieces(data, sampler, step)} - set(first) - set(window)
    assert skipped, "steps 1 and 2 touch pieces of their own"
    assert not any(data.reader.cache.cached(data.reader.piece_key(*p)) for p in skipped)
    assert data.reader.cache.stats.fetched == len(set(first) | set(window))


def _step_pieces(data: TokenWindows, sampler: ElasticSampler, step: int) -> list[tuple[int, int]]:
    position = sampler.plan(DataPosition()).next_position if step else DataPosition()
    for _ in range(step - 1):
        position = sampler.plan(position).next_position
    plan = sampler.plan(position)
    return data.reader.pieces([r for i in sampler.global_ids(plan).tolist() for r in data.byte_ranges(i)])


def _local_ids(sampler: ElasticSampler, steps_ahead: int) -> list[int]:
    position = sampler.position
    for _ in range(steps_ahead):
        position = sampler.plan(position).next_position
    plan = sampler.plan(position)
    start, stop = sampler.local_share(plan)
    return sampler.global_ids(plan)[start:stop].tolist()


def _wait(condition, timeout: float = 30.0) -> None:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not condition():
            if done.wait(0.01):
                pytest.fail("condition not met in time")
    finally:
        deadline.cancel()


# -- the command ---------------------------------------------------------------------------------------------


def test_shards_index_and_verify_name_the_shard_and_piece_that_changed(tmp_path: Path, capsys) -> None:
    from elastic_ddp.cli import main

    root = tmp_path / "s"
    _token_shards(root, (9000, 3000))
    assert main(["shards", "index", str(root), "--piece-bytes", str(PIECE)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["shards", "verify", str(root)]) == 0
    with open(root / "train-00000.bin", "r+b") as handle:
        handle.seek(PIECE * 3 + 5)
        handle.write(b"\xff")
    assert main(["shards", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  train-00000.bin: pieces 3 do not match" in out and "1 of 2 shards match" in out
    assert main(["shards", "verify", str(tmp_path / "nothing")]) == 1
    assert "no index.json; build it once with: elastic-ddp shards index" in capsys.readouterr().err
