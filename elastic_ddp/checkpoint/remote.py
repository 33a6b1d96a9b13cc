"""Checkpoint storage on any fsspec URI other than local disk; S3 (s3fs) first.

:func:`elastic_ddp.checkpoint.storage.open_storage` imports this module, and with it fsspec,
only when a checkpoint root is a remote URI; fsspec imports s3fs on the first ``s3://`` root.

Options: the mapping given to ``open_storage`` (a run's ``--checkpoint-storage-options``
JSON object) goes unchanged to the fsspec filesystem, for s3fs for instance::

    {"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "...",
     "client_kwargs": {...},
     "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                       "retries": {"max_attempts": 3, "mode": "standard"}}}

Without ``key``/``secret``, s3fs (botocore) reads the standard AWS environment:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION`` (then ``~/.aws``). Options are never logged,
and every credential found in them or in that environment is masked in error messages.

One option is fixed because the commit protocol needs it: ``use_listings_cache=False``.
s3fs caches listings per filesystem object, and a reader must see the step directories
other processes committed since; asking for a listing cache is refused rather than ignored.
fsspec's instance cache stays on: storages with the same options share one client (its
connection pool), and fsspec drops its cached instances in a forked child.

Retries and timeouts: this module adds none. botocore retries connection failures,
timeouts and throttling (default: 5 attempts with backoff, about 6 s against an endpoint
that is down; tune with ``config_kwargs`` as above) and s3fs retries a few transport
errors on top (5 tries: ``S3FileSystem.retries``). An endpoint that accepts connections
but never answers therefore holds an operation for up to 5 x attempts x ``read_timeout``
(botocore's default is 60 s): set ``read_timeout`` for the size of your files. A create-only
conflict (HTTP 412) is an answer, not a failure: nothing retries it. When the retries are
spent, the operation raises ``CheckpointStorageError`` naming the URI.

Semantics match :class:`~elastic_ddp.checkpoint.storage.LocalStorage`:

- ``write`` on S3: one PUT for an object of at most one part (``default_block_size``,
  50 MiB), else a multipart upload with up to ``max_concurrency`` (10) parts in flight at once (a sequential
  upload is bound by one connection's throughput), completed in one request. Until then
  readers see nothing; an exception aborts the upload, so a partial object is never
  committed. Other protocols get one ``pipe_file`` of the joined chunks.
- Request bodies go out with the request, never after an ``Expect: 100-continue`` handshake
  (botocore asks for one on file-like and ``bytes`` bodies): against an endpoint that stops
  answering, that wait outlived every timeout. See :func:`_send_bodies_at_once`.
- ``create`` is ``pipe_file(path, data, mode="create")``: on S3 a PUT with
  ``If-None-Match: *``. S3 answers 412 Precondition Failed when the key exists, which s3fs
  raises as ``FileExistsError`` (an ``OSError(EINVAL)`` caused by a ``ClientError`` with
  status 412 where the endpoint omits the ``Condition`` field); both, and AWS's 409
  ``ConditionalRequestConflict`` for a racing conditional PUT, become
  ``CheckpointConflictError``. On other protocols create-only is as atomic as their
  ``pipe_file(mode="create")``, which is verified only for S3 (a warning says so).
- Directories do not exist on S3: a prefix ``step-N`` exists iff an object is under it,
  ``list_dir`` lists the names directly under a prefix, and a directory's ``mtime`` is the
  newest ``LastModified`` under it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.core import split_protocol, strip_protocol

from elastic_ddp._compat import IncompatibleLibraryError
from elastic_ddp.checkpoint.files import HASH_NAME, Checksum, FileRecord, basename, file_record
from elastic_ddp.errors import CheckpointConflictError, CheckpointError, CheckpointStorageError

logger = logging.getLogger(__name__)

S3_PROTOCOLS = frozenset({"s3", "s3a"})

DEFAULT_PART_BYTES = 50 << 20
"""Part size of a multipart upload unless the options set ``default_block_size`` (s3fs's default too)."""
MIN_PART_BYTES = 5 << 20
"""S3's smallest part (all but the last)."""
PARTS_IN_FLIGHT = 10
"""Parts of one file uploaded at once unless the options set ``max_concurrency`` (s3fs's
default too): S3's throughput per connection is limited, and each part in flight holds its
bytes in memory (at most this many x the part size)."""
_FIXED_OPTIONS = {"use_listings_cache": False}
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_CREDENTIAL_OPTION = re.compile(r"key|secret|token|password|credential|sas", re.IGNORECASE)
_MASK = "***"


class FsspecStorage:
    """The :class:`~elastic_ddp.checkpoint.storage.Storage` protocol over an fsspec filesystem."""

    def __init__(self, uri: str, options: Mapping[str, Any]) -> None:
        self.root = uri.rstrip("/")
        self.protocol = split_protocol(uri)[0] or ""
        self._secrets = _credential_values(options)
        self._failures = _transport_errors(self.protocol)
        self._fs = self._filesystem(options)
        self._client: Any = None
        """The S3 client that :func:`_send_bodies_at_once` was applied to."""
        if self.protocol not in S3_PROTOCOLS:
            logger.warning(
                "checkpoint storage %s: create-only commits are verified on s3:// only; on %s:// they are as "
                "atomic as its pipe_file(mode='create')", self.root, self.protocol,
            )

    def _filesystem(self, options: Mapping[str, Any]) -> fsspec.AbstractFileSystem:
        if options.get("use_listings_cache"):
            raise CheckpointError(
                f"storage option use_listings_cache for {self.root} is not supported: a cached listing "
                "hides checkpoints that other processes committed"
            )
        try:
            if self.protocol in S3_PROTOCOLS:
                from elastic_ddp.checkpoint import _s3fs_compat  # noqa: F401 - checks what this module relies on in s3fs
            fs = fsspec.filesystem(self.protocol, **{**options, **_FIXED_OPTIONS})
            if self.protocol in S3_PROTOCOLS:
                fs.connect()  # builds the client (no request yet): a bad option fails here, not mid-save
            return fs
        except IncompatibleLibraryError as exc:
            raise CheckpointError(f"cannot open {self.root}: {exc}") from exc
        except ImportError as exc:
            raise CheckpointError(
                f"cannot open {self.root}: {exc}. For s3:// URIs: pip install 'elastic-ddp[s3]'"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise CheckpointError(self._redact(f"cannot open {self.root} with these storage options: {exc}")) from exc

    def join(self, *parts: str) -> str:
        """Like ``os.path.join`` for local paths: a part that is a whole URI starts the path over."""
        path = self.root
        for part in parts:
            path = part if "://" in part else posixpath.join(path, part)
        return path

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        with self._errors("write", path):
            if self.protocol in S3_PROTOCOLS:
                return self._upload(path, chunks)
            return self._put_whole(path, chunks)

    def _upload(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        """One PUT for a file of at most one part, else a multipart upload with up to
        ``max_concurrency`` parts going up at once (memory: that many parts); the object
        appears when the upload completes, and any failure aborts the upload."""
        fs = self._fs
        part_bytes = max(int(getattr(fs, "default_block_size", 0) or 0) or DEFAULT_PART_BYTES, MIN_PART_BYTES)
        with Checksum() as checksum:
            parts = _parts(_hashed(chunks, checksum), part_bytes)
            first = next(parts)
            second = next(parts, None)
            if second is None:
                fs.pipe_file(path, first)
                return checksum.record()
            bucket, key, _ = fs.split_path(path)
            upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
            try:
                done = self._upload_parts(bucket, key, upload_id, itertools.chain([first, second], parts))
                fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                           MultipartUpload={"Parts": done})
            except BaseException:
                self._abort(bucket, key, upload_id, path)
                raise
            fs.invalidate_cache(path)
            return checksum.record()

    def _upload_parts(self, bucket: str, key: str, upload_id: str, parts: Iterable[bytes]) -> list[dict[str, Any]]:
        """Upload the parts, at most ``max_concurrency`` at once, on fsspec's event loop; their numbers and ETags."""
        from elastic_ddp.checkpoint._s3fs_compat import call_s3  # s3fs is optional: S3 only

        fs = self._fs
        most = max(int(getattr(fs, "max_concurrency", 0) or 0) or PARTS_IN_FLIGHT, 1)
        in_flight: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = collections.deque()
        done: list[dict[str, Any]] = []

        def finish_oldest() -> None:
            number, future = in_flight.popleft()
            done.append({"PartNumber": number, "ETag": future.result()["ETag"]})

        try:
            for number, body in enumerate(parts, start=1):
                if len(in_flight) >= most:
                    finish_oldest()
                call = call_s3(fs, "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
                in_flight.append((number, asyncio.run_coroutine_threadsafe(call, fs.loop)))
            while in_flight:
                finish_oldest()
        finally:
            for _, future in in_flight:  # after a failure: stop the others before the upload is aborted
                future.cancel()
            concurrent.futures.wait([future for _, future in in_flight])
        return done

    def _abort(self, bucket: str, key: str, upload_id: str, path: str) -> None:
        """Abort an unfinished multipart upload so that none of its parts is ever committed."""
        try:
            self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - the original error matters more; an unfinished upload is invisible to readers
            logger.warning(
                "could not abort the upload of %s (%s); a bucket lifecycle rule for incomplete multipart uploads "
                "removes its parts", path, type(exc).__name__,
            )

    def _put_whole(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        with Checksum() as checksum:
            self._fs.pipe_file(path, b"".join(_hashed(chunks, checksum)))
            return checksum.record()

    def create(self, path: str, data: bytes) -> None:
        with self._errors("create", path):
            try:
                self._fs.pipe_file(path, data, mode="create")
            except OSError as exc:
                if not _lost_create_race(exc):
                    raise
                if self._holds(path, data):
                    return  # our own earlier attempt, retried after its response was lost
                raise CheckpointConflictError(f"{path} already exists: another writer committed first") from exc

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self._fs.cat_file(path) == data
        except FileNotFoundError:
            return False

    def replace(self, path: str, data: bytes) -> None:
        with self._errors("write", path):
            self._fs.pipe_file(path, data)

    def read(self, path: str) -> bytes:
        with self._errors("read", path):
            return self._fs.cat_file(path)

    def read_hashed(self, path: str, hash_name: str = HASH_NAME) -> tuple[bytes, FileRecord]:
        data = self.read(path)
        return data, file_record(data, hash_name)

    def list_dir(self, path: str) -> list[str]:
        with self._errors("list", path):
            try:
                entries = self._fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        itself = strip_protocol(path).rstrip("/")
        return sorted({basename(entry) for entry in entries if entry.rstrip("/") != itself})

    def exists(self, path: str) -> bool:
        with self._errors("look up", path):
            try:
                self._fs.info(path)
            except FileNotFoundError:
                return False
        return True

    def mtime(self, path: str) -> float:
        with self._errors("stat", path):
            entries = self._fs.find(path, detail=True)
            if not entries:
                raise FileNotFoundError(path)
            return max(self._modified(name, info) for name, info in entries.items())

    def _modified(self, name: str, info: Mapping[str, Any]) -> float:
        stamp = info.get("LastModified") or self._fs.modified(name)
        return stamp.timestamp()

    def remove(self, path: str) -> None:
        with self._errors("remove", path):
            self._fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        with self._errors("remove", path):
            self._fs.rm(path, recursive=True)

    @contextmanager
    def _errors(self, action: str, path: str) -> Iterator[None]:
        """Raise the client's exceptions as the storage errors of the protocol, naming the URI."""
        try:
            if self.protocol in S3_PROTOCOLS:
                self._prepare_client()
            yield
        except FileNotFoundError as exc:
            if action in ("write", "create"):  # S3 NoSuchBucket: nothing can be written there
                raise CheckpointStorageError(self._redact(f"cannot {action} {path}: {exc}")) from exc
            raise CheckpointError(f"{path} does not exist") from exc
        except self._failures as exc:
            raise CheckpointStorageError(self._redact(
                f"cannot {action} {path}: {type(exc).__name__}: {exc}. Check that the endpoint is reachable and "
                "the credentials (--checkpoint-storage-options or the AWS_* environment) are valid"
            )) from exc

    def _prepare_client(self) -> None:
        """Apply :func:`_send_bodies_at_once` to s3fs's client, again whenever s3fs built a new one
        (it does when it refreshes its session)."""
        from elastic_ddp.checkpoint._s3fs_compat import client  # s3fs is optional: S3 only

        current = client(self._fs)
        if current is not self._client:
            self._client = current
            _send_bodies_at_once(current)

    def _redact(self, message: str) -> str:
        for secret in self._secrets:
            message = message.replace(secret, _MASK)
        return message


def _transport_errors(protocol: str) -> tuple[type[BaseException], ...]:
    """What a failing request raises: OSError and timeouts, plus botocore's own errors for S3."""
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
    if protocol in S3_PROTOCOLS:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += (BotoCoreError, ClientError)
    return errors


def _lost_create_race(exc: OSError) -> bool:
    """Whether a create-only PUT failed because the key exists (412) or is being created by a racer (409)."""
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return status == 412 or code == "ConditionalRequestConflict"


def _hashed(chunks: Iterable[bytes | memoryview], checksum: Checksum) -> Iterator[bytes | memoryview]:
    for chunk in chunks:
        checksum.update(chunk)
        yield chunk


def _parts(chunks: Iterable[bytes | memoryview], part_bytes: int) -> Iterator[bytes]:
    """The chunks' bytes regrouped into parts of exactly ``part_bytes`` (the last one shorter, or
    empty when there are no bytes at all): S3 wants every part but the last of at least 5 MiB.

    Each part is joined once into ``bytes``, which botocore sends with less CPU than a ``bytearray``;
    see :func:`_send_bodies_at_once` for why that is safe."""
    pieces: list[memoryview] = []
    size, yielded = 0, False
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            take = min(part_bytes - size, view.nbytes)
            pieces.append(view[:take])
            size += take
            view = view[take:]
            if size == part_bytes:
                yield b"".join(pieces)
                pieces, size, yielded = [], 0, True
    if pieces or not yielded:  # always at least one part: an empty file is one empty PUT
        yield b"".join(pieces)


def _drop_expect_continue(params: dict[str, Any], **_: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _send_bodies_at_once(client: Any) -> None:
    """Make an S3 client send request bodies at once instead of asking ``Expect: 100-continue``.

    botocore asks for it on every file-like body, and it wraps ``bytes`` bodies in one. Against an
    endpoint that stops answering, the wait for ``100 Continue`` outlived every timeout: a save
    hung for minutes instead of failing after its 2 s read timeout (the S3-outage test). Without
    the header the body goes out with the request and the read timeout applies. Registered last
    on ``before-call.s3``, after botocore's own handler; ``unique_id`` makes it idempotent.
    """
    client.meta.events.register_last("before-call.s3", _drop_expect_continue, unique_id="elastic-ddp-no-expect-continue")


def _credential_values(options: Mapping[str, Any]) -> tuple[str, ...]:
    """Every credential in the options or the AWS environment, longest first (for masking)."""
    found = {os.environ.get(name, "") for name in _CREDENTIAL_ENV} | set(_option_credentials(options))
    return tuple(sorted((value for value in found if len(value) >= 4), key=len, reverse=True))


def _option_credentials(options: Mapping[str, Any]) -> Iterator[str]:
    for name, value in options.items():
        if isinstance(value, Mapping):
            yield from _option_credentials(value)
        elif isinstance(value, str) and _CREDENTIAL_OPTION.search(str(name)):
            yield value
