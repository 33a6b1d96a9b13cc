"""The etcd client operations the rounds use, on a real etcd and on the fake (one contract); the agents' store
against a real etcd: TTL, outages, etcd's transaction size limit."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.rendezvous import EtcdStore, create_store
from elastic_ddp.rendezvous.client import Absent, ClientOptions, Delete, GrpcEtcdClient, Put, Read
from elastic_ddp.rendezvous.errors import EtcdConnectionError
from tests.fixtures.etcd_proc import EtcdServer, free_ports
from tests.fixtures.fake_etcd import FakeEtcdClient

pytestmark = pytest.mark.integration


def store_of(endpoint: str, run_id: str | None = None, **conf: str) -> EtcdStore:
    return create_store(RendezvousParameters("etcd-v3", endpoint, run_id or uuid.uuid4().hex[:12], 1, 1, **conf))


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(0.1)


@pytest.fixture(params=["real", "fake"])
def client(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The same operations on a real etcd and on the unit tests' fake: both must pass every test below."""
    if request.param == "fake":
        return FakeEtcdClient()
    server = request.getfixturevalue("etcd_server")
    return GrpcEtcdClient(ClientOptions(endpoints=(server.endpoint,), request_timeout=5))


def test_transact_runs_success_or_failure_and_returns_the_reads(client) -> None:  # type: ignore[no-untyped-def]
    first = client.transact([(b"/t/closer", Absent())], [Put(b"/t/closer", b"a"), Put(b"/t/j/a", b"1"), Read(b"/t/m")],
                            [Put(b"/t/j/a", b"1"), Read(b"/t/m")])
    assert first.succeeded and first.reads == (None,)
    second = client.transact([(b"/t/closer", Absent())], [Put(b"/t/closer", b"b"), Read(b"/t/closer")],
                             [Put(b"/t/j/b", b"2"), Delete(b"/t/j/a"), Read(b"/t/closer")])
    assert not second.succeeded and second.revision > first.revision
    assert second.reads[0] is not None and second.reads[0].value == b"a"
    keys, revision = client.range_prefix(b"/t/j/")
    assert [kv.key for kv in keys] == [b"/t/j/b"] and revision == second.revision
    between, _ = client.range_prefix(b"/t/c", end=b"/t/k")
    assert [kv.key for kv in between] == [b"/t/closer", b"/t/j/b"]


def test_a_watch_delivers_puts_and_deletes_after_its_revision_batch_by_batch(client) -> None:  # type: ignore[no-untyped-def]
    revision = client.put(b"/w/a", b"1")
    with client.watch(b"/w/", b"/w0", revision) as watch:
        assert watch.revision == revision
        assert watch.next(0.2).events == ()
        threading.Timer(0.1, lambda: client.transact([], [Put(b"/w/b", b"2"), Delete(b"/w/a")])).start()
        changes = watch.next(5)
        assert [(event.deleted, event.kv.key) for event in changes.events] == [(False, b"/w/b"), (True, b"/w/a")]
        assert all(event.kv.mod_revision == revision + 1 for event in changes.events)
        later = client.put(b"/w/c", b"3")
        assert [(event.kv.key, event.kv.mod_revision) for event in watch.next(5).events] == [(b"/w/c", later)]
        assert watch.revision == later
    with client.watch(b"/w/x", b"/w/y", revision) as outside:
        assert outside.next(0.2).events == ()


def test_a_watch_of_keys_sees_those_keys_only(client) -> None:  # type: ignore[no-untyped-def]
    revision = client.put(b"/k/a", b"1")
    with client.watch_keys([b"/k/a", b"/k/c"], revision) as watch:
        client.put(b"/k/b", b"2")
        client.put(b"/k/ab", b"2")
        later = client.transact([], [Put(b"/k/c", b"3"), Delete(b"/k/a")]).revision
        seen: list[tuple[bool, bytes]] = []
        while len(seen) < 2:
            changes = watch.next(5)
            assert changes.events, "a change to a watched key did not arrive"
            seen += [(event.deleted, event.kv.key) for event in changes.events]
        assert sorted(seen) == [(False, b"/k/c"), (True, b"/k/a")] and watch.revision == later
        assert watch.next(0.2).events == ()


def test_a_watch_from_now_sees_only_later_changes(client) -> None:  # type: ignore[no-untyped-def]
    before = client.put(b"/n/a", b"1")
    with client.watch(b"/n/", b"/n0") as watch:
        assert watch.revision >= before
        assert watch.next(0.2).events == (), "an earlier change was replayed"
        after = client.put(b"/n/b", b"2")
        assert [event.kv.key for event in watch.next(5).events] == [b"/n/b"] and after > watch.revision - 1


def test_closing_a_watch_wakes_its_waiter(client) -> None:  # type: ignore[no-untyped-def]
    watch = client.watch(b"/z/", b"/z0")
    threading.Timer(0.2, watch.close).start()
    began = time.monotonic()
    assert watch.next(10).events == ()
    assert time.monotonic() - began < 5
    client.put(b"/z/a", b"1")
    assert watch.next(0.2).events == ()


def test_many_watches_of_a_client_share_one_stream_and_each_gets_its_own_keys(etcd_server: EtcdServer) -> None:
    client = GrpcEtcdClient(ClientOptions(endpoints=(etcd_server.endpoint,), request_timeout=5))
    watches = [client.watch(b"/m/%d/" % index, b"/m/%d0" % index) for index in range(20)]
    assert len(client._streams) == 1  # type: ignore[attr-defined]
    for index in (3, 17, 3):
        client.put(b"/m/%d/k" % index, b"%d" % index)
    assert [len(watch.next(5).events) for watch in (watches[3], watches[17])] == [1, 1]
    assert [event.kv.value for event in watches[3].next(5).events] == [b"3"]
    for watch in watches[:10]:
        watch.close()
    client.put(b"/m/12/k", b"12")
    assert [event.kv.value for event in watches[12].next(5).events] == [b"12"]
    client.close()


def test_a_watch_resumes_after_an_etcd_restart_from_the_last_change_it_delivered(etcd_server: EtcdServer) -> None:
    """The stream breaks with the member; the watch starts again on the restarted one, after the revision it
    delivered last, so a change made while it was gone is delivered, and none twice."""
    client = GrpcEtcdClient(ClientOptions(endpoints=(etcd_server.endpoint,), request_timeout=2))
    writer = GrpcEtcdClient(ClientOptions(endpoints=(etcd_server.endpoint,), request_timeout=10))
    with client.watch(b"/r/", b"/r0") as watch:
        writer.put(b"/r/a", b"1")
        assert [event.kv.key for event in watch.next(5).events] == [b"/r/a"]
        etcd_server.stop()
        with pytest.raises(EtcdConnectionError):
            watch.next(3)
        etcd_server.start()
        writer.put(b"/r/b", b"2")
        seen: list[bytes] = []
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            try:
                seen = [event.kv.key for event in watch.next(5).events]
            except EtcdConnectionError:
                time.sleep(0.2)
        assert seen == [b"/r/b"]
    client.close()
    writer.close()


def test_many_keys_are_read_and_written_in_transactions_etcd_accepts(etcd_server: EtcdServer) -> None:
    """etcd refuses a transaction of more than 128 operations by default: rank 0's agent reads every agent's
    key in one multi_get, so a job of more nodes than that needs it split."""
    store = store_of(etcd_server.endpoint, read_timeout="10", join_timeout="30")
    keys = ["role/%d" % rank for rank in range(300)]
    store.multi_set(keys, [str(rank) for rank in range(300)])
    assert store.multi_get(keys) == [str(rank).encode() for rank in range(300)]


def test_store_keys_expire_after_ttl_without_writes(etcd_server: EtcdServer) -> None:
    store = store_of(etcd_server.endpoint, ttl="3", keep_alive_interval="1", keep_alive_max_attempt="2")
    store.set("k", b"stale")
    assert store.check(["k"])
    wait_until(lambda: not store.check(["k"]), 15, "the key to expire with its lease")


def test_unreachable_etcd_fails_within_read_timeout_naming_the_endpoint() -> None:
    (port,) = free_ports(1)
    endpoint = "127.0.0.1:%d" % port
    store = store_of(endpoint, read_timeout="2", join_timeout="10")
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        store.check(["k"])
    assert time.monotonic() - start < 5


def test_store_survives_an_etcd_restart(etcd_server: EtcdServer) -> None:
    store = store_of(etcd_server.endpoint, read_timeout="2", join_timeout="10")
    store.set("k", b"before")
    etcd_server.stop()
    with pytest.raises(RendezvousConnectionError, match=etcd_server.endpoint):
        store.check(["k"])
    etcd_server.start()
    assert store.get("k") == b"before"
    store.set("k", b"after")
    assert store.get("k") == b"after"


def test_store_operations_on_real_etcd(etcd_server: EtcdServer) -> None:
    store = store_of(etcd_server.endpoint, "store-ops", read_timeout="5", join_timeout="10")
    peer = store_of(etcd_server.endpoint, "store-ops", read_timeout="5", join_timeout="10")
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
