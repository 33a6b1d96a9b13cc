"""The etcd-v3 rendezvous at scale on a real etcd: 64 agents (threads in two processes, each the real handler)
form one round, and etcd's own counters show what it cost (benchmarks/rendezvous.py --parts scale goes to
1,024)."""

from __future__ import annotations

import time
import uuid

import pytest

from elastic_ddp.rendezvous.client import ClientOptions, GrpcEtcdClient
from tests.fixtures.etcd_proc import EtcdServer
from tests.fixtures.rdzv_agents import Fleet, delta, etcd_counters

pytestmark = pytest.mark.integration

AGENTS = 64
CONSTANT = 9
"""Writes per round that do not grow with N: the membership, MASTER_ADDR and MASTER_PORT, the reach verdict,
rank 0's lease for the exit barrier's keys (granted once), a leaver's mark on its key, and a little slack for a
closer's retry."""


def test_64_agents_form_a_round_and_re_form_without_a_leaver_in_etcd_writes_linear_in_their_number(
        etcd_server: EtcdServer) -> None:
    """Forming costs each fresh agent its liveness lease, its join and its reachability report (3N + c); a
    re-formation costs the join and the report (2N + c). torchrun's agent adds one write per node for rank
    assignment, outside the handler."""
    conf = {"last_call_timeout": "10", "join_timeout": "300", "read_timeout": "60"}
    fleet = Fleet("etcd-v3", etcd_server.endpoint, uuid.uuid4().hex[:8], AGENTS, (AGENTS - 1, AGENTS), conf=conf)
    fleet.start()
    try:
        before = etcd_counters(etcd_server.endpoint)
        began = fleet.go()
        fleet.wait_for(lambda f: len(f.in_round(AGENTS, began)) == AGENTS, 180, "the first round")
        formed = etcd_counters(etcd_server.endpoint)
        first = fleet.in_round(AGENTS, began)
        assert sorted(done.rank for done in first.values()) == list(range(AGENTS))
        assert len({done.round for done in first.values()}) == 1
        assert delta(formed, before)["writes"] <= 3 * AGENTS + CONSTANT

        left = fleet.leave(AGENTS - 1)
        fleet.wait_for(lambda f: len(f.in_round(AGENTS - 1, left)) == AGENTS - 1, 120, "the round without the leaver")
        second = fleet.in_round(AGENTS - 1, left)
        assert sorted(done.rank for done in second.values()) == list(range(AGENTS - 1))
        assert str(AGENTS - 1) not in second
        assert delta(etcd_counters(etcd_server.endpoint), formed)["writes"] <= 2 * (AGENTS - 1) + CONSTANT
    finally:
        fleet.stop()


def test_a_round_forms_once_with_every_node_when_the_etcd_leader_dies_mid_formation(etcd_cluster3) -> None:  # type: ignore[no-untyped-def]
    """32 agents on a 3-member etcd cluster; the raft leader is killed as they join. The round still forms,
    with every agent in it once (ranks 0..31 exactly, one round, one completion each): none admitted twice,
    none lost."""
    count = 32
    conf = {"last_call_timeout": "10", "join_timeout": "300", "read_timeout": "60"}
    run_id = uuid.uuid4().hex[:8]
    fleet = Fleet("etcd-v3", etcd_cluster3.endpoint, run_id, count, (count, count), conf=conf)
    client = GrpcEtcdClient(ClientOptions(tuple(etcd_cluster3.endpoint.split(",")), request_timeout=10))
    joins = ("/elastic_ddp/rdzv/%s/round/0000000000/j/" % run_id).encode()
    fleet.start()
    try:
        began = fleet.go()
        deadline = time.monotonic() + 120
        while client.count_prefix(joins) < count // 4:  # mid-formation: a quarter of the nodes joined
            assert time.monotonic() < deadline and not fleet.done, "the formation went by before the leader kill"
            time.sleep(0.01)
        etcd_cluster3.leader().kill()
        fleet.wait_for(lambda f: len(f.in_round(count, began)) == count, 180, "the round")
        ranks = sorted(done.rank for done in fleet.in_round(count, began).values())
        assert ranks == list(range(count))
        assert len({done.round for done in fleet.done}) == 1
        assert len(fleet.done) == count
    finally:
        fleet.stop()
