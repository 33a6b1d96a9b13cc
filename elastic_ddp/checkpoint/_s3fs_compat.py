"""What S3 checkpoint storage (:mod:`elastic_ddp.checkpoint.remote`) relies on in s3fs beyond its API.

s3fs is the optional ``s3`` extra: ``remote.FsspecStorage`` imports this module only for an
``s3://`` root, and importing it checks everything below, raising
:class:`~elastic_ddp._compat.IncompatibleLibraryError` in one line when s3fs changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine
from types import ModuleType
from typing import Any

import s3fs

from elastic_ddp._compat import Behaviour, Private, check

SUPPORTED = "s3fs>=2024.12"
"""The s3fs versions elastic_ddp supports; ``pyproject.toml``'s ``s3`` extra declares the same.
2024.12 is the first release whose ``pipe_file(mode="create")`` is a create-only PUT: before it,
s3fs dropped ``mode`` as an argument ``put_object`` does not take, and a manifest commit silently
overwrote a racing writer's."""

_STORAGE = "remote.FsspecStorage"


def _create_is_create_only(module: ModuleType) -> bool:
    return "mode" in inspect.signature(module.S3FileSystem._pipe_file).parameters


def _call_s3_is_a_coroutine(module: ModuleType) -> bool:
    return inspect.iscoroutinefunction(module.S3FileSystem._call_s3)


REQUIRED = (
    Private(
        name="S3FileSystem._call_s3",
        parameters=("self", "method", "akwarglist", "kwargs"),
        used_in=f"{_STORAGE}._upload_parts: parts uploaded concurrently on fsspec's event loop",
    ),
    Private(
        name="S3FileSystem.s3",
        used_in=f"{_STORAGE}._errors: the botocore client whose requests go out without Expect: 100-continue",
    ),
    Behaviour(
        description="S3FileSystem._call_s3 is a coroutine function",
        holds=_call_s3_is_a_coroutine,
        used_in=f"{_STORAGE}._upload_parts schedules it with asyncio.run_coroutine_threadsafe",
    ),
    Behaviour(
        description="pipe_file(mode='create') is a create-only PUT (S3FileSystem._pipe_file takes mode)",
        holds=_create_is_create_only,
        used_in=f"{_STORAGE}.create: the manifest commit, of which one of two racing writers must lose",
    ),
)

check({s3fs: REQUIRED}, version=s3fs.__version__, supported=SUPPORTED)


def call_s3(fs: s3fs.S3FileSystem, method: str, **kwargs: Any) -> Coroutine[Any, Any, dict[str, Any]]:
    """The coroutine of one S3 call (``fs.call_s3`` runs it to completion; this lets several run at once)."""
    return fs._call_s3(method, **kwargs)


def client(fs: s3fs.S3FileSystem) -> Any:
    """The botocore client ``fs`` sends its requests with (a new one after s3fs refreshes its session)."""
    return fs.s3
