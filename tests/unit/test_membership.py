"""The worker-level membership agreement (elastic_ddp.membership) on a real TCPStore: each worker here is a
thread with its own client connection, as each process has under a launch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ddp.membership import Generations, Membership, MembershipError, alive, describe
from elastic_ddp.rendezvous.errors import EtcdConnectionError
from elastic_ddp.rendezvous.lease import LeaseKeeper
from elastic_ddp.rendezvous.store import EtcdStore
from elastic_ddp.resilience.agreement import Decision, StopAgreement, decide
from elastic_ddp.resilience.exits import ExitReason
from elastic_ddp.resilience.stop import StopRequests
from tests.fixtures.fake_etcd import FakeEtcdClient


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))


def launch(server: dist.TCPStore, uids: list[str], **settings: float) -> list[Generations]:
    """Generation 0 for every uid, in launch rank order, each on its own connection."""
    return first_together([Generations(client(server), uid, **settings) for uid in uids])


def etcd_launch(etcd: FakeEtcdClient, uids: list[str], **settings: float) -> list[Generations]:
    """:func:`launch` on the etcd-backed store (what workers under torchrun use), each worker a store of its own."""
    def store() -> EtcdStore:
        return EtcdStore(etcd, "/job/", LeaseKeeper(etcd, 600, clock=etcd.clock), timedelta(seconds=30))

    return first_together([Generations(store(), uid, **settings) for uid in uids])


def first_together(workers: list[Generations]) -> list[Generations]:
    """Every worker's generation 0 at once, in list order as launch ranks (each waits for all the others)."""
    threads = [threading.Thread(target=worker.first, args=(rank, len(workers))) for rank, worker in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return workers


@contextmanager
def watching(workers: list[Generations]) -> Iterator[None]:
    """Their watchers run for the block and are stopped at its end (before the store goes)."""
    for worker in workers:
        worker.start_watch()
    try:
        yield
    finally:
        for worker in workers:
            worker.stop_watch()


def wait_changed(worker: Generations, timeout_s: float = 30) -> Membership:
    deadline = time.monotonic() + timeout_s
    while (newer := worker.changed()) is None:
        assert time.monotonic() < deadline, f"{worker.uid} never saw the new membership"
        time.sleep(0.002)
    return newer


def test_generation_0_is_the_launch_s_ranks_on_every_worker(server: dist.TCPStore) -> None:
    workers = launch(server, ["a", "b", "c"])
    assert {worker.current for worker in workers} == {Membership(0, ("a", "b", "c"), uid) for uid in "abc"}
    assert [worker.current.rank for worker in workers if worker.current] == [0, 1, 2]


def test_the_survivors_of_a_lost_worker_agree_on_a_generation_without_it_keeping_their_order(
        server: dist.TCPStore) -> None:
    """Rank 0 ("a") dies: it never arrives. "c" finds the group broken and opens generation 1; "b"'s watcher
    arrives while its training thread knows nothing; both get the same list, the old order kept."""
    a, b, c = launch(server, ["a", "b", "c"], last_call_s=0.05)
    with watching([b, c]):
        went_on = c.next("the group failed")
        seen_by_b = wait_changed(b)
    assert went_on.members == seen_by_b.members == ("b", "c")
    assert (went_on.generation, went_on.rank, seen_by_b.rank) == (1, 1, 0)
    assert b.next("its own collective failed too") == seen_by_b  # the training thread adopts what the watcher saw
    assert b.changed() is None and b.current == seen_by_b
    del a


def test_a_member_whose_process_is_gone_is_left_out_at_once_not_after_the_last_call(server: dist.TCPStore) -> None:
    """"c"'s liveness socket is closed (as the kernel closes it when the process dies): "a" and "b" close
    generation 1 without it long before a last call of 60 s; a member that is alive but silent is waited for."""
    a, b, c = launch(server, ["a", "b", "c"], last_call_s=60)
    c.close()
    with watching([b]):
        started = time.monotonic()
        went_on = a.next("c's connection closed")
        assert wait_changed(b).members == went_on.members == ("a", "b")
    assert time.monotonic() - started < 30


def test_when_every_member_arrives_the_generation_closes_without_waiting_for_the_last_call(
        server: dist.TCPStore) -> None:
    workers = launch(server, ["a", "b", "c"], last_call_s=60)
    with watching(workers[1:]):
        started = time.monotonic()
        went_on = workers[0].next("a change asked for at a step boundary")
        took = time.monotonic() - started
        assert [wait_changed(worker).members for worker in workers[1:]] == [("a", "b", "c")] * 2
    assert went_on.members == ("a", "b", "c") and took < 30, took


def test_a_worker_arriving_after_the_close_opens_the_next_generation_and_every_member_ends_in_it(
        server: dist.TCPStore) -> None:
    a, b = launch(server, ["a", "b"], last_call_s=0.05)
    assert a.next("b is slow").members == ("a",)  # b arrives only after the close
    with watching([a]):
        late = b.next("b's collective failed")
        assert late.generation == 2 and late.members == ("a", "b")
        assert wait_changed(a) == Membership(2, ("a", "b"), "a")


def test_a_newcomer_joins_the_running_generation_and_is_ranked_after_every_member(server: dist.TCPStore) -> None:
    """A worker that was not in the launch finds the running generation (here the one after a loss, so the
    hint is followed) and arrives at the next; the members' watchers arrive at once, so it closes without the
    last call; the members keep their order and the newcomer comes last."""
    a, b, c = launch(server, ["a", "b", "c"], last_call_s=60)
    c.close()  # c's process is gone
    with watching([b]):
        assert a.next("c's connection closed").members == ("a", "b")
        assert wait_changed(b).members == ("a", "b")
        b.next("adopting")
    newcomer = Generations(client(server), "n", last_call_s=60)
    with watching([a, b]):
        started = time.monotonic()
        joined = newcomer.join()
        assert (joined.generation, joined.members, joined.rank) == (2, ("a", "b", "n"), 2)
        assert [wait_changed(worker).rank for worker in (a, b)] == [0, 1]
    assert time.monotonic() - started < 30


def test_a_joiner_s_generation_waits_past_the_last_call_for_a_member_slower_than_it(server: dist.TCPStore) -> None:
    """The members' watchers are late (here: none runs; a member's training thread arrives 0.5 s after the
    joiner, ten last calls later): the joiner's generation still waits for them instead of closing with the
    newcomer alone (which its join refuses), and holds both."""
    (a,) = launch(server, ["a"], last_call_s=0.05)
    newcomer = Generations(client(server), "n", last_call_s=0.05)
    joined: list[Membership] = []
    joining = threading.Thread(target=lambda: joined.append(newcomer.join()))
    joining.start()
    deadline = time.monotonic() + 30
    while not server.check(["elastic_ddp/generations/1/open"]):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.5)  # the member is late on purpose: the condition under test is its lateness
    assert a.next("a worker joined").members == ("a", "n")
    joining.join(30)
    assert [membership.members for membership in joined] == [("a", "n")]


class SlowCounting:
    """A store whose arrival counts take ``delay_s`` first (the process descheduled between two calls)."""

    def __init__(self, store: dist.Store, delay_s: float) -> None:
        self._store, self._delay_s = store, delay_s

    def add(self, key: str, amount: int) -> int:
        if key.endswith("/arrivals") and amount:
            time.sleep(self._delay_s)
        return self._store.add(key, amount)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


def test_a_joiner_is_in_the_generation_it_opens_however_late_its_own_arrival_is_counted(
        server: dist.TCPStore) -> None:
    """The members' watchers close a generation once every member is there, and a joiner is none of theirs: so a
    joiner counts itself before it opens the generation, not after (then a slow count left it out, and the join
    took a second generation)."""
    a, b = launch(server, ["a", "b"], last_call_s=60)
    newcomer = Generations(SlowCounting(client(server), 0.3), "n", last_call_s=60, timeout_s=10)  # type: ignore[arg-type]
    with watching([a, b]):
        joined = newcomer.join()
        assert (joined.generation, joined.members) == (1, ("a", "b", "n"))
        assert [wait_changed(worker).generation for worker in (a, b)] == [1, 1]


def test_the_control_plane_names_a_member_whose_process_is_gone_or_a_generation_a_loss_opened(
        server: dist.TCPStore) -> None:
    """For a collective's error whose words name no cause (NCCL's aborted communicator, a timeout): nothing is
    lost while every member lives; a member whose liveness socket refuses is named; so is a generation a peer
    opened because its own collective failed."""
    a, b, c = launch(server, ["a", "b", "c"], last_call_s=0.05)
    assert a.lost_member() is None and b.lost_member() is None
    c.close()
    assert a.lost_member() == "worker c's process is gone"
    b.next("its collective failed")  # closes without a (no watcher) after the last call
    assert a.lost_member() == "a peer opened generation 1: its collective failed"


def test_a_join_s_generation_is_a_planned_change_not_a_lost_member(server: dist.TCPStore) -> None:
    a, b = launch(server, ["a", "b"], last_call_s=60)
    with watching([a, b]):
        Generations(client(server), "n", last_call_s=60).join()
        wait_changed(a)
        assert a.lost_member() is None  # generation 1 is open, but a join opened it


def test_on_the_etcd_store_watchers_wait_for_the_next_generation_and_agree_as_pollers_do() -> None:
    """Under torchrun the watchers wait on an etcd watch in slices of watch_wait_s instead of polling: one
    worker's collective fails, the other's watcher sees the generation open and arrives, so it closes without a
    last call of 60 s, and stopping a waiting watcher takes at most about one slice."""
    client = FakeEtcdClient()
    a, b = etcd_launch(client, ["a", "b"], last_call_s=60, watch_wait_s=0.2)
    with watching([b]):
        started = time.monotonic()
        assert a.next("a's collective failed").members == ("a", "b")
        assert wait_changed(b).members == ("a", "b") and time.monotonic() - started < 30
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 1.5


def test_a_watcher_that_cannot_reach_etcd_asks_again_and_arrives_at_the_next_generation_once_it_answers() -> None:
    """etcd does not answer b's watcher three times (an outage, a restart): the watcher asks again, and when a's
    collective fails afterwards it still arrives, so generation 1 holds both without waiting out the last call."""
    client = FakeEtcdClient()
    a, b = etcd_launch(client, ["a", "b"], last_call_s=20, watch_wait_s=0.2)
    client.fail_next(*[EtcdConnectionError("etcd restarting") for _ in range(3)])
    with watching([b]):
        deadline = time.monotonic() + 30
        while client.failures_left:  # only b's watcher calls etcd meanwhile
            assert time.monotonic() < deadline, "the watcher stopped asking"
            time.sleep(0.01)
        started = time.monotonic()
        assert a.next("a's collective failed").members == ("a", "b")
        assert time.monotonic() - started < 10  # b arrived: no last call of 20 s
        assert wait_changed(b).members == ("a", "b")


def test_joining_a_store_where_nothing_runs_is_a_membership_error(server: dist.TCPStore) -> None:
    with pytest.raises(MembershipError, match="no membership is running"):
        Generations(client(server), "n").join()


def test_members_agreed_to_leave_are_left_out_though_their_watchers_arrive_and_nobody_waits_for_them(
        server: dist.TCPStore) -> None:
    """Rank 2 leaves (its node preempted; every member agreed at one step) but its process still lives and its
    watcher arrives: the next generation holds a and b only, closed without the last call."""
    a, b, c = launch(server, ["a", "b", "c"], last_call_s=60)
    with watching([b, c]):
        started = time.monotonic()
        assert a.next("rank 2 left", leaving=[2]).members == ("a", "b")
        assert wait_changed(b).members == ("a", "b")
        assert time.monotonic() - started < 30
        assert c.changed() is None  # not in it
    c.close()


def test_a_newcomer_never_forms_a_membership_alone_when_every_member_is_gone(server: dist.TCPStore) -> None:
    """Every member's process ended (their liveness sockets refuse) before the newcomer arrived: the generation it
    opens closes with it alone, which is refused, so its node does not train as if it were the job."""
    a, b = launch(server, ["a", "b"], last_call_s=60)
    a.close()
    b.close()
    with pytest.raises(MembershipError, match="ended before worker n joined"):
        Generations(client(server), "n", last_call_s=60, timeout_s=30).join()


def test_a_membership_whose_members_finished_is_alive_for_the_agents_but_not_one_to_join(
        server: dist.TCPStore) -> None:
    """The end of training is not a loss to the rendezvous, but a node starting workers then has nothing to join."""
    a, b = launch(server, ["a", "b"])
    assert alive(client(server)) and alive(client(server), finished_counts=False)
    a.finish()
    b.finish()
    assert alive(client(server))
    assert not alive(client(server), finished_counts=False)


def test_a_launch_whose_peer_never_publishes_is_a_membership_error_in_time(server: dist.TCPStore) -> None:
    alone = Generations(client(server), "a", timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(MembershipError, match="2 workers did not all publish their uid within 0.3 s"):
        alone.first(0, 2)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("uid", ["", "a:b", "a\nb"])
def test_a_uid_that_cannot_be_stored_is_refused(server: dist.TCPStore, uid: str) -> None:
    with pytest.raises(ValueError, match="uid"):
        Generations(server, uid)


def test_describe_names_who_left_and_who_joined() -> None:
    before, after = Membership(0, ("a", "b", "c"), "a"), Membership(1, ("a", "c", "n"), "a")
    assert describe(after, before) == "generation 1: 3 worker(s) (was 3; left: b; joined: n)"


def test_a_stop_some_rank_was_not_asked_for_says_so_and_one_all_ranks_were_asked_for_does_not() -> None:
    assert decide(True, False, True, staying=True) == Decision(ExitReason.PREEMPTED, staying=True)
    assert decide(True, False, False, staying=True).stop is ExitReason.PEER_LOST
    assert not decide(True, False, True, staying=False).staying
    assert decide(False, False, False, staying=True) == Decision()  # no stop: nothing to stay for


def test_the_stop_agreement_carries_the_newest_membership_a_rank_was_told_of() -> None:
    """Alone in its world the agreement needs no collective: what ``news`` answers is the decision; with peers
    the answers meet in the agreement's MAX all-reduce (tests/integration/test_inprocess.py)."""
    assert decide(False, False, False, False, 3) == Decision(None, False, False, 3)
    told = [0]
    agreement = StopAgreement(world_size=1, requests=StopRequests())
    agreement.news = lambda: told[0]
    assert agreement.after_step(1, 0.1).membership == 0
    told[0] = 2
    assert agreement.after_step(2, 0.1).membership == 2
    agreement.close()
