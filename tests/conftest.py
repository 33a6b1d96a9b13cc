"""Shared pytest configuration: fixtures for real etcd and S3 servers live in tests/fixtures/."""

pytest_plugins = ["tests.fixtures.etcd", "tests.fixtures.s3"]
