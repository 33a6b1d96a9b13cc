"""GrpcEtcdClient's fail-over and error mapping, with scripted RPC outcomes (no etcd, no network)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from elastic_ddp.rendezvous.client import ClientOptions, GrpcEtcdClient, _prefix_end
from elastic_ddp.rendezvous.errors import EtcdAuthError, EtcdConnectionError, EtcdLeaseNotFoundError

ENDPOINTS = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def scripted(outcomes: list[object], seen: list[int]) -> Callable[[grpc.Channel, float, object], object]:
    """An RPC that records which channel it ran on and raises or returns the next outcome."""

    def rpc(channel: grpc.Channel, timeout: float, metadata: object) -> object:
        seen.append(id(channel))
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return rpc


def client(timeout: float = 2.0, **options: object) -> GrpcEtcdClient:
    return GrpcEtcdClient(ClientOptions(endpoints=ENDPOINTS, request_timeout=timeout, **options))


def unavailable() -> FakeRpcError:
    return FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")


def test_fails_over_to_the_next_endpoint_and_sticks_to_it() -> None:
    etcd, seen = client(), []
    assert etcd._call("get", scripted([unavailable(), "ok"], seen)) == "ok"
    assert etcd._call("get", scripted(["again"], seen)) == "again"
    assert seen[1] == seen[2] != seen[0]


def test_etcd_side_deadline_counts_as_retryable() -> None:
    etcd, seen = client(), []
    outcomes = [FakeRpcError(grpc.StatusCode.UNKNOWN, "context deadline exceeded"), "ok"]
    assert etcd._call("get", scripted(outcomes, seen)) == "ok"


def test_gives_up_at_the_deadline_naming_every_endpoint() -> None:
    etcd = client(timeout=0.5)
    start = time.monotonic()
    with pytest.raises(EtcdConnectionError) as info:
        etcd._call("get", scripted([unavailable() for _ in range(1000)], []))
    assert time.monotonic() - start < 1.5
    for endpoint in ENDPOINTS:
        assert endpoint in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_lease_not_found_is_its_own_error_and_not_retried() -> None:
    etcd, seen = client(), []
    error = FakeRpcError(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
    with pytest.raises(EtcdLeaseNotFoundError):
        etcd._call("put", scripted([error, "never"], seen))
    assert len(seen) == 1


@pytest.mark.parametrize(
    "code, details",
    [
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password"),
    ],
)
def test_auth_failures_are_auth_errors(code: grpc.StatusCode, details: str) -> None:
    with pytest.raises(EtcdAuthError, match="rdzv-conf"):
        client()._call("get", scripted([FakeRpcError(code, details)], []))


def test_invalid_token_logs_in_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    etcd, seen = client(user="train", password="pw"), []
    logins: list[str] = []

    def fake_metadata(channel: grpc.Channel, timeout: float) -> tuple[tuple[str, str], ...]:
        logins.append("login")
        return (("token", "t%d" % len(logins)),)

    monkeypatch.setattr(etcd, "_metadata", fake_metadata)
    expired = FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
    assert etcd._call("get", scripted([expired, "ok"], seen)) == "ok"
    assert len(logins) == 2 and seen[0] == seen[1]


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert _prefix_end(b"/a/") == b"/a0"
    assert _prefix_end(b"a\xff") == b"b"
    assert _prefix_end(b"\xff\xff") == b"\x00"
