"""Multi-endpoint fail-over of the etcd-v3 backend and store on a real 3-member etcd cluster."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.rendezvous import EtcdStore, create_rdzv_handler, create_store
from tests.fixtures.etcd_proc import EtcdCluster, EtcdServer

pytestmark = pytest.mark.integration


def leader_first(cluster: EtcdCluster) -> tuple[EtcdServer, str]:
    """The leader, and an endpoint list that makes clients talk to it first."""
    leader = cluster.leader()
    others = [member.endpoint for member in cluster.members if member is not leader]
    return leader, ",".join([leader.endpoint, *others])


def params(endpoint: str, run_id: str, nodes: int = 1) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, nodes, nodes, local_addr="127.0.0.1", read_timeout="15",
                                join_timeout="30", last_call_timeout="1")


def store_of(endpoint: str, run_id: str) -> EtcdStore:
    return create_store(params(endpoint, run_id))


def test_killing_the_leader_does_not_fail_the_next_round(etcd_cluster3: EtcdCluster) -> None:
    leader, endpoint = leader_first(etcd_cluster3)
    run_id = uuid.uuid4().hex[:8]
    handlers = [create_rdzv_handler(params(endpoint, run_id, 2)) for _ in range(2)]

    def both() -> list[tuple[int, int]]:
        results: list[tuple[int, int]] = []
        threads = [threading.Thread(target=lambda h=h: results.append(
            (h.next_rendezvous().world_size, h._state_holder.state.round))) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return results

    assert both() == [(2, 0), (2, 0)]
    leader.kill()
    assert both() == [(2, 1), (2, 1)]
    assert etcd_cluster3.leader() is not leader
    for handler in handlers:
        handler.shutdown()


def test_store_keeps_working_after_the_leader_dies(etcd_cluster3: EtcdCluster) -> None:
    leader, endpoint = leader_first(etcd_cluster3)
    store = store_of(endpoint, uuid.uuid4().hex[:8])
    round_store = dist.PrefixStore("torch.rendezvous.r.0", store)
    round_store.set("MASTER_PORT", "29500")

    leader.kill()

    assert round_store.get("MASTER_PORT") == b"29500"
    assert round_store.add("agents", 1) == 1
    round_store.wait(["MASTER_PORT"], timedelta(seconds=5))


def test_a_dead_first_endpoint_is_skipped_from_the_start(etcd_cluster3: EtcdCluster) -> None:
    first = etcd_cluster3.members[0]
    first.kill()
    store = store_of(etcd_cluster3.endpoint, uuid.uuid4().hex[:8])
    assert not store.check(["k"])
    store.set("k", b"created")
    assert store.get("k") == b"created"
