"""The etcd-v3 rendezvous's reachability check (elastic_ddp.rendezvous.reach): the verdict, the wire format,
real probes on 127.0.0.1, and one round checked by three agents over a real TCPStore."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_ddp.rendezvous import reach


def nobody_cut(world_size: int) -> dict[int, frozenset[int] | None]:
    return {rank: frozenset() for rank in range(world_size)}


def test_when_nobody_reports_a_cut_nobody_is_left_out() -> None:
    assert reach.exclusions(3, nobody_cut(3)) == frozenset()


def test_a_node_nobody_reaches_is_left_out_and_only_it() -> None:
    reports = nobody_cut(3)
    reports[0], reports[1] = frozenset({2}), frozenset({2})  # node 2 believes it reaches all: a one-way cut
    assert reach.exclusions(3, reports) == frozenset({2})


def test_a_cut_between_two_nodes_leaves_out_the_higher_rank() -> None:
    assert reach.exclusions(2, {0: frozenset({1}), 1: frozenset({0})}) == frozenset({1})
    assert reach.exclusions(2, {0: frozenset(), 1: frozenset({0})}) == frozenset({1})  # one direction is enough


def test_the_node_with_most_cut_links_goes_first_and_the_others_stay() -> None:
    """Rank 0 cannot reach 2 and 3; 2 and 3 cannot reach each other: leaving out 2 (two cut links, the
    higher of the tied ranks) and then 3 heals every pair; rank 1 always stays."""
    reports = {0: frozenset({2, 3}), 1: frozenset(), 2: frozenset({3}), 3: frozenset()}
    assert reach.exclusions(4, reports) == frozenset({2, 3})


def test_a_node_that_published_no_report_is_left_out() -> None:
    reports = nobody_cut(3)
    reports[1] = None
    assert reach.exclusions(3, reports) == frozenset({1})
    del reports[1]
    assert reach.exclusions(3, reports) == frozenset({1})


def test_each_node_probes_a_bounded_number_of_ring_neighbours_and_is_probed_as_often() -> None:
    for world_size in (2, 3, 4, 64, 1024):
        targets = {rank: reach.ring_targets(rank, world_size) for rank in range(world_size)}
        assert all(len(ranks) == min(reach.PROBES, world_size - 1) and rank not in ranks for rank, ranks in targets.items())
        probed_by = [sum(other in ranks for ranks in targets.values()) for other in range(world_size)]
        assert set(probed_by) == {min(reach.PROBES, world_size - 1)}


def test_a_node_cut_off_from_everyone_in_a_large_round_is_the_only_one_left_out() -> None:
    """Its predecessors on the ring report it, it reports its successors: twice the cut links of anyone else."""
    world_size, cut_off = 256, 100
    reports: dict[int, frozenset[int] | None] = {}
    for rank in range(world_size):
        targets = reach.ring_targets(rank, world_size)
        reports[rank] = frozenset(targets) if rank == cut_off else frozenset({cut_off}) & frozenset(targets)
    assert reach.exclusions(world_size, reports) == frozenset({cut_off})


def test_successors_wrap_around_the_ring_and_skip_the_node_itself() -> None:
    assert reach.successors("c", ["a", "b", "c", "d"], 2) == ["d", "a"]
    assert reach.successors("bb", ["a", "b", "c"], 2) == ["c", "a"]
    assert reach.successors("a", ["a"], 3) == []


def test_rank_lists_round_trip_and_malformed_ones_are_refused() -> None:
    for ranks in (set(), {0}, {3, 1, 2}):
        assert reach.decode_ranks(reach.encode_ranks(ranks).encode(), 4) == frozenset(ranks)
    for bad in (b"", b"1,,2", b"1;2", b"-1", b"4", b"\xff", b"1,2,x", b"9999999"):
        assert reach.decode_ranks(bad, 4) is None, bad


def test_addresses_are_parsed_and_anything_else_is_refused() -> None:
    assert reach.parse_address(b"10.213.0.3:4711") == ("10.213.0.3", 4711)
    assert reach.parse_address(b"::1:80") == ("::1", 80)
    for bad in (b"", b"host", b"host:", b":80", b"host:0", b"host:70000", b"host:8x", b"a b:80", b"\xff:80"):
        assert reach.parse_address(bad) is None, bad


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_probe_reaches_a_listener_and_not_a_closed_port() -> None:
    listener = reach.ProbeListener("127.0.0.1")
    try:
        addresses = {0: ("127.0.0.1", listener.port), 1: ("127.0.0.1", closed_port())}
        assert reach.probe(addresses, timeout=2.0) == frozenset({0})
        assert reach.probe({}, timeout=2.0) == frozenset()
    finally:
        listener.close()
    assert not reach.reaches(("127.0.0.1", listener.port), timeout=2.0)


def test_a_running_agent_answers_and_a_frozen_one_is_reached_but_does_not_answer() -> None:
    listener = reach.ProbeListener("127.0.0.1")
    frozen = socket.create_server(("127.0.0.1", 0))  # listens, never accepts: the kernel completes connections
    try:
        assert reach.answers(("127.0.0.1", listener.port), timeout=2.0)
        assert reach.reaches(("127.0.0.1", frozen.getsockname()[1]), timeout=2.0)
        assert not reach.answers(("127.0.0.1", frozen.getsockname()[1]), timeout=0.5)
        assert not reach.answers(("127.0.0.1", closed_port()), timeout=2.0)
    finally:
        listener.close()
        frozen.close()


def check_three(unreachable: int | None) -> dict[int, frozenset[int]]:
    """Three agents check one round on a real TCPStore; ``unreachable``'s listener is closed before it publishes."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    listeners = [reach.ProbeListener("127.0.0.1") for _ in range(3)]
    addresses = [listener.address for listener in listeners]
    if unreachable is not None:
        listeners[unreachable].close()
    verdicts: dict[int, frozenset[int]] = {}
    errors: list[BaseException] = []

    def agent(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
            verdicts[rank] = reach.check_round(store, rank, 3, addresses, timeout=1.0)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for listener in listeners:
        listener.close()
    assert not errors, errors
    return verdicts


def test_three_agents_that_reach_each_other_keep_the_round() -> None:
    assert check_three(unreachable=None) == {0: frozenset(), 1: frozenset(), 2: frozenset()}


def test_three_agents_agree_to_leave_out_the_one_they_cannot_reach() -> None:
    """Rank 1 reaches the others, but they cannot reach it: all three agree, rank 1 included."""
    assert check_three(unreachable=1) == {0: frozenset({1}), 1: frozenset({1}), 2: frozenset({1})}


def test_the_first_verdict_stands_for_every_agent() -> None:
    """An agent that saw other reports than the proposer (a late report) still acts on the stored verdict:
    here both ranks reach each other, but the verdict already stored leaves out rank 0."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    listener = reach.ProbeListener("127.0.0.1")
    try:
        server.set(reach.VERDICT_KEY, "0")
        server.set(reach.REPORT_KEY % 0, "-")
        assert reach.check_round(server, 1, 2, [listener.address, listener.address], timeout=0.5) == frozenset({0})
    finally:
        listener.close()


def test_without_a_verdict_from_the_judge_an_agent_proposes_one_from_the_reports() -> None:
    """Rank 0 (the judge) died before it wrote a verdict: rank 1 waits for it until the check's deadline, then
    proposes one itself from the reports it finds (rank 0 published none: it is left out)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    listener = reach.ProbeListener("127.0.0.1")
    try:
        assert reach.check_round(server, 1, 2, [listener.address, listener.address], timeout=0.3) == frozenset({0})
        assert server.get(reach.VERDICT_KEY) == b"0"
    finally:
        listener.close()


def test_a_malformed_verdict_in_the_store_is_an_error_naming_the_key() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    listener = reach.ProbeListener("127.0.0.1")
    try:
        server.set(reach.VERDICT_KEY, "zero")
        with pytest.raises(ValueError, match=reach.VERDICT_KEY):
            reach.check_round(server, 0, 1, [listener.address], timeout=0.5)
    finally:
        listener.close()


def test_a_listener_advertises_the_node_name_it_was_given_and_listens_where_told() -> None:
    """torchrun without --local-addr names a node by its FQDN; the listener then advertises that name (the other
    nodes resolve it) and binds elsewhere (in the handler: every interface; here 127.0.0.1)."""
    listener = reach.ProbeListener("node7.example", bind="127.0.0.1")
    try:
        assert listener.address == f"node7.example:{listener.port}"
        assert reach.reaches(("127.0.0.1", listener.port), timeout=2.0)
    finally:
        listener.close()
