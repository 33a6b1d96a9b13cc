"""The etcd-v3 backend and agent store against a real etcd: torch's backend contract, TTL, outages."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_ddp.rendezvous import EtcdRendezvousBackend, EtcdStore, create_backend
from elastic_ddp.rendezvous.client import ClientOptions, GrpcEtcdClient
from tests.fixtures.etcd_proc import EtcdServer, free_ports

pytestmark = pytest.mark.integration


def backend_and_store(endpoint: str, run_id: str | None = None, **conf: str) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    params = RendezvousParameters("etcd-v3", endpoint, run_id or uuid.uuid4().hex[:12], 1, 1, **conf)
    return create_backend(params)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(0.1)


def test_get_state_is_none_on_an_empty_etcd(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint)
    assert backend.get_state() is None


def test_create_only_then_cas_with_a_new_token_each_time(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint)
    state, token, written = backend.set_state(b"s0")
    assert written and backend.get_state() == (b"s0", token)
    assert backend.set_state(b"other") == (b"s0", token, False)
    tokens = [token]
    for i in range(1, 4):
        _, token, written = backend.set_state(b"s%d" % i, token)
        assert written
        tokens.append(token)
    assert tokens == sorted(set(tokens))


def test_stale_token_returns_current_state_and_token(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint)
    _, stale, _ = backend.set_state(b"s1")
    _, current, _ = backend.set_state(b"s2", stale)
    assert backend.set_state(b"s3", stale) == (b"s2", current, False)
    assert backend.set_state(b"s3", "not-a-token") == (b"s2", current, False)


def test_backends_of_two_runs_do_not_see_each_other(etcd_server: EtcdServer) -> None:
    first, _ = backend_and_store(etcd_server.endpoint, "run-a")
    second, _ = backend_and_store(etcd_server.endpoint, "run-b")
    first.set_state(b"a")
    assert second.get_state() is None
    assert first.key == "/elastic_ddp/rdzv/run-a/state"


def test_corrupt_state_raises_rendezvous_state_error(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint, "corrupt", key_prefix="/custom")
    client = GrpcEtcdClient(ClientOptions(endpoints=(etcd_server.endpoint,), request_timeout=5))
    client.put(b"/custom/corrupt/state", b"written by someone else")
    with pytest.raises(RendezvousStateError, match="/custom/corrupt/state"):
        backend.get_state()


def test_eight_concurrent_cas_writers_have_one_winner_per_round(etcd_server: EtcdServer) -> None:
    run_id = "cas-race"
    backends = [backend_and_store(etcd_server.endpoint, run_id)[0] for _ in range(8)]
    start = threading.Barrier(len(backends))
    for round_index in range(5):
        current = backends[0].get_state()
        token = None if current is None else current[1]
        results: list[tuple[int, bool]] = []
        errors: list[BaseException] = []

        def write(index: int, backend: EtcdRendezvousBackend) -> None:
            try:
                start.wait(timeout=30)
                results.append((index, backend.set_state(b"round-%d-by-%d" % (round_index, index), token)[2]))
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i, b)) for i, b in enumerate(backends)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors
        winners = [index for index, won in results if won]
        assert len(results) == 8 and len(winners) == 1, results
        assert backends[0].get_state()[0] == b"round-%d-by-%d" % (round_index, winners[0])


def test_state_expires_after_ttl_without_writes(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint, ttl="3", keep_alive_interval="1", keep_alive_max_attempt="2")
    backend.set_state(b"stale round")
    assert backend.get_state() is not None
    wait_until(lambda: backend.get_state() is None, 15, "the state to expire with its lease")
    _, _, written = backend.set_state(b"fresh round")
    assert written


def test_unreachable_etcd_fails_within_read_timeout_naming_the_endpoint() -> None:
    (port,) = free_ports(1)
    endpoint = "127.0.0.1:%d" % port
    backend, _ = backend_and_store(endpoint, read_timeout="2", join_timeout="10")
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        backend.get_state()
    assert time.monotonic() - start < 5


def test_backend_survives_an_etcd_restart(etcd_server: EtcdServer) -> None:
    backend, _ = backend_and_store(etcd_server.endpoint, read_timeout="2", join_timeout="10")
    _, token, _ = backend.set_state(b"before")
    etcd_server.stop()
    with pytest.raises(RendezvousConnectionError, match=etcd_server.endpoint):
        backend.get_state()
    etcd_server.start()
    assert backend.get_state() == (b"before", token)
    assert backend.set_state(b"after", token)[2]


def test_store_operations_on_real_etcd(etcd_server: EtcdServer) -> None:
    _, store = backend_and_store(etcd_server.endpoint, "store-ops", read_timeout="5", join_timeout="10")
    _, peer = backend_and_store(etcd_server.endpoint, "store-ops", read_timeout="5", join_timeout="10")
    round_store = dist.PrefixStore("torch.rendezvous.store-ops.0", store)
    round_store.set("MASTER_ADDR", "127.0.0.1")
    assert round_store.get("MASTER_ADDR") == b"127.0.0.1"
    assert [round_store.add("n", 1) for _ in range(3)] == [1, 2, 3]
    assert round_store.compare_set("cs", "", "v1") == b"v1"
    assert round_store.compare_set("cs", "nope", "v2") == b"v1"
    round_store.multi_set(["r/0", "r/1"], ["a", "b"])
    assert round_store.multi_get(["r/0", "r/1"]) == [b"a", b"b"]
    assert round_store.check(["r/0"]) and not round_store.check(["r/9"])
    assert round_store.delete_key("r/0")
    assert store.num_keys() == 4  # MASTER_ADDR, n, cs, r/1

    timer = threading.Timer(0.2, peer.set, args=("torch.rendezvous.store-ops.0/late", b"1"))
    timer.start()
    round_store.wait(["late"], timedelta(seconds=5))
    timer.join()
    with pytest.raises(dist.DistStoreError, match="never"):
        round_store.wait(["never"], timedelta(milliseconds=300))
