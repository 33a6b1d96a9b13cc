"""EtcdStore follows TCPStore's semantics (checked against the in-memory fake etcd)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ddp.rendezvous.errors import EtcdConnectionError
from elastic_ddp.rendezvous.lease import LeaseKeeper
from elastic_ddp.rendezvous.store import EXIT_BARRIER_COUNT, EXIT_BARRIER_PREFIX, EtcdStore, EtcdStoreValueError
from tests.fixtures.fake_etcd import FakeEtcdClient

PREFIX = "/elastic_ddp/rdzv/job/store/"


@pytest.fixture
def client() -> FakeEtcdClient:
    return FakeEtcdClient()


def make_store(client: FakeEtcdClient, timeout: float = 2.0) -> EtcdStore:
    return EtcdStore(client, PREFIX, LeaseKeeper(client, 600, clock=client.clock), timedelta(seconds=timeout))


@pytest.fixture
def store(client: FakeEtcdClient) -> EtcdStore:
    return make_store(client)


def set_later(store: EtcdStore, key: str, value: bytes, after_s: float = 0.05) -> threading.Thread:
    thread = threading.Timer(after_s, store.set, args=(key, value))
    thread.start()
    return thread


def test_set_then_get_returns_bytes_for_str_and_bytes_values(store: EtcdStore) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xff")
    assert (store.get("a"), store.get("b")) == (b"text", b"\x00\xff")


def test_keys_live_under_the_prefix_with_a_lease(store: EtcdStore, client: FakeEtcdClient) -> None:
    store.set("a", b"1")
    kv = client.data[(PREFIX + "a").encode()]
    assert kv.lease in client.leases


def test_get_blocks_until_another_client_sets_the_key(client: FakeEtcdClient) -> None:
    reader, writer = make_store(client), make_store(client)
    thread = set_later(writer, "late", b"here")
    assert reader.get("late") == b"here"
    thread.join()


def test_get_of_a_missing_key_times_out_with_dist_store_error_naming_it(client: FakeEtcdClient) -> None:
    store = make_store(client, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing-key"):
        store.get("missing-key")
    assert time.monotonic() - start < 2.0


def test_wait_with_explicit_timeout(store: EtcdStore) -> None:
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(milliseconds=50))
    store.set("there", b"1")
    store.wait(["there"], timedelta(milliseconds=50))


def test_wait_returns_when_all_keys_exist(client: FakeEtcdClient) -> None:
    waiter, writer = make_store(client), make_store(client)
    writer.set("k0", b"1")
    threads = [set_later(writer, "k1", b"1", 0.05), set_later(writer, "k2", b"1", 0.1)]
    waiter.wait(["k0", "k1", "k2"])
    assert waiter.check(["k0", "k1", "k2"])
    for thread in threads:
        thread.join()


def test_check_is_false_while_a_key_is_missing(store: EtcdStore) -> None:
    store.set("a", b"1")
    assert store.check(["a"]) and not store.check(["a", "b"])


def test_add_counts_from_zero_and_returns_the_new_value(store: EtcdStore) -> None:
    assert store.add("n", 1) == 1
    assert store.add("n", 5) == 6
    assert store.add("n", -2) == 4
    assert store.get("n") == b"4"


def test_concurrent_adds_lose_no_increment(client: FakeEtcdClient) -> None:
    stores = [make_store(client) for _ in range(4)]
    results: list[int] = []

    def bump(store: EtcdStore) -> None:
        for _ in range(25):
            results.append(store.add("n", 1))

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(1, 101))


def test_add_applied_but_unanswered_is_not_added_twice(store: EtcdStore, client: FakeEtcdClient) -> None:
    """The client retried a swap whose first attempt etcd applied: the retry's compare fails."""
    assert store.add("n", 1) == 1
    client.lose_next_reply = True
    assert store.add("n", 5) == 6
    assert store.get("n") == b"6"


def test_add_markers_do_not_count_as_store_keys(store: EtcdStore) -> None:
    store.add("n", 1)
    store.add("n", 1)
    assert store.num_keys() == 1


def test_add_on_a_non_counter_is_an_error(store: EtcdStore) -> None:
    store.set("n", b"abc")
    with pytest.raises(EtcdStoreValueError, match="n holds"):
        store.add("n", 1)


def test_compare_set_follows_tcpstore(store: EtcdStore) -> None:
    assert store.compare_set("k", "", "first") == b"first"
    assert store.compare_set("k", "wrong", "x") == b"first"
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("missing", "expected", "x") == b"expected"
    assert not store.check(["missing"])


def test_multi_set_and_multi_get(store: EtcdStore) -> None:
    store.multi_set(["a", "b"], [b"1", "2"])
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]


def test_delete_key_and_num_keys(store: EtcdStore) -> None:
    store.set("a", b"1")
    store.set("b", b"1")
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 1


def test_prefix_store_wrapping_as_torch_does(store: EtcdStore, client: FakeEtcdClient) -> None:
    """torch's handler hands agents PrefixStore("torch.rendezvous.<run>.<round>", store)."""
    round_store = dist.PrefixStore("torch.rendezvous.job.3", store)
    round_store.set("MASTER_ADDR", "10.0.0.1")
    assert (PREFIX + "torch.rendezvous.job.3/MASTER_ADDR").encode() in client.data
    assert round_store.get("MASTER_ADDR") == b"10.0.0.1"
    assert round_store.add("count", 2) == 2
    round_store.multi_set(["x", "y"], ["1", "2"])
    assert round_store.multi_get(["x", "y"]) == [b"1", b"2"]
    round_store.set_timeout(timedelta(milliseconds=50))
    assert store.timeout == timedelta(milliseconds=50)
    with pytest.raises(dist.DistStoreError):
        round_store.get("absent")


def test_torch_barrier_utility_runs_on_the_store(client: FakeEtcdClient) -> None:
    """The agent's exit barrier (torch.distributed.elastic.utils.store.barrier) on two agents."""
    from torch.distributed.elastic.utils.store import barrier

    # Keep the Python stores referenced: a PrefixStore alone does not keep a Python
    # Store subclass alive (torch's handler holds its store for the same reason).
    agents = [make_store(client) for _ in range(2)]
    errors: list[BaseException] = []

    def agent(store: EtcdStore) -> None:
        try:
            barrier(dist.PrefixStore("round.1", store), 2, "exit/", 5.0)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(s,)) for s in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not errors and not any(thread.is_alive() for thread in threads)


def exit_barrier(store: EtcdStore, agents: int, timeout_s: float = 5.0) -> None:
    """torchrun's agent's exit barrier, as its agent calls it, on this store."""
    from torch.distributed.elastic.utils.store import barrier

    barrier(dist.PrefixStore("torch.rendezvous.job.1", store), agents, EXIT_BARRIER_PREFIX, timeout_s)


def test_the_exit_barrier_is_given_up_at_once_when_etcd_does_not_answer(client: FakeEtcdClient) -> None:
    store = make_store(client)
    client.down = True
    start = time.monotonic()
    exit_barrier(store, 2)  # no error: the barrier is best effort
    assert time.monotonic() - start < 1
    assert store.exit_barrier_given_up
    assert store.exit_barrier_check_ins == ["torch.rendezvous.job.1/" + EXIT_BARRIER_COUNT]


def test_the_exit_barrier_still_waits_for_the_other_agents_while_etcd_answers(client: FakeEtcdClient) -> None:
    store = make_store(client)
    with pytest.raises(dist.DistStoreError):
        exit_barrier(store, 2, timeout_s=0.2)
    assert not store.exit_barrier_given_up


def test_an_outage_during_the_exit_barrier_wait_ends_it_without_an_error(client: FakeEtcdClient) -> None:
    store = make_store(client)
    threading.Timer(0.1, setattr, args=(client, "down", True)).start()
    exit_barrier(store, 2)
    assert store.exit_barrier_given_up


def test_other_keys_do_not_give_up_when_etcd_does_not_answer(store: EtcdStore, client: FakeEtcdClient) -> None:
    client.down = True
    with pytest.raises(EtcdConnectionError):
        store.add("torch.rendezvous.job.1/counter", 1)
    assert not store.exit_barrier_given_up
