"""Shared pytest configuration: fixtures for real etcd and S3 servers live in tests/fixtures/."""

import os
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.fixtures.etcd", "tests.fixtures.s3"]

REPLICA_DIR_ENV = "ELASTIC_DDP_REPLICA_DIR"  # elastic_ddp.checkpoint.replica's, restated (this file imports no torch)


@pytest.fixture(autouse=True, scope="session")
def _replicas_in_the_sessions_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Jobs the tests start keep their replicas under the session's temp directory, not in the machine's
    /dev/shm, where a killed job's would stay (the chaos cluster gives each node its own)."""
    previous = os.environ.get(REPLICA_DIR_ENV)
    os.environ[REPLICA_DIR_ENV] = str(tmp_path_factory.mktemp("node-memory"))
    yield
    if previous is None:
        os.environ.pop(REPLICA_DIR_ENV, None)
    else:
        os.environ[REPLICA_DIR_ENV] = previous
