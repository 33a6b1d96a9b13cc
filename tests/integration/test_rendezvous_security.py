"""etcd-v3 against an etcd with authentication, and against one that requires mutual TLS."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pyetcd import etcdrpc
from pyetcd.etcdrpc import auth_pb2
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.rendezvous import EtcdAuthError, EtcdStore, create_rdzv_handler, create_store
from tests.fixtures.etcd_proc import EtcdServer, start_with_port_retries
from tests.fixtures.tls import OpenSslMissing, make_certificates

pytestmark = pytest.mark.integration

TOKEN_TTL_S = 1


def params(endpoint: str, **conf: str) -> RendezvousParameters:
    conf = {"read_timeout": "5", "join_timeout": "10", **conf}
    return RendezvousParameters("etcd-v3", endpoint, "job", 1, 1, local_addr="127.0.0.1", **conf)


def connect(endpoint: str, **conf: str) -> EtcdStore:
    return create_store(params(endpoint, **conf))


def enable_auth(endpoint: str) -> None:
    """root (required by etcd), and user ``train`` with read-write on /elastic_ddp/ only."""
    with grpc.insecure_channel(endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        for user, password, role in (("root", "rootpw", "root"), ("train", "trainpw", "rdzv")):
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password))
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role))
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))
        permission = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=b"/elastic_ddp/", range_end=b"/elastic_ddp0"
        )
        auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="rdzv", perm=permission))
        auth.AuthEnable(etcdrpc.AuthEnableRequest())


@pytest.fixture
def auth_etcd(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdServer]:
    """etcd with auth enabled and auth tokens that expire after a second of disuse."""
    server = start_with_port_retries(
        lambda attempt: EtcdServer.create(
            etcd_binary, tmp_path / ("etcd-%d" % attempt), extra_args=["--auth-token-ttl=%d" % TOKEN_TTL_S]
        )
    )
    assert isinstance(server, EtcdServer)
    try:
        enable_auth(server.endpoint)
        yield server
    finally:
        server.stop()


def test_user_with_password_can_rendezvous(auth_etcd: EtcdServer) -> None:
    handler = create_rdzv_handler(params(auth_etcd.endpoint, user="train", password="trainpw"))
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()
    store = connect(auth_etcd.endpoint, user="train", password="trainpw")
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_expired_auth_token_is_renewed_transparently(auth_etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    store = connect(auth_etcd.endpoint, user="train", password="trainpw")
    store.set("k", b"state")
    time.sleep(TOKEN_TTL_S + 1.5)  # let the server-side token TTL run out; nothing to poll for
    with caplog.at_level(logging.INFO, logger="elastic_ddp.rendezvous.client"):
        assert store.get("k") == b"state"
    assert "logging in again" in caplog.text


def test_wrong_password_fails_fast_with_auth_error_and_hides_the_password(auth_etcd: EtcdServer) -> None:
    store = connect(auth_etcd.endpoint, user="train", password="not-the-password")
    start = time.monotonic()
    with pytest.raises(EtcdAuthError, match="authentication failed") as info:
        store.check(["k"])
    assert time.monotonic() - start < 2
    assert "not-the-password" not in str(info.value)
    assert isinstance(info.value, RendezvousConnectionError)


def test_a_handler_with_a_wrong_password_says_etcd_refused_the_user_not_that_no_member_answered(
    auth_etcd: EtcdServer,
) -> None:
    with pytest.raises(EtcdAuthError) as info:
        create_rdzv_handler(params(auth_etcd.endpoint, user="train", password="not-the-password"))
    message = str(info.value)
    assert message.startswith(f"etcd-v3: etcd at {auth_etcd.endpoint} refused the credentials of user 'train'")
    assert "no etcd member answered" not in message
    assert "not-the-password" not in message
    assert "\n" not in message


def test_keys_outside_the_granted_prefix_are_refused(auth_etcd: EtcdServer) -> None:
    store = connect(auth_etcd.endpoint, user="train", password="trainpw", key_prefix="/elsewhere")
    with pytest.raises(EtcdAuthError, match="permission denied"):
        store.check(["k"])


def test_missing_credentials_are_named(auth_etcd: EtcdServer) -> None:
    store = connect(auth_etcd.endpoint)
    with pytest.raises(EtcdAuthError, match="user name is empty"):
        store.check(["k"])


@pytest.fixture
def tls_etcd(etcd_binary: str, tmp_path: Path) -> Iterator[tuple[EtcdServer, dict[str, str]]]:
    """etcd serving TLS only, requiring client certificates; yields it and the client's --rdzv-conf."""
    try:
        server_files, client_files = make_certificates(tmp_path / "pki")
    except OpenSslMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    server = start_with_port_retries(
        lambda attempt: EtcdServer.create(etcd_binary, tmp_path / ("etcd-%d" % attempt), tls=server_files)
    )
    assert isinstance(server, EtcdServer)
    conf = {"cacert": str(client_files.ca), "cert": str(client_files.cert), "key": str(client_files.key)}
    try:
        yield server, conf
    finally:
        server.stop()


def test_mutual_tls_with_ca_and_client_certificate(tls_etcd: tuple[EtcdServer, dict[str, str]]) -> None:
    server, conf = tls_etcd
    handler = create_rdzv_handler(params(server.endpoint, **conf))
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()
    store = connect(server.endpoint, **conf)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_https_endpoint_with_only_a_ca_is_refused_by_client_cert_auth(
    tls_etcd: tuple[EtcdServer,
    dict[str, str]],
) -> None:
    server, conf = tls_etcd
    store = connect("https://" + server.endpoint, cacert=conf["cacert"], read_timeout="2")
    with pytest.raises(RendezvousConnectionError, match=server.endpoint):
        store.check(["k"])


def test_plaintext_client_cannot_talk_to_a_tls_member(tls_etcd: tuple[EtcdServer, dict[str, str]]) -> None:
    server, _ = tls_etcd
    store = connect(server.endpoint, read_timeout="2")
    with pytest.raises(RendezvousConnectionError, match=server.endpoint):
        store.check(["k"])
