"""The Storage protocol on local disk, on a real S3 endpoint (moto, through s3fs) and on fsspec's memory://.

Every behaviour the commit protocol relies on is checked on each backend with the same test:
atomic writes with checksums, create-only (one of two racing writers wins), listing of
"directories" (S3 has none), removal, and errors that name the URI but no credential.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest
from botocore.exceptions import ClientError

from elastic_ddp.checkpoint import storage as storage_module
from elastic_ddp.checkpoint.files import BACKGROUND_NICE, PIECE_BYTES, READ_CHUNK_BYTES, Checksum, FileRecord
from elastic_ddp.checkpoint.remote import _lost_create_race, _parts
from elastic_ddp.checkpoint.storage import (
    CheckpointStorageError,
    LocalStorage,
    Storage,
    WriteBehind,
    lower_thread_priority,
    open_storage,
)
from elastic_ddp.errors import CheckpointConflictError, CheckpointError
from tests.fixtures.s3 import S3Endpoint

OpenStorage = Callable[[], Storage]
MiB = 2**20


class Boom(RuntimeError):
    """Raised by a chunk source to fail a write midway."""


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration), "memory"])
def open_view(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStorage]:
    """Opens a new storage on one root per call: each is what another process would see."""
    if request.param == "local":
        root = str(tmp_path / "ckpt")
        yield lambda: open_storage(root)
    elif request.param == "s3":
        s3: S3Endpoint = request.getfixturevalue("s3_server")
        yield lambda: open_storage(s3.uri, {})
    else:
        root = "memory://storage-test-%s" % uuid.uuid4().hex[:8]
        yield lambda: open_storage(root)
        memory = fsspec.filesystem("memory")
        if memory.exists(root):
            memory.rm(root, recursive=True)


def sha256(data: bytes) -> str:
    """The files' digest (sha256-tree-4m), computed here independently of elastic_ddp.checkpoint.files."""
    pieces = b"".join(hashlib.sha256(data[at : at + PIECE_BYTES]).digest() for at in range(0, len(data), PIECE_BYTES))
    return hashlib.sha256(b"elastic_ddp sha256-tree-4m\x00" + len(data).to_bytes(8, "little") + pieces).hexdigest()


def test_write_streams_chunks_and_returns_size_and_sha256(open_view: OpenStorage) -> None:
    storage = open_view()
    chunks = [b"header", memoryview(bytearray(range(256)) * 40), b"", b"tail"]
    whole = b"".join(bytes(chunk) for chunk in chunks)
    path = storage.join("step-00000001", "replicated-abc.eddp")
    record = storage.write(path, iter(chunks))
    assert record == FileRecord(size=len(whole), digest=sha256(whole))
    assert open_view().read(path) == whole


@pytest.mark.parametrize("size", [0, 5, 3 * READ_CHUNK_BYTES + 7])
def test_read_hashed_returns_the_bytes_with_their_size_and_sha256(open_view: OpenStorage, size: int) -> None:
    storage = open_view()
    whole = os.urandom(size)
    path = storage.join("step-00000001", "rank-00000-abc.eddp")
    storage.write(path, [whole])
    data, record = open_view().read_hashed(path)
    assert bytes(data) == whole
    assert record == FileRecord(size=size, digest=sha256(whole))


def test_write_behind_hands_each_complete_window_to_the_disk_and_waits_for_the_one_behind_windows_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(storage_module, "_sync_file_range", lambda fd, offset, count, flags: calls.append((offset, count, flags)))
    window, back = WriteBehind.WINDOW_BYTES, WriteBehind.BEHIND
    behind = WriteBehind(fd=7)
    behind.wrote(window - 1)
    assert calls == []
    behind.wrote(1 + (back + 1) * window + 5)  # back + 2 windows complete; the next is not
    start, wait = WriteBehind._START, WriteBehind._WAIT
    assert calls == [(n * window, window, start) for n in range(back + 1)] + [
        (0, window, wait), ((back + 1) * window, window, start), (window, window, wait)]


def test_join_onto_a_joined_path_extends_it(open_view: OpenStorage) -> None:
    """The manager joins file names onto step directories it got from join."""
    storage = open_view()
    directory = storage.join("step-00000001")
    assert storage.join(directory, "manifest.json") == storage.join("step-00000001", "manifest.json")
    assert storage.join(directory, "manifest.json").startswith(storage.root + "/")


def test_a_write_that_fails_midway_leaves_no_file(open_view: OpenStorage) -> None:
    storage = open_view()
    path = storage.join("step-00000001", "rank-00000-abc.eddp")

    def failing() -> Iterator[bytes]:
        yield b"x" * 1000
        raise Boom("serialisation failed")

    with pytest.raises(Boom):
        storage.write(path, failing())
    assert not open_view().exists(path)


def test_readers_see_no_part_of_a_file_until_its_write_completes(open_view: OpenStorage) -> None:
    storage, reader = open_view(), open_view()
    path = storage.join("step-00000002", "replicated-abc.eddp")
    seen_during_write: list[bool] = []

    def watched() -> Iterator[bytes]:
        yield b"a" * 4096
        seen_during_write.append(reader.exists(path) or "replicated-abc.eddp" in reader.list_dir(storage.join("step-00000002")))
        yield b"b" * 4096

    storage.write(path, watched())
    assert seen_during_write == [False]
    assert reader.read(path) == b"a" * 4096 + b"b" * 4096


def test_create_is_create_only(open_view: OpenStorage) -> None:
    storage = open_view()
    path = storage.join("step-00000003", "manifest.json")
    storage.create(path, b'{"token": "first"}')
    with pytest.raises(CheckpointConflictError, match="already exists"):
        open_view().create(path, b'{"token": "second"}')
    assert storage.read(path) == b'{"token": "first"}'


def test_creating_the_same_bytes_again_is_not_a_conflict(open_view: OpenStorage) -> None:
    """A retried request whose first response was lost finds its own bytes: that is success."""
    storage = open_view()
    path = storage.join("step-00000003", "manifest.json")
    storage.create(path, b"same")
    storage.create(path, b"same")
    assert storage.read(path) == b"same"


@pytest.mark.parametrize("round_", range(3))
def test_of_two_racing_creators_exactly_one_wins(open_view: OpenStorage, round_: int) -> None:
    writers = [open_view(), open_view()]
    path = writers[0].join("step-%08d" % (10 + round_), "manifest.json")
    barrier = threading.Barrier(2)
    outcomes: dict[int, BaseException | None] = {}

    def commit(index: int) -> None:
        barrier.wait(timeout=10)
        try:
            writers[index].create(path, b"writer-%d" % index)
            outcomes[index] = None
        except BaseException as exc:  # recorded and asserted on below
            outcomes[index] = exc

    threads = [threading.Thread(target=commit, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [index for index, error in outcomes.items() if error is None]
    losers = [error for error in outcomes.values() if error is not None]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], CheckpointConflictError)
    assert open_view().read(path) == b"writer-%d" % winners[0]


def test_replace_overwrites(open_view: OpenStorage) -> None:
    storage = open_view()
    path = storage.join("latest")
    storage.replace(path, b"step-00000001")
    storage.replace(path, b"step-00000002")
    assert open_view().read(path) == b"step-00000002"


def test_list_dir_names_what_is_directly_under_a_directory(open_view: OpenStorage) -> None:
    storage = open_view()
    for name in ("step-00000001/a.eddp", "step-00000001/manifest.json", "step-00000010/b.eddp", "latest"):
        storage.replace(storage.join(*name.split("/")), b"x")
    assert storage.list_dir(storage.root) == ["latest", "step-00000001", "step-00000010"]
    assert storage.list_dir(storage.join("step-00000001")) == ["a.eddp", "manifest.json"]
    assert storage.list_dir(storage.join("step-00000002")) == []
    assert storage.list_dir(storage.join("latest")) == []
    assert storage.exists(storage.join("step-00000001")) and storage.exists(storage.join("latest"))
    assert not storage.exists(storage.join("step-00000002"))


def test_a_reader_sees_objects_written_after_it_listed(open_view: OpenStorage) -> None:
    reader, writer = open_view(), open_view()
    writer.replace(writer.join("step-00000001", "manifest.json"), b"1")
    assert reader.list_dir(reader.root) == ["step-00000001"]
    assert not reader.exists(reader.join("step-00000002", "manifest.json"))
    writer.replace(writer.join("step-00000002", "manifest.json"), b"2")
    assert reader.list_dir(reader.root) == ["step-00000001", "step-00000002"]
    assert reader.exists(reader.join("step-00000002", "manifest.json"))


def test_remove_tree_removes_that_directory_only(open_view: OpenStorage) -> None:
    storage = open_view()
    for name in ("step-00000001/a", "step-00000001/b", "step-00000010/c"):
        storage.replace(storage.join(*name.split("/")), b"x")
    storage.remove_tree(storage.join("step-00000001"))
    assert storage.list_dir(storage.root) == ["step-00000010"]
    assert storage.read(storage.join("step-00000010", "c")) == b"x"


def test_remove_deletes_one_file(open_view: OpenStorage) -> None:
    storage = open_view()
    keep, gone = storage.join("step-00000001", "keep"), storage.join("step-00000001", "manifest.json")
    storage.replace(keep, b"k")
    storage.replace(gone, b"m")
    storage.remove(gone)
    assert storage.list_dir(storage.join("step-00000001")) == ["keep"]


def test_mtime_of_a_directory_is_that_of_its_newest_file(open_view: OpenStorage) -> None:
    storage = open_view()
    before = time.time()
    storage.replace(storage.join("step-00000001", "a"), b"x")
    file_time = storage.mtime(storage.join("step-00000001", "a"))
    dir_time = storage.mtime(storage.join("step-00000001"))
    assert before - 2 <= file_time <= time.time() + 2  # S3 LastModified has whole seconds
    assert dir_time >= file_time - 1


@pytest.mark.parametrize("read", ["read", "read_hashed", "mtime"])
def test_reading_a_missing_file_raises_checkpoint_error_naming_it(open_view: OpenStorage, read: str) -> None:
    storage = open_view()
    path = storage.join("step-00000001", "manifest.json")
    with pytest.raises(CheckpointError, match="does not exist") as caught:
        getattr(storage, read)(path)
    assert path in str(caught.value)


def test_a_local_write_that_fails_is_a_storage_error_naming_the_path(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_bytes(b"")
    storage = open_storage(str(blocked))
    with pytest.raises(CheckpointStorageError, match="cannot write .*not-a-directory"):
        storage.write(storage.join("step-00000001", "a"), [b"x"])


def test_local_paths_never_import_the_remote_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "elastic_ddp.checkpoint.remote", None)  # importing it now fails
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage("file://" + str(tmp_path)), LocalStorage)


def test_storage_options_for_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="remote URIs only"):
        open_storage(str(tmp_path), {"endpoint_url": "http://127.0.0.1:1"})


def test_an_unknown_protocol_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="nosuchfs://bucket/x"):
        open_storage("nosuchfs://bucket/x", {})


def test_a_listing_cache_is_refused() -> None:
    with pytest.raises(CheckpointError, match="use_listings_cache"):
        open_storage("memory://cached", {"use_listings_cache": True})


def test_a_412_without_condition_counts_as_a_lost_create_race() -> None:
    """s3fs raises FileExistsError only when S3 names the If-None-Match condition; else OSError(EINVAL)."""
    def s3_error(status: int, code: str) -> OSError:
        error = OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold")
        error.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        return error

    assert _lost_create_race(FileExistsError("exists"))
    assert _lost_create_race(s3_error(412, "PreconditionFailed"))
    assert _lost_create_race(s3_error(409, "ConditionalRequestConflict"))
    assert not _lost_create_race(s3_error(403, "AccessDenied"))
    assert not _lost_create_race(OSError(errno.EIO, "io"))


# -- S3 only ---------------------------------------------------------------------


@pytest.mark.integration
def test_s3fs_raises_file_exists_error_for_a_conditional_put_on_an_existing_key(s3_server: S3Endpoint) -> None:
    """The contract FsspecStorage.create relies on: HTTP 412 with Condition If-None-Match -> FileExistsError."""
    fs = s3_server.filesystem()
    path = s3_server.child_uri("manifest.json")
    fs.pipe_file(path, b"1", mode="create")
    with pytest.raises(FileExistsError) as caught:
        fs.pipe_file(path, b"2", mode="create")
    assert caught.value.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 412


@pytest.mark.integration
def test_s3_multipart_write_is_whole_or_nothing(s3_server: S3Endpoint) -> None:
    """A file larger than a block goes up in parts; a failure after the first part aborts the upload."""
    options = {"default_block_size": 5 * MiB}
    storage, reader = open_storage(s3_server.uri, options), open_storage(s3_server.uri, {})
    big = storage.join("step-00000001", "replicated-abc.eddp")
    parts_seen: list[bool] = []

    def chunks(fail: bool) -> Iterator[bytes]:
        yield b"a" * (5 * MiB + 1024)  # fills a block: the first part is uploaded now
        parts_seen.append(reader.exists(big))
        if fail:
            raise Boom("writer died mid-file")
        yield b"b" * MiB

    with pytest.raises(Boom):
        storage.write(big, chunks(fail=True))
    assert not reader.exists(big)
    fs = s3_server.filesystem()
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3_server.bucket).get("Uploads")
    record = storage.write(big, chunks(fail=False))
    assert parts_seen == [False, False]
    data = reader.read(big)
    assert record == FileRecord(size=len(data), digest=sha256(data)) and len(data) == 6 * MiB + 1024


@pytest.mark.integration
def test_s3_upload_failing_with_parts_in_flight_is_aborted_and_a_whole_one_reads_back(s3_server: S3Endpoint) -> None:
    storage, reader = open_storage(s3_server.uri, {"default_block_size": 5 * MiB}), open_storage(s3_server.uri, {})
    path = storage.join("step-00000001", "rank-00001-abc.eddp")
    pieces = [os.urandom(3 * MiB) for _ in range(7)]  # 21 MiB: parts of 5 MiB go up while later ones are cut

    def chunks(fail_after: int | None) -> Iterator[bytes]:
        for index, piece in enumerate(pieces):
            if index == fail_after:
                raise Boom("writer died with parts in flight")
            yield piece

    with pytest.raises(Boom):
        storage.write(path, chunks(fail_after=5))
    assert not reader.exists(path)
    assert not s3_server.filesystem().call_s3("list_multipart_uploads", Bucket=s3_server.bucket).get("Uploads")
    record = storage.write(path, chunks(fail_after=None))
    whole = b"".join(pieces)
    assert record == FileRecord(size=len(whole), digest=sha256(whole))
    assert reader.read(path) == whole


@pytest.mark.parametrize(
    ("sizes", "part", "expected"),
    [([], 4, [0]), ([3], 4, [3]), ([4], 4, [4]), ([4, 4], 4, [4, 4]), ([1, 9, 2], 4, [4, 4, 4]), ([10], 4, [4, 4, 2])],
)
def test_upload_parts_regroup_chunks_into_equal_parts_with_a_shorter_last(
    sizes: list[int], part: int, expected: list[int]
) -> None:
    chunks = [bytes([index]) * size for index, size in enumerate(sizes)]
    parts = list(_parts(iter(chunks), part))
    assert [len(p) for p in parts] == expected
    assert b"".join(parts) == b"".join(chunks)


@pytest.mark.integration
def test_s3_endpoint_down_is_a_storage_error_naming_the_uri_not_the_credentials(
    s3_server: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    key, secret = "AKIAUNITTESTKEY00001", "unit-test-secret-value-0001"
    options = {
        "endpoint_url": s3_server.endpoint, "key": key, "secret": secret,
        "config_kwargs": {"retries": {"max_attempts": 0}, "connect_timeout": 2},
    }
    storage = open_storage(s3_server.uri, options)
    path = storage.join("step-00000001", "manifest.json")
    s3_server.stop()
    caplog.set_level(logging.DEBUG)
    operations: dict[str, Callable[[], object]] = {
        "write": lambda: storage.write(path, [b"x"]),
        "create": lambda: storage.create(path, b"x"),
        "read": lambda: storage.read(path),
        "list": lambda: storage.list_dir(storage.root),
        "look up": lambda: storage.exists(path),
    }
    for action, operation in operations.items():
        with pytest.raises(CheckpointStorageError) as caught:
            operation()
        message = str(caught.value)
        assert message.startswith("cannot %s s3://" % action) and s3_server.uri in message, message
        assert key not in message and secret not in message
    ours = "\n".join(record.getMessage() for record in caplog.records if record.name.startswith("elastic_ddp"))
    assert key not in ours and secret not in ours
    assert secret not in caplog.text  # botocore's own DEBUG log names the key id, never the secret


@pytest.mark.integration
def test_s3_write_to_a_missing_bucket_is_a_storage_error_naming_the_uri(s3_server: S3Endpoint) -> None:
    storage = open_storage("s3://no-such-bucket-%s/run" % uuid.uuid4().hex[:8], {})
    path = storage.join("step-00000001", "manifest.json")
    assert storage.list_dir(storage.root) == []
    for write in (lambda: storage.write(path, [b"x"]), lambda: storage.create(path, b"x")):
        with pytest.raises(CheckpointStorageError, match="bucket does not exist") as caught:
            write()
        assert path in str(caught.value)


@pytest.mark.integration
def test_s3_hung_endpoint_is_a_storage_error_within_the_configured_timeouts(s3_server: S3Endpoint) -> None:
    options = {"config_kwargs": {"retries": {"max_attempts": 0}, "connect_timeout": 0.5, "read_timeout": 0.5}}
    storage = open_storage(s3_server.uri, options)
    storage.replace(storage.join("latest"), b"step-00000001")
    s3_server.pause()
    started = time.monotonic()
    with pytest.raises(CheckpointStorageError, match="cannot read"):
        storage.read(storage.join("latest"))
    assert time.monotonic() - started < 30
    s3_server.resume()
    assert storage.read(storage.join("latest")) == b"step-00000001"


@pytest.mark.integration
def test_s3_writes_to_a_hung_endpoint_fail_within_the_configured_timeouts(s3_server: S3Endpoint) -> None:
    """Bodies go out with the request: waiting for ``100 Continue`` (botocore asks for it on
    ``bytes`` bodies) outlived every timeout against a paused endpoint."""
    options = {"config_kwargs": {"retries": {"max_attempts": 0}, "connect_timeout": 0.5, "read_timeout": 0.5}}
    storage = open_storage(s3_server.uri, options)
    writes = {
        "write": lambda: storage.write(storage.join("step-00000001", "rank-0.eddp"), [b"x" * 4096]),
        "create": lambda: storage.create(storage.join("step-00000001", "manifest.json"), b"{}"),
    }
    s3_server.pause()
    try:
        for action, write in writes.items():
            errors: list[BaseException] = []
            attempt = threading.Thread(target=lambda: _record_error(write, errors), daemon=True)
            attempt.start()
            attempt.join(timeout=30)  # a hung request never returns: fail the test instead of hanging it
            assert not attempt.is_alive(), f"{action} to a paused endpoint hung"
            assert len(errors) == 1 and isinstance(errors[0], CheckpointStorageError), errors
            assert f"cannot {action}" in str(errors[0])
    finally:
        s3_server.resume()
    writes["write"]()  # the same storage works again once the endpoint answers


def _record_error(call: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.integration
def test_s3_credentials_come_from_options_when_given(s3_server: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AWS_ENDPOINT_URL and the AWS_* keys, the options alone reach the endpoint."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    storage = open_storage(s3_server.uri, s3_server.options)
    storage.replace(storage.join("latest"), b"x")
    assert storage.read(storage.join("latest")) == b"x"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is Linux-only")
def test_the_hashing_thread_runs_at_the_priority_of_the_thread_it_hashes_for(monkeypatch) -> None:
    """A restore hashes at the loop's priority; an async save's writer thread, already lowered, hashes lowered."""
    seen: list[int] = []
    real = hashlib.sha256

    class Spy:
        def __init__(self, data: bytes = b"") -> None:
            self._inner = real(data)

        def update(self, data: object) -> None:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            self._inner.update(data)

        def hexdigest(self) -> str:
            return self._inner.hexdigest()

        def digest(self) -> bytes:
            return self._inner.digest()

    monkeypatch.setattr(hashlib, "sha256", Spy)
    chunk = bytes(PIECE_BYTES)  # whole pieces: they go to the helper threads

    def hash_two_chunks() -> None:
        with Checksum() as checksum:
            checksum.update(chunk)
            checksum.update(chunk)
            checksum.record()

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    hash_two_chunks()
    assert seen and set(seen) == {own}
    seen.clear()

    def lowered() -> None:
        lower_thread_priority()
        hash_two_chunks()

    worker = threading.Thread(target=lowered)
    worker.start()
    worker.join()
    assert seen and set(seen) == {max(own, BACKGROUND_NICE)}
