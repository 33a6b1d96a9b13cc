"""The etcd-v3 rendezvous's rounds (elastic_ddp.rendezvous.rounds) and LeaseKeeper, against the in-memory fake
etcd; tests/integration/test_rendezvous_scale.py runs the same protocol on a real etcd."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.elastic import events
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elastic_ddp import job_end
from elastic_ddp.rendezvous.errors import EtcdLeaseNotFoundError, JobEnded
from elastic_ddp.rendezvous.etcd import EtcdRendezvousHandler, create_rdzv_handler
from elastic_ddp.rendezvous.lease import LeaseKeeper
from elastic_ddp.rendezvous.rounds import Member, Node, node_key
from elastic_ddp.rendezvous.settings import EtcdRendezvousSettings
from elastic_ddp.rendezvous.store import EtcdStore
from tests.fixtures.fake_etcd import FakeEtcdClient

TTL = 60
PREFIX = b"/elastic_ddp/rdzv/job/"


@pytest.fixture
def client() -> FakeEtcdClient:
    return FakeEtcdClient()


@pytest.fixture
def leases(client: FakeEtcdClient) -> LeaseKeeper:
    return LeaseKeeper(client, TTL, clock=client.clock)


def node(client: FakeEtcdClient, nodes: tuple[int, int] = (1, 1), join_s: int = 20, last_call_s: int = 1,
         early_close: bool = True, keep_alive_s: int = 5, attempts: int = 3) -> EtcdRendezvousHandler:
    """An etcd-v3 handler on the fake, as create_rdzv_handler builds it (without the reachability check)."""
    config = {"join_timeout": str(join_s), "last_call_timeout": str(last_call_s), "early_close": str(early_close).lower(),
              "keep_alive_interval": str(keep_alive_s), "keep_alive_max_attempt": str(attempts), "reach_check": "false"}
    settings = EtcdRendezvousSettings.from_config("fake:2379", "job", config)
    return EtcdRendezvousHandler.build(settings, client, *nodes, "127.0.0.1")


def together(handlers: list[EtcdRendezvousHandler], timeout: float = 30) -> list[int]:
    """Every handler's next_rendezvous at once (threads); the world sizes they got, in order."""
    sizes: dict[int, int] = {}
    errors: list[BaseException] = []

    def join(index: int) -> None:
        try:
            sizes[index] = handlers[index].next_rendezvous().world_size
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(index,), daemon=True) for index in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
        assert not thread.is_alive(), "a node did not complete its rendezvous within %s s" % timeout
    assert not errors, errors
    return [sizes[index] for index in range(len(handlers))]


# -- LeaseKeeper ---------------------------------------------------------------------------------


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


def test_store_keys_expire_with_their_lease_when_nobody_writes(client: FakeEtcdClient, leases: LeaseKeeper) -> None:
    store = EtcdStore(client, "/p/store/", leases, timedelta(seconds=5))
    store.set("a", b"1")
    client.clock.advance(TTL - 1)
    assert store.check(["a"])
    client.clock.advance(2)
    assert not store.check(["a"])


# -- rounds --------------------------------------------------------------------------------------


def test_three_nodes_get_distinct_ranks_and_one_world_size(client: FakeEtcdClient) -> None:
    handlers = [node(client, (3, 3)) for _ in range(3)]
    ranks: list[int] = []
    threads = [threading.Thread(target=lambda h=h: ranks.append(h.next_rendezvous().rank)) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(ranks) == [0, 1, 2]
    for handler in handlers:
        handler.shutdown()


def test_one_node_writes_its_key_once_per_round_and_the_closer_the_membership_once(client: FakeEtcdClient) -> None:
    """The protocol's cost: per node one transaction that writes (its key; the first node's also creates the
    closer key), plus one for the membership; heartbeats write nothing."""
    handlers = [node(client, (4, 4), keep_alive_s=1) for _ in range(4)]
    before = len(client.calls)
    together(handlers)
    calls = client.calls[before:]
    writes = [call for call in calls if call in ("put", "put_many", "put_if", "transact", "delete")]
    assert calls.count("transact") == 4 + 1  # four joins, one membership
    assert len(writes) == 4 + 1 + 2  # and the agents' store: MASTER_ADDR and MASTER_PORT by rank 0
    settled = len(client.calls)
    time.sleep(1.5)  # one heartbeat interval passes: keep-alives only
    assert set(client.calls[settled:]) <= {"lease_refresh", "wait_for_changes"}
    for handler in handlers:
        handler.shutdown()


def test_the_first_round_waits_its_last_call_and_a_re_formation_closes_once_every_live_node_joined(
        client: FakeEtcdClient) -> None:
    handlers = [node(client, (2, 3), last_call_s=2) for _ in range(2)]
    began = time.monotonic()
    assert together(handlers) == [2, 2]
    first = time.monotonic() - began
    began = time.monotonic()
    assert together(handlers) == [2, 2]
    second = time.monotonic() - began
    assert first >= 2.0, "the job's first round waits its last call"
    assert second < 1.0
    for handler in handlers:
        handler.shutdown()


def test_without_early_close_a_re_formation_waits_its_last_call(client: FakeEtcdClient) -> None:
    handlers = [node(client, (2, 3), last_call_s=2, early_close=False) for _ in range(2)]
    together(handlers)
    began = time.monotonic()
    together(handlers)
    assert time.monotonic() - began >= 2.0
    for handler in handlers:
        handler.shutdown()


def test_a_round_opens_only_once_every_node_of_the_last_left_it(client: FakeEtcdClient) -> None:
    """The first node to re-join waits while the other still trains in the old round (its agent restarts
    its workers once it sees a node waiting), and both end up in one round: not one round each."""
    a, b = node(client, (1, 3), last_call_s=1), node(client, (1, 3), last_call_s=1)
    together([a, b])
    sizes: dict[str, int] = {}
    a_thread = threading.Thread(target=lambda: sizes.__setitem__("a", a.next_rendezvous().world_size), daemon=True)
    a_thread.start()
    deadline = time.monotonic() + 10
    while b.num_nodes_waiting() == 0:  # b's agent polls while its workers train
        assert time.monotonic() < deadline, "b never saw a waiting"
        time.sleep(0.05)
    time.sleep(1.5)  # b's agent is slow to stop its workers: longer than the last call
    assert "a" not in sizes, "a formed a round alone while b still trained in the last one"
    sizes["b"] = b.next_rendezvous().world_size
    a_thread.join(timeout=10)
    assert sizes == {"a": 2, "b": 2}
    for handler in (a, b):
        handler.shutdown()


def test_a_node_beyond_max_nodes_waits_as_a_spare_without_stopping_the_others(client: FakeEtcdClient) -> None:
    a, b = node(client, (1, 2)), node(client, (1, 2))
    together([a, b])
    spare = node(client, (1, 2))
    sizes: list[int] = []
    thread = threading.Thread(target=lambda: sizes.append(spare.next_rendezvous().world_size), daemon=True)
    thread.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the spare is not a waiting node for the running ones
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        time.sleep(0.1)
    assert thread.is_alive()
    a.leave()  # one of the two goes: the spare takes its place in the next round
    deadline = time.monotonic() + 10
    while b.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "b never saw a leave"
        time.sleep(0.05)
    assert b.next_rendezvous().world_size == 2
    thread.join(timeout=10)
    assert sizes == [2]
    for handler in (b, spare):
        handler.shutdown()


def test_a_node_that_left_a_full_round_re_joins_as_a_waiting_node_not_a_spare(client: FakeEtcdClient) -> None:
    """Three nodes of a 1:3 job; one leaves (a node left out by the reachability check) and the other two
    re-form without it. Its re-join first lands its key in the round formed without it; that key must not
    count as a node training there, or the job looks full (3 of max 3) and the node waits as a spare that
    nobody waits for."""
    a, b, c = (node(client, (1, 3), keep_alive_s=1) for _ in range(3))
    assert together([a, b, c]) == [3, 3, 3]
    c.leave()
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0 or b.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the others never saw c leave"
        time.sleep(0.05)
    assert together([a, b]) == [2, 2]
    sizes: list[int] = []
    thread = threading.Thread(target=lambda: sizes.append(c.next_rendezvous().world_size), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "c's re-join never showed as a waiting node"
        time.sleep(0.05)
    assert together([a, b]) == [3, 3]
    thread.join(timeout=10)
    assert sizes == [3]
    for handler in (a, b, c):
        handler.shutdown()


def test_a_node_gone_from_a_large_round_reaches_every_node_through_its_ring_predecessors(client: FakeEtcdClient) -> None:
    """Each training node watches only its own key, the keys of the few members after it on the ring of
    ranks and the next round's closer key. A node that leaves is seen gone by the members before it; they
    re-join at once, and the first join of the next round is a node waiting for everyone else: all re-form
    without it."""
    handlers = [node(client, (1, 8), keep_alive_s=1) for _ in range(8)]
    assert together(handlers) == [8] * 8
    ranks = {handler._state_holder.state.participants[handler._this_node]: handler for handler in handlers}
    gone = ranks[6]
    watchers = {ranks[rank] for rank in (3, 4, 5)}  # rank 6 is among the three after each of them on the ring
    gone.leave()
    survivors = [handler for handler in handlers if handler is not gone]
    saw: set[EtcdRendezvousHandler] = set()  # a poll that counts a peer gone says so once: the agent acts on it
    deadline = time.monotonic() + 10
    while saw != watchers:
        assert time.monotonic() < deadline, "the members before the gone node never saw it gone"
        saw |= {handler for handler in watchers - saw if handler.num_nodes_waiting() > 0}
        time.sleep(0.05)
    assert all(handler.num_nodes_waiting() == 0 for handler in survivors if handler not in watchers), \
        "a node that does not watch the gone one saw a change before anyone re-joined"
    sizes: dict[int, int] = {}

    def agent(index: int, handler: EtcdRendezvousHandler) -> None:  # what torchrun's agent does
        while handler not in saw and handler.num_nodes_waiting() == 0:
            time.sleep(0.05)
        sizes[index] = handler.next_rendezvous().world_size

    threads = [threading.Thread(target=agent, args=(index, handler), daemon=True) for index, handler in enumerate(survivors)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sizes == {index: 7 for index in range(7)}
    for handler in survivors:
        handler.shutdown()


def test_a_peer_whose_lease_expired_counts_as_a_waiting_node(client: FakeEtcdClient) -> None:
    silent, survivor = node(client, (1, 2), keep_alive_s=1, attempts=2), node(client, (1, 2), keep_alive_s=1, attempts=2)
    together([silent, survivor])
    assert survivor.num_nodes_waiting() == 0
    silent._stop_heartbeats()
    liveness = silent._rounds._liveness.current()  # type: ignore[union-attr]
    client.leases[liveness].expires_at = client.clock()  # its keep-alives stopped: etcd drops its lease
    deadline = time.monotonic() + 10
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the survivor never saw its peer gone"
        client.get(b"tick")  # any call lets the fake expire leases
        time.sleep(0.05)
    assert survivor.next_rendezvous().world_size == 1
    survivor.shutdown()


def test_a_node_that_leaves_marks_its_key_leaving_before_its_lease_goes(client: FakeEtcdClient) -> None:
    """The survivor's watch sees the mark, then the key's deletion: a peer gone on purpose, not one whose lease
    expired (which may have lost etcd alone)."""
    leaver, survivor = node(client, (1, 2), keep_alive_s=1), node(client, (1, 2), keep_alive_s=1)
    together([leaver, survivor])
    leaver.leave()
    deadline = time.monotonic() + 10
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the survivor never saw its peer gone"
        time.sleep(0.05)
    watch = survivor._rounds_state().watch
    assert watch is not None and watch.view.left == {node_key(leaver._this_node)}
    assert not [key for key in client.data if key.startswith(PREFIX + b"round/") and b"/j/" in key
                and node_key(leaver._this_node).encode() in key], "the leaver's key outlived its leave"
    survivor.shutdown()


def test_a_node_descriptor_says_leaving_with_one_word_after_its_probe() -> None:
    member = Member(Node("host", 7, 0), "127.0.0.1:9")
    leaving = dataclasses.replace(member, leaving=True)
    assert Member.decode(member.encode()) == member and Member.decode(leaving.encode()) == leaving
    assert leaving.encode()[4] == "leaving"
    for bad in (["host", 7, 0, "127.0.0.1:9", "left"], ["host", 7, 0, "127.0.0.1:9", True],
                ["host", 7, 0, "127.0.0.1:9", "leaving", "leaving"], ["host", 7, 0]):
        with pytest.raises(ValueError, match="node descriptor"):
            Member.decode(bad)


def test_a_node_whose_own_lease_expired_asks_to_rejoin(client: FakeEtcdClient) -> None:
    """Its key is gone, so the next round would form without it: its agent must restart and re-join rather
    than train on beside that round."""
    handler = node(client, (1, 1), keep_alive_s=1, attempts=1)
    assert handler.next_rendezvous().world_size == 1
    assert handler.num_nodes_waiting() == 0
    liveness = handler._rounds._liveness.current()  # type: ignore[union-attr]
    client.leases[liveness].expires_at = client.clock()
    deadline = time.monotonic() + 10
    while handler.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the node never noticed its key gone"
        client.get(b"tick")
        time.sleep(0.05)
    assert handler.next_rendezvous().world_size == 1
    assert handler.num_nodes_waiting() == 0
    handler.shutdown()


def test_a_round_that_does_not_reach_min_nodes_times_out_and_leaves_no_key(client: FakeEtcdClient) -> None:
    lonely = node(client, (2, 2), join_s=1)
    with pytest.raises(RendezvousTimeoutError):
        lonely.next_rendezvous()
    assert not [key for key in client.data if key.startswith(PREFIX + b"round/")]


def test_a_corrupt_membership_is_a_state_error_naming_the_key(client: FakeEtcdClient) -> None:
    client.raw_put(PREFIX + b"latest", b"0")
    client.raw_put(PREFIX + b"round/0000000000/c/members", b"{not json")
    with pytest.raises(RendezvousStateError, match="round/0000000000/c/members"):
        node(client).next_rendezvous()


def test_a_foreign_value_under_the_join_prefix_is_ignored(client: FakeEtcdClient) -> None:
    client.raw_put(PREFIX + b"round/0000000000/j/intruder", b"\x00garbage")
    assert node(client, (1, 1)).next_rendezvous().world_size == 1


def test_a_closed_rendezvous_refuses_a_join(client: FakeEtcdClient) -> None:
    first = node(client)
    first.next_rendezvous()
    first.shutdown()
    assert node(client).is_closed()


# -- what torchrun sees ---------------------------------------------------------------------------


@pytest.fixture
def no_first_contact(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The handler's first contact with etcd answered (these tests have no etcd), and the interpreter's excepthook,
    which the handler replaces in torchrun's process, restored."""
    import sys

    from elastic_ddp.rendezvous import etcd

    monkeypatch.setattr(etcd, "_first_contact", lambda client, settings: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return monkeypatch


@pytest.mark.parametrize("choice", [None, "0", "1"])
def test_every_attempt_gets_a_fresh_worker_store_and_the_environment_is_left_alone(
        no_first_contact: pytest.MonkeyPatch, choice: str | None) -> None:
    """Workers never share an agent's long-lived store (exported to them as TORCHELASTIC_USE_AGENT_STORE), and
    creating the handler changes nothing that other handlers in the process read (torch's own read
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE) but the directory where its workers may say the job ends."""
    no_first_contact.delenv(job_end.DIR_ENV, raising=False)
    if choice is None:
        no_first_contact.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    else:
        no_first_contact.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", choice)
    before = dict(os.environ)
    handler = create_rdzv_handler(RendezvousParameters("etcd-v3", "127.0.0.1:1", "job", 1, 1, "127.0.0.1"))
    assert handler.use_agent_store is False
    directory = os.environ.pop(job_end.DIR_ENV)
    assert dict(os.environ) == before
    assert os.path.isdir(directory) and f"-{os.getpid()}-" in directory


def test_a_rendezvous_does_not_inspect_the_stack_for_events_nobody_records(
        client: FakeEtcdClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch names each event with inspect.stack() even when no handler records it; at scale that naming
    was most of the agents' CPU time."""

    def stack(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", stack)
    handler = node(client)
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()


def test_recorded_events_name_the_handler_and_its_operation(client: FakeEtcdClient, monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    monkeypatch.setitem(event_handlers._log_handlers, "dynamic_rendezvous", Collect())
    monkeypatch.setattr(events, "_events_loggers", {})
    handler = node(client)
    handler.next_rendezvous()
    handler.shutdown()
    names = {json.loads(record)["name"].split(":", 1)[1] for record in records}
    assert {"EtcdRendezvousHandler.next_rendezvous", "EtcdRendezvousHandler._close"} <= names


def test_a_worker_s_job_end_record_closes_the_rendezvous_with_its_reason_for_every_node(
        client: FakeEtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent whose worker ended as config ends with its status; a peer finds the rendezvous closed with the
    same reason and ends alike; later plain closes (the agents' shutdowns) keep the reason."""
    first, second = (node(client, (2, 2)) for _ in range(2))
    together([first, second])
    monkeypatch.setenv(job_end.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(job_end.RUN_ID_ENV, "job")
    assert job_end.tell_agent(job_end.JobEnd("config", 2, "--seed was 1, is 7 now", 0))
    with pytest.raises(JobEnded) as ended:
        first.next_rendezvous()
    assert ended.value.code == 2 and "--seed was 1, is 7 now" in ended.value.message
    first.shutdown()
    monkeypatch.setenv(job_end.DIR_ENV, str(tmp_path / "another-agent"))
    with pytest.raises(JobEnded) as also:
        second.next_rendezvous()
    assert also.value.code == 2 and also.value.message == ended.value.message
    second.shutdown()
    assert job_end.JobEnd.decode(second._rounds.closed_reason() or b"").detail == "--seed was 1, is 7 now"


def test_a_plain_close_ends_the_next_rendezvous_as_torch_expects(client: FakeEtcdClient) -> None:
    first, second = (node(client, (2, 2)) for _ in range(2))
    together([first, second])
    first.set_closed()
    with pytest.raises(RendezvousClosedError):
        second.next_rendezvous()
