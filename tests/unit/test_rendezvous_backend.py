"""EtcdRendezvousBackend and LeaseKeeper logic against the in-memory fake etcd."""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed.elastic import events
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout, create_handler

from elastic_ddp.rendezvous.errors import EtcdConnectionError, EtcdLeaseNotFoundError
from elastic_ddp.rendezvous.etcd import (
    EtcdRendezvousBackend,
    EtcdRendezvousHandler,
    _decode_state,
    _encode_state,
    create_rdzv_handler,
)
from elastic_ddp.rendezvous.lease import LeaseKeeper
from elastic_ddp.rendezvous.store import EtcdStore
from tests.fixtures.fake_etcd import FakeEtcdClient

KEY = "/elastic_ddp/rdzv/job/state"
TTL = 60


@pytest.fixture
def client() -> FakeEtcdClient:
    return FakeEtcdClient()


@pytest.fixture
def leases(client: FakeEtcdClient) -> LeaseKeeper:
    return LeaseKeeper(client, TTL, clock=client.clock)


@pytest.fixture
def backend(client: FakeEtcdClient, leases: LeaseKeeper) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(client, KEY, leases)


def test_a_waiting_node_is_woken_by_another_nodes_write(
    backend: EtcdRendezvousBackend, client: FakeEtcdClient, leases: LeaseKeeper
) -> None:
    _, token, _ = backend.set_state(b"round 1")
    other = EtcdRendezvousBackend(client, KEY, leases)
    threading.Timer(0.05, other.set_state, args=(b"round 2", token)).start()
    started = time.monotonic()
    assert backend.wait_for_change(5.0)
    assert time.monotonic() - started < 2.0


def test_no_write_is_no_change_after_the_timeout(backend: EtcdRendezvousBackend) -> None:
    backend.set_state(b"round 1")
    assert not backend.wait_for_change(0.1)


def test_an_etcd_that_does_not_answer_is_no_change_not_an_error(
    backend: EtcdRendezvousBackend, client: FakeEtcdClient
) -> None:
    """The watch's budget is the short wait; an outage must not fail the rendezvous there (the read
    that follows rides it out up to read_timeout)."""
    backend.set_state(b"round 1")
    client.down = True
    started = time.monotonic()
    assert not backend.wait_for_change(0.2)
    assert time.monotonic() - started >= 0.19


def test_name_is_the_registered_entry_point_name(backend: EtcdRendezvousBackend) -> None:
    assert backend.name == "etcd-v3"


def test_get_state_is_none_when_nothing_was_written(backend: EtcdRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_set_state_without_token_creates_and_returns_a_token(backend: EtcdRendezvousBackend) -> None:
    state, token, written = backend.set_state(b"s1")
    assert (state, written) == (b"s1", True)
    assert backend.get_state() == (b"s1", token)


def test_set_state_without_token_never_overwrites(backend: EtcdRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s1")
    assert backend.set_state(b"s2") == (b"s1", token, False)


def test_token_changes_on_every_successful_set(backend: EtcdRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"s0")
    tokens = [token]
    for i in range(1, 5):
        _, token, written = backend.set_state(b"s%d" % i, token)
        assert written
        tokens.append(token)
    assert len(set(tokens)) == 5 and tokens == sorted(tokens)


def test_stale_token_returns_current_state_without_writing(backend: EtcdRendezvousBackend) -> None:
    _, stale, _ = backend.set_state(b"s1")
    _, current, _ = backend.set_state(b"s2", stale)
    assert backend.set_state(b"s3", stale) == (b"s2", current, False)
    assert backend.get_state() == (b"s2", current)


@pytest.mark.parametrize("token", ["12", b"12", 0, -3, True, 1.5, object()])
def test_token_not_issued_by_this_backend_returns_current_state(backend: EtcdRendezvousBackend, token: object) -> None:
    _, current, _ = backend.set_state(b"s1")
    assert backend.set_state(b"s2", token) == (b"s1", current, False)


def test_stale_token_after_the_state_vanished_returns_none(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    _, token, _ = backend.set_state(b"s1")
    client.delete(KEY.encode())
    assert backend.set_state(b"s2", token) is None
    assert backend.set_state(b"s2", "garbage") is None


@pytest.mark.parametrize(
    "raw",
    [b"", b"not ours", _encode_state(b"payload")[:-1], _encode_state(b"payload").replace(b":", b";", 2)],
    ids=["empty", "foreign", "truncated", "bad-header"],
)
def test_corrupt_state_raises_state_error_naming_the_key(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
    raw: bytes,
) -> None:
    client.raw_put(KEY.encode(), raw)
    with pytest.raises(RendezvousStateError, match=KEY):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"s", None)


def test_state_framing_round_trips_binary_payloads() -> None:
    payload = bytes(range(256)) * 3
    assert _decode_state(_encode_state(payload)) == payload
    assert _decode_state(_encode_state(b"")) == b""


def test_connection_errors_reach_torch_as_rendezvous_connection_errors(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    client.fail_next(EtcdConnectionError("etcd get failed: no endpoint answered (tried fake:2379)"))
    with pytest.raises(RendezvousConnectionError, match="fake:2379"):
        backend.get_state()


def test_state_is_written_under_the_participants_lease_with_one_transaction_per_set(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    _, token, _ = backend.set_state(b"s1")
    lease = client.data[KEY.encode()].lease
    assert lease in client.leases
    client.calls.clear()
    _, token, _ = backend.set_state(b"s2", token)
    assert client.calls == ["get", "put_if"]
    assert client.data[KEY.encode()].lease == lease
    client.clock.advance(TTL / 10)
    client.calls.clear()
    backend.set_state(b"s3", token)
    assert client.calls == ["get", "lease_refresh", "put_if"]


def test_state_changed_between_check_and_write_is_returned_not_overwritten(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    _, token, _ = backend.set_state(b"s1")
    other = EtcdRendezvousBackend(client, KEY, LeaseKeeper(client, TTL, clock=client.clock))
    check = client.get

    def check_then_lose_the_race(key: bytes, timeout: float | None = None):
        current = check(key, timeout)
        client.get = check  # type: ignore[method-assign]
        other.set_state(b"theirs", token)
        return current

    client.get = check_then_lose_the_race  # type: ignore[method-assign]
    state, their_token, written = backend.set_state(b"mine", token)
    assert (state, written) == (b"theirs", False)
    assert backend.get_state() == (b"theirs", their_token)


def test_stale_token_is_answered_by_a_read_without_a_transaction(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    _, old_token, _ = backend.set_state(b"s1")
    _, token, _ = backend.set_state(b"s2", old_token)
    client.calls.clear()
    assert backend.set_state(b"s3", old_token) == (b"s2", token, False)
    assert backend.set_state(b"s3") == (b"s2", token, False)  # "create" while a state exists
    assert client.calls == ["get", "get"]


def test_state_expires_with_its_lease_when_nobody_writes(
    backend: EtcdRendezvousBackend,
    client: FakeEtcdClient,
) -> None:
    backend.set_state(b"s1")
    client.clock.advance(TTL - 1)
    assert backend.get_state() is not None
    client.clock.advance(2)
    assert backend.get_state() is None


def test_expired_lease_is_replaced_on_the_next_write(backend: EtcdRendezvousBackend, client: FakeEtcdClient) -> None:
    _, token, _ = backend.set_state(b"s1")
    first_lease = client.data[KEY.encode()].lease
    client.clock.advance(TTL + 1)
    _, token, written = backend.set_state(b"s2")
    assert written and client.data[KEY.encode()].lease != first_lease


def test_lease_revoked_between_refresh_and_write_is_regranted(client: FakeEtcdClient, leases: LeaseKeeper) -> None:
    lease = leases.current()
    seen: list[int] = []

    def put(lease_id: int) -> str:
        seen.append(lease_id)
        if lease_id == lease:
            raise EtcdLeaseNotFoundError("lease not found")
        return "ok"

    assert leases.write(put) == "ok"
    assert seen[0] == lease and seen[1] != lease


def test_store_refreshes_the_lease_only_every_tenth_of_the_ttl(client: FakeEtcdClient, leases: LeaseKeeper) -> None:
    store = EtcdStore(client, "/p/store/", leases, timedelta(seconds=5))
    store.set("a", b"1")
    store.set("b", b"1")
    assert client.calls.count("lease_refresh") == 0
    client.clock.advance(TTL / 10)
    store.set("c", b"1")
    assert client.calls.count("lease_refresh") == 1


def test_concurrent_creators_have_exactly_one_winner(client: FakeEtcdClient) -> None:
    backends = [EtcdRendezvousBackend(client, KEY, LeaseKeeper(client, TTL, clock=client.clock)) for _ in range(8)]
    results: list[bool] = []
    barrier = threading.Barrier(len(backends))

    def create(backend: EtcdRendezvousBackend, index: int) -> None:
        barrier.wait()
        results.append(backend.set_state(b"node-%d" % index)[2])

    threads = [threading.Thread(target=create, args=(b, i)) for i, b in enumerate(backends)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]


def test_dynamic_handler_over_the_fake_gives_distinct_ranks(client: FakeEtcdClient) -> None:
    """Three nodes in threads rendezvous through torch's handler on the fake etcd."""
    outcomes: dict[int, tuple[int, int]] = {}
    errors: list[BaseException] = []
    all_joined = threading.Barrier(3, timeout=60)

    def node(index: int) -> None:
        try:
            leases = LeaseKeeper(client, TTL, clock=client.clock)
            backend = EtcdRendezvousBackend(client, KEY, leases)
            store = EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=30))
            params = RendezvousParameters("etcd-v3", "fake:2379", "job", 3, 3, "127.0.0.1", last_call_timeout="1")
            handler = create_handler(store, backend, params)
            info = handler.next_rendezvous()
            outcomes[index] = (info.rank, info.world_size)
            all_joined.wait()  # closing before the others saw the round would fail them
            handler.shutdown()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert sorted(rank for rank, _ in outcomes.values()) == [0, 1, 2]
    assert {size for _, size in outcomes.values()} == {3}


@pytest.fixture
def no_store_choice(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An agent environment that does not set TORCH_DISABLE_SHARE_RDZV_TCP_STORE (restored afterwards),
    with the handler's first contact with etcd answered (these tests have no etcd) and the interpreter's
    excepthook, which the handler replaces in torchrun's process, restored."""
    import sys

    from elastic_ddp.rendezvous import etcd

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setattr(etcd, "_first_contact", lambda client, settings: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return monkeypatch


def test_handler_defaults_to_a_fresh_worker_store_per_attempt(no_store_choice: pytest.MonkeyPatch) -> None:
    """torchrun creates the handler before its first round; from then on workers get no shared agent store."""
    handler = create_rdzv_handler(RendezvousParameters("etcd-v3", "127.0.0.1:1", "job", 1, 1, "127.0.0.1"))
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert handler.use_agent_store is False  # exported to workers as TORCHELASTIC_USE_AGENT_STORE


def test_explicit_shared_store_choice_is_kept(no_store_choice: pytest.MonkeyPatch) -> None:
    no_store_choice.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    handler = create_rdzv_handler(RendezvousParameters("etcd-v3", "127.0.0.1:1", "job", 1, 1, "127.0.0.1"))
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"
    assert handler.use_agent_store is True


def test_node_dropped_during_an_outage_longer_than_the_keep_alive_window_asks_to_rejoin(client: FakeEtcdClient) -> None:
    """After the outage its own (stale) heartbeat gets it removed from the round; its agent must
    restart and re-join rather than train on beside a round that forms without it."""
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    handler = EtcdRendezvousHandler.from_backend(
        "job", EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=5)), EtcdRendezvousBackend(client, KEY, leases),
        1, 1, "127.0.0.1", RendezvousTimeout(), keep_alive_interval=1, keep_alive_max_attempt=1,
    )  # fmt: skip
    assert handler.next_rendezvous().world_size == 1
    assert handler.num_nodes_waiting() == 0
    client.down = True
    time.sleep(1.5)  # the outage itself: longer than the 1 s keep-alive window
    client.down = False
    assert handler.num_nodes_waiting() == 1
    assert handler.next_rendezvous().world_size == 1
    assert handler.num_nodes_waiting() == 0
    handler.shutdown()


def _one_node_handler(client: FakeEtcdClient) -> EtcdRendezvousHandler:
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    return EtcdRendezvousHandler.from_backend(
        "job", EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=5)), EtcdRendezvousBackend(client, KEY, leases),
        1, 1, "127.0.0.1", RendezvousTimeout(),
    )  # fmt: skip


@pytest.fixture
def no_stack_inspection(monkeypatch: pytest.MonkeyPatch) -> None:
    """inspect.stack() fails: what torch calls to name each rendezvous event, recorded or not."""

    def stack(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", stack)


def test_torchs_handler_inspects_the_stack_for_events_nobody_records(
    client: FakeEtcdClient, no_stack_inspection: None
) -> None:
    """The control for the next test: torch's own handler pays for naming its events."""
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    params = RendezvousParameters("etcd-v3", "fake:2379", "job", 1, 1, "127.0.0.1")
    handler = create_handler(EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=5)),
                             EtcdRendezvousBackend(client, KEY, leases), params)
    with pytest.raises(AssertionError, match="inspect.stack"):
        handler.next_rendezvous()


def test_etcd_handler_rendezvous_without_inspecting_the_stack(client: FakeEtcdClient, no_stack_inspection: None) -> None:
    """Every lost compare-and-swap is another pass of the join loop; naming its events by
    inspect.stack() was most of the agents' CPU time when many joined at once."""
    handler = _one_node_handler(client)
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()


def test_recorded_events_keep_torchs_names(client: FakeEtcdClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an event handler configured, the events are recorded under the names torch gives them."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    monkeypatch.setitem(event_handlers._log_handlers, "dynamic_rendezvous", Collect())
    monkeypatch.setattr(events, "_events_loggers", {})
    handler = _one_node_handler(client)
    handler.next_rendezvous()
    handler.shutdown()
    names = {json.loads(record)["name"].split(":", 1)[1] for record in records}
    assert "_DistributedRendezvousOpExecutor._add_to_participants" in names
    assert "DynamicRendezvousHandler.next_rendezvous" in names


def _finish_times_of_a_staggered_join(client: FakeEtcdClient, handler_type: type,
                                      b_calls: list[tuple[str, float]] | None = None) -> list[float]:
    """Node A joins an elastic round (1 to 3 nodes, last call 3 s from A's join); node B joins
    0.4 s after A is a participant, well within the last call even on a loaded machine (a B that missed the round
    would time out after 20 s). Returns when A and when B got their rank; appends to ``b_calls`` the name of
    each of B's calls to the backend and when it began."""
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    timeout = RendezvousTimeout(join=timedelta(seconds=20), last_call=timedelta(seconds=3))

    def handler(calls: list[tuple[str, float]] | None) -> DynamicRendezvousHandler:
        store = EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=10))
        backend = EtcdRendezvousBackend(client, KEY, leases)
        if calls is not None:
            for name in ("get_state", "set_state"):
                call = getattr(backend, name)
                setattr(backend, name, lambda *args, _call=call, _n=name: (calls.append((_n, time.monotonic())), _call(*args))[1])
        return handler_type.from_backend("job", store, backend, 1, 3, "127.0.0.1", timeout)

    handlers = [handler(None), handler(b_calls)]
    finished = [0.0, 0.0]

    def join(index: int) -> None:
        handlers[index].next_rendezvous()
        finished[index] = time.monotonic()

    first = threading.Thread(target=join, args=(0,))
    first.start()
    reader = EtcdRendezvousBackend(client, KEY, leases)
    deadline = time.monotonic() + 20
    while not ((current := reader.get_state()) and pickle.loads(current[0]).participants):
        assert time.monotonic() < deadline, "node A did not join within 20 s"
        time.sleep(0.01)
    # The stagger of the scenario, not a wait for a condition. torch delays a node's first join by
    # 0-0.3 s, so B adds itself 0.4-0.7 s after A; both re-read the state once a second from then on.
    time.sleep(0.4)
    join(1)
    first.join(timeout=30)
    for node in handlers:
        node.shutdown()
    return finished


def test_a_waiting_participant_wakes_when_the_last_call_ends(client: FakeEtcdClient) -> None:
    """A completes the round when its last call ends; B, which joined 0.4-0.7 s after A, gets its
    rank then too, not at its own next once-a-second read (0.4-0.7 s later)."""
    a, b = _finish_times_of_a_staggered_join(client, EtcdRendezvousHandler)
    assert abs(b - a) < 0.3


def test_torchs_handler_sees_the_end_of_the_last_call_at_its_next_read(client: FakeEtcdClient) -> None:
    """The control for the test above: with torch's executor nothing wakes B. It learns that the round is
    complete from a call of its own to the backend, begun after A completed it, and reads the state only
    once a poll interval (1 s). How late B is depends on the phase of its polls, which load shifts; these
    two facts do not."""
    calls: list[tuple[str, float]] = []
    a, b = _finish_times_of_a_staggered_join(client, DynamicRendezvousHandler, calls)
    last_call = max(started for _, started in calls if started <= b)
    assert last_call >= a, f"B got its rank {b - a:.2f} s after A without a call to the backend since"
    reads = [started for name, started in calls if name == "get_state" and started <= b]
    gaps = [later - earlier for earlier, later in zip(reads, reads[1:])]
    assert len(reads) >= 3 and min(gaps) >= 0.9, f"B read the state at {[round(r - a, 2) for r in reads]} s"


def _elastic_node(client: FakeEtcdClient, leases: LeaseKeeper, nodes: tuple[int, int], join_s: float, last_call_s: float,
                  early_close: bool) -> EtcdRendezvousHandler:
    """An etcd-v3 handler of a job of ``nodes`` (min, max) nodes, as ``create_rdzv_handler`` attaches it."""
    store = EtcdStore(client, "/p/job/store/", leases, timedelta(seconds=10))
    backend = EtcdRendezvousBackend(client, KEY, leases)
    timeout = RendezvousTimeout(join=timedelta(seconds=join_s), last_call=timedelta(seconds=last_call_s))
    node = EtcdRendezvousHandler.from_backend("job", store, backend, *nodes, "127.0.0.1", timeout)
    node.attach(store, backend, early_close=early_close)
    return node


def _round_seconds(client: FakeEtcdClient, early_close: bool) -> tuple[float, float]:
    """Two nodes of an elastic job (2 to 3 nodes, last call 2 s) form a round, then both re-join, as
    after a membership change; returns how long each round took to complete."""
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    handlers = [_elastic_node(client, leases, (2, 3), 20, 2, early_close) for _ in range(2)]

    def rendezvous_of_both() -> None:
        threads = [threading.Thread(target=node.next_rendezvous) for node in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a node did not complete its rendezvous within 30 s"

    began = time.monotonic()
    rendezvous_of_both()
    first = time.monotonic() - began
    rendezvous_of_both()
    second = time.monotonic() - began - first
    for node in handlers:
        node.shutdown()
    return first, second


def test_a_round_after_the_first_closes_once_every_live_node_joined(client: FakeEtcdClient) -> None:
    first, second = _round_seconds(client, early_close=True)
    assert first >= 2.0, "the job's first round waits its last call"
    assert second < 1.0


def test_without_early_close_a_round_waits_its_last_call(client: FakeEtcdClient) -> None:
    """The control for the test above."""
    assert _round_seconds(client, early_close=False)[1] >= 2.0


def test_a_node_between_its_exit_and_its_join_is_not_left_out_of_an_early_close(client: FakeEtcdClient) -> None:
    """torch's re-join runs an exit operation (which drops the node's heartbeat) and then a join. A node
    that re-joins first must not close the next round early while the other is between the two: both
    end up in one round of two."""
    leases = LeaseKeeper(client, TTL, clock=client.clock)
    a, b = (_elastic_node(client, leases, (1, 3), 8, 3, early_close=True) for _ in range(2))
    sizes: dict[str, int] = {}

    def join(name: str, node: EtcdRendezvousHandler) -> None:
        sizes[name] = node.next_rendezvous().world_size

    for name, node in (("a", a), ("b", b)):
        threading.Thread(target=join, args=(name, node)).start()
    deadline = time.monotonic() + 20
    while len(sizes) < 2:
        assert time.monotonic() < deadline, "the first round did not complete"
        time.sleep(0.01)
    assert sizes == {"a": 2, "b": 2}
    b_exited = threading.Event()
    run = b._op_executor.run
    reader = EtcdRendezvousBackend(client, KEY, leases)

    def a_joined_the_next_round() -> bool:
        current = reader.get_state()
        state = pickle.loads(current[0]) if current else None
        return state is not None and state.round > 0 and any(node.pid == os.getpid() for node in state.participants)

    def slow_rejoin(state_handler, deadline, update_deadline=None):  # type: ignore[no-untyped-def]
        run(state_handler, deadline, update_deadline)
        if not b_exited.is_set():  # b's exit operation is done: a re-joins now, before b's join
            b_exited.set()
            threading.Thread(target=join, args=("a", a)).start()
            until = time.monotonic() + 10
            while not a_joined_the_next_round() and time.monotonic() < until:
                time.sleep(0.01)
            time.sleep(0.3)  # the scenario's gap between b's exit and its join (a would close the round in it)

    b._op_executor.run = slow_rejoin  # type: ignore[method-assign]
    sizes.clear()
    b_thread = threading.Thread(target=join, args=("b", b))
    b_thread.start()
    deadline = time.monotonic() + 30
    while len(sizes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    for node in (a, b):
        node.shutdown()
    assert sizes == {"a": 2, "b": 2}, sizes
