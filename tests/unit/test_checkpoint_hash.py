"""The digest of a checkpoint's files: the tree hash ``sha256-tree-4m`` that new checkpoints name, the SHA-256 of
the whole file that older ones name (still verified), and manifests naming anything else (refused)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from elastic_ddp.checkpoint import files as files_module
from elastic_ddp.checkpoint.files import (
    HASH_NAME,
    LEGACY_HASH_NAME,
    PIECE_BYTES,
    STORED_HASHES,
    TREE_HASH_NAME,
    Checksum,
    FileRecord,
    file_record,
    lower_thread_priority,
)
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME, Manifest
from elastic_ddp.checkpoint.storage import open_storage
from elastic_ddp.errors import CheckpointCorruptError
from elastic_ddp.state import model_digest
from tests.unit.test_checkpoint_local import advance, make_state, manager

P = PIECE_BYTES
SIZES = [0, 1, P - 1, P, P + 1, 3 * P + 5]
ODD_CHUNKS = [1, 7, 4093, P - 3, 1, P + 11, 2 * P + 1, 65_537]
"""Chunk sizes fed in turn: smaller and larger than a piece, never on a piece boundary for long."""
BIG_HIDDEN = 200_000
"""make_state(hidden=BIG_HIDDEN) saves a replicated file of about 17 MB: four whole pieces and a short one."""


def reference_tree_digest(data: bytes) -> str:
    """sha256-tree-4m computed here from its definition alone, for comparison."""
    pieces = b"".join(hashlib.sha256(data[at : at + 4 * 2**20]).digest() for at in range(0, len(data), 4 * 2**20))
    return hashlib.sha256(b"elastic_ddp sha256-tree-4m\x00" + len(data).to_bytes(8, "little") + pieces).hexdigest()


def fed_in_odd_chunks(data: bytes, hash_name: str = HASH_NAME) -> FileRecord:
    view = memoryview(data)
    with Checksum(hash_name) as checksum:
        at, turn = 0, 0
        while at < len(data):
            size = ODD_CHUNKS[turn % len(ODD_CHUNKS)]
            checksum.update(view[at : at + size])
            at, turn = at + size, turn + 1
        return checksum.record()


def hash_threads_alive() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("elastic-ddp-sha256")]


def test_new_checkpoints_name_the_tree_hash_and_its_piece_is_4_mib() -> None:
    assert HASH_NAME == TREE_HASH_NAME == "sha256-tree-4m"
    assert PIECE_BYTES == 4 * 2**20  # the name says 4m: another piece size needs another name
    assert set(STORED_HASHES) == {"sha256-tree-4m", "sha256"}


@pytest.mark.parametrize("size", SIZES, ids=["0", "1", "piece-1", "piece", "piece+1", "3pieces+5"])
def test_the_tree_digest_matches_its_definition_however_the_chunks_fall(size: int) -> None:
    data = os.urandom(size)
    expected = FileRecord(size=size, digest=reference_tree_digest(data))
    assert fed_in_odd_chunks(data) == expected
    assert file_record(data) == expected  # one chunk holding it all
    with Checksum() as checksum:  # chunks of exactly one piece
        for at in range(0, size, P):
            checksum.update(data[at : at + P])
        assert checksum.record() == expected


@pytest.mark.parametrize("size", SIZES, ids=["0", "1", "piece-1", "piece", "piece+1", "3pieces+5"])
def test_the_legacy_digest_is_sha256_of_the_whole_file(size: int) -> None:
    data = os.urandom(size)
    assert fed_in_odd_chunks(data, LEGACY_HASH_NAME) == FileRecord(size=size, digest=hashlib.sha256(data).hexdigest())


def test_chunks_that_are_not_bytes_count_and_cut_in_bytes() -> None:
    values = np.arange(3 * P // 8 + 11, dtype=np.float64)  # 8-byte items, pieces that end mid-item
    grid = np.arange(P // 2, dtype=np.int32).reshape(-1, 64)  # two dimensions
    expected = reference_tree_digest(values.tobytes() + grid.tobytes())
    with Checksum() as checksum:
        checksum.update(memoryview(values))
        checksum.update(memoryview(np.zeros((0, 3))))  # nothing, in a shape with a 0
        checksum.update(memoryview(grid))
        assert checksum.record() == FileRecord(size=values.nbytes + grid.nbytes, digest=expected)


def test_a_flipped_dropped_added_or_moved_byte_changes_the_digest() -> None:
    data = bytearray(os.urandom(3 * P + 5))
    original = file_record(data).digest
    flipped = bytearray(data)
    flipped[P + 12345] ^= 0x01
    moved = data[P : 2 * P] + data[:P] + data[2 * P :]  # two whole pieces swapped: each piece's digest unchanged
    for other in (flipped, data[:-1], data[:3 * P], data + b"\0", b"\0" + data[:-1], moved):
        assert file_record(other).digest != original


def test_pieces_hash_on_helper_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pieces are hashed at the same time (each waits for the other), neither on the feeding thread."""
    monkeypatch.setattr(files_module, "hash_threads", lambda: 2)
    both = threading.Barrier(2, timeout=30)
    real, hashed_on = files_module._sha256_of, []

    def meeting(views: list[memoryview]) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            hashed_on.append(threading.current_thread().name)
            both.wait()
        return real(views)

    monkeypatch.setattr(files_module, "_sha256_of", meeting)
    data = os.urandom(2 * P + 3)
    with Checksum() as checksum:
        checksum.update(data)
        deadline = time.monotonic() + 30
        while len(hashed_on) < 2 and time.monotonic() < deadline:  # before record(), which would hash what is left
            time.sleep(0.01)
        assert checksum.record().digest == reference_tree_digest(data)
    assert len(hashed_on) == 2 and all(name.startswith("elastic-ddp-sha256-tree-4m") for name in hashed_on)
    assert hash_threads_alive() == []


def test_a_failure_on_a_helper_thread_is_raised_by_record_never_a_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = files_module._sha256_of, []

    def failing_second(views: list[memoryview]) -> bytes:
        calls.append(None)
        if len(calls) == 2:
            raise MemoryError("no memory for this piece")
        return real(views)

    monkeypatch.setattr(files_module, "_sha256_of", failing_second)
    with pytest.raises(MemoryError, match="no memory for this piece"):
        fed_in_odd_chunks(os.urandom(3 * P))
    assert hash_threads_alive() == []


def test_without_helper_threads_the_feeding_thread_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_threads(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    data = os.urandom(2 * P + 1)
    assert fed_in_odd_chunks(data).digest == reference_tree_digest(data)
    assert fed_in_odd_chunks(data, LEGACY_HASH_NAME).digest == hashlib.sha256(data).hexdigest()


def test_helpers_leave_the_feeding_threads_core_free_and_it_hashes_what_is_left_when_the_stream_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files_module.os, "sched_getaffinity", lambda pid: {0, 1})
    assert files_module.hash_threads() == 1
    monkeypatch.setattr(files_module.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert files_module.hash_threads() == files_module.MAX_HASH_THREADS
    monkeypatch.setattr(files_module.os, "sched_getaffinity", lambda pid: {0})
    assert files_module.hash_threads() == 1
    helper_busy, real, hashed_on = threading.Event(), files_module._sha256_of, []

    def slow_helper(views: list[memoryview]) -> bytes:
        hashed_on.append(threading.current_thread() is threading.main_thread())
        if not hashed_on[-1] and not helper_busy.is_set():
            helper_busy.set()
            time.sleep(0.5)  # holds the one helper while record() runs
        return real(views)

    monkeypatch.setattr(files_module, "_sha256_of", slow_helper)
    data = os.urandom(6 * P)
    with Checksum() as checksum:
        checksum.update(data)
        assert helper_busy.wait(30)
        assert checksum.record().digest == reference_tree_digest(data)
    assert hashed_on.count(True) >= 4  # the five pieces queued behind the helper's first went to the feeding thread


def test_leaving_without_a_record_ends_the_helper_threads() -> None:
    data = os.urandom(4 * P)
    with pytest.raises(OSError, match="disk full"):
        with Checksum() as checksum:
            checksum.update(data)
            raise OSError("disk full")  # what a failed write raises between update() and record()
    assert hash_threads_alive() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is Linux-only")
def test_the_helpers_hash_at_the_priority_of_the_thread_that_feeds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous save or a restore hashes at the loop's priority; an asynchronous save's writer, lowered, lowered."""
    real, seen = files_module._sha256_of, []

    def spy(views: list[memoryview]) -> bytes:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(views)

    monkeypatch.setattr(files_module, "_sha256_of", spy)
    data = os.urandom(3 * P)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    fed_in_odd_chunks(data)
    assert len(seen) == 3 and set(seen) == {own}
    seen.clear()

    def lowered() -> None:
        lower_thread_priority()
        fed_in_odd_chunks(data)

    writer = threading.Thread(target=lowered)
    writer.start()
    writer.join()
    assert len(seen) == 3 and min(seen) >= max(own, files_module.BACKGROUND_NICE)


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("hash_name", [TREE_HASH_NAME, LEGACY_HASH_NAME])
def test_storages_write_with_the_tree_hash_and_read_back_with_the_manifests(tmp_path: Path, where: str,
                                                                            hash_name: str) -> None:
    root = str(tmp_path) if where == "local" else f"memory://hash-test-{uuid.uuid4().hex[:8]}"
    storage = open_storage(root)
    data = os.urandom(2 * P + 7)
    path = storage.join("step-00000001", "replicated-abc.eddp")
    view = memoryview(data)
    written = storage.write(path, [view[:5], view[5 : P + 9], view[P + 9 :]])
    assert written == FileRecord(size=len(data), digest=reference_tree_digest(data))
    read, found = storage.read_hashed(path, hash_name)
    assert bytes(read) == data
    expected = reference_tree_digest(data) if hash_name == TREE_HASH_NAME else hashlib.sha256(data).hexdigest()
    assert found == FileRecord(size=len(data), digest=expected)
    if where == "memory":
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_a_saved_checkpoint_names_the_tree_hash_and_its_digests_are_the_files(tmp_path: Path) -> None:
    state = make_state(hidden=BIG_HIDDEN)
    advance(state)
    manager(tmp_path).save(state)
    step_dir = tmp_path / "step-00000001"
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert body["hash"] == "sha256-tree-4m"
    for name, record in body["files"].items():
        data = (step_dir / name).read_bytes()
        assert record == {"size": len(data), "sha256-tree-4m": reference_tree_digest(data)}
    assert max(record["size"] for record in body["files"].values()) > 4 * P


def two_checkpoints(root: Path) -> tuple[str, Path]:
    """Steps 2 and 4 of a state whose replicated file spans several pieces; the model digest at step 2 and
    step 4's replicated file."""
    state = make_state(hidden=BIG_HIDDEN)
    saver = manager(root)
    advance(state, 2)
    saver.save(state)
    older = model_digest(state.model.state_dict())
    advance(state, 2)
    saver.save(state)
    saver.wait_for_retention()  # it verifies in the background: not while a test damages the files
    return older, next((root / "step-00000004").glob("replicated-*.eddp"))


def damage(target: Path, how: str) -> None:
    data = bytearray(target.read_bytes())
    if how == "flip":  # one bit, in the third piece
        data[2 * P + 4321] ^= 0x10
    elif how == "truncate":  # its last piece lost
        del data[(len(data) - 1) // P * P :]
    else:  # "swap": two whole pieces trade places; the size and the set of piece digests stay the same
        data[P : 3 * P] = data[2 * P : 3 * P] + data[P : 2 * P]
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_damage_under_the_tree_hash_is_caught_and_restore_falls_back(tmp_path: Path, how: str) -> None:
    older, target = two_checkpoints(tmp_path)
    damage(target, how)
    m = manager(tmp_path)
    info = m.describe(4)
    assert info.manifest is not None and info.manifest.hash == TREE_HASH_NAME
    with pytest.raises(CheckpointCorruptError, match="size" if how == "truncate" else "sha256-tree-4m .* does not match"):
        m.verify(info)
    fresh = make_state(hidden=BIG_HIDDEN, seed=5)
    restored = m.restore(fresh)
    assert restored is not None and restored.step == 2
    assert model_digest(fresh.model.state_dict()) == older


def as_legacy(step_dir: Path) -> None:
    """Rewrite a checkpoint's manifest as elastic_ddp wrote them before the tree hash: SHA-256 of each file."""
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    body["hash"] = "sha256"
    body["files"] = {name: {"size": record["size"], "sha256": hashlib.sha256((step_dir / name).read_bytes()).hexdigest()}
                     for name, record in body["files"].items()}
    (step_dir / MANIFEST_NAME).write_text(json.dumps(body))


def test_a_legacy_sha256_checkpoint_still_verifies_and_its_damage_is_caught(tmp_path: Path) -> None:
    older, target = two_checkpoints(tmp_path)
    as_legacy(tmp_path / "step-00000004")
    m = manager(tmp_path)
    info = m.describe(4)
    assert info.manifest is not None and info.manifest.hash == LEGACY_HASH_NAME
    assert set(m.verify(info)) == set(info.manifest.files)
    newest = make_state(hidden=BIG_HIDDEN, seed=5)
    assert m.restore(newest).step == 4

    damage(target, "flip")
    m = manager(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="sha256 .* does not match"):
        m.verify(m.describe(4))
    fresh = make_state(hidden=BIG_HIDDEN, seed=5)
    restored = m.restore(fresh)
    assert restored is not None and restored.step == 2  # the tree-hashed one before it
    assert model_digest(fresh.model.state_dict()) == older


@pytest.mark.parametrize("hash_name", ["sha256-tree-8m", "md5", "xxh3-128"])
def test_a_stored_manifest_naming_another_hash_is_refused(tmp_path: Path, hash_name: str) -> None:
    older, _ = two_checkpoints(tmp_path)
    step_dir = tmp_path / "step-00000004"
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    digest_of = (lambda record: record["sha256-tree-4m"][:32]) if hash_name == "xxh3-128" else (
        lambda record: record["sha256-tree-4m"])
    body["hash"] = hash_name
    body["files"] = {name: {"size": record["size"], hash_name: digest_of(record)} for name, record in body["files"].items()}
    (step_dir / MANIFEST_NAME).write_text(json.dumps(body))
    m = manager(tmp_path)
    info = m.describe(4)
    assert info.manifest is None and hash_name in str(info.problem)
    if hash_name != "xxh3-128":  # a node-memory replica's hash parses, but a stored checkpoint needs its own
        with pytest.raises(CheckpointCorruptError, match=f"hash '{hash_name}' is not one of"):
            Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes(), "test")
    fresh = make_state(hidden=BIG_HIDDEN, seed=5)
    restored = m.restore(fresh)
    assert restored is not None and restored.step == 2
    assert model_digest(fresh.model.state_dict()) == older


@pytest.mark.parametrize("hash_name", ["sha256-tree-8m", "xxh3-128", "md5"])
def test_a_checksum_or_read_under_another_hash_is_refused(tmp_path: Path, hash_name: str) -> None:
    with pytest.raises(ValueError, match="is not one of sha256-tree-4m, sha256"):
        Checksum(hash_name)
    storage = open_storage(str(tmp_path))
    path = storage.join("step-00000001", "replicated-abc.eddp")
    storage.write(path, [b"bytes"])
    with pytest.raises(ValueError, match="is not one of"):
        storage.read_hashed(path, hash_name)
