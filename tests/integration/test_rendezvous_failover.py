"""Multi-endpoint fail-over of the etcd-v3 backend and store on a real 3-member etcd cluster."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.rendezvous import EtcdRendezvousBackend, EtcdStore, create_backend
from tests.fixtures.etcd_proc import EtcdCluster, EtcdServer

pytestmark = pytest.mark.integration


def leader_first(cluster: EtcdCluster) -> tuple[EtcdServer, str]:
    """The leader, and an endpoint list that makes clients talk to it first."""
    leader = cluster.leader()
    others = [member.endpoint for member in cluster.members if member is not leader]
    return leader, ",".join([leader.endpoint, *others])


def backend_and_store(endpoint: str, run_id: str) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, read_timeout="15", join_timeout="30")
    return create_backend(params)


def test_killing_the_leader_does_not_fail_the_next_get_and_set(etcd_cluster3: EtcdCluster) -> None:
    leader, endpoint = leader_first(etcd_cluster3)
    backend, _ = backend_and_store(endpoint, uuid.uuid4().hex[:8])
    _, token, _ = backend.set_state(b"before")

    leader.kill()

    assert backend.get_state() == (b"before", token)
    state, new_token, written = backend.set_state(b"after", token)
    assert written and new_token > token
    assert etcd_cluster3.leader() is not leader


def test_store_keeps_working_after_the_leader_dies(etcd_cluster3: EtcdCluster) -> None:
    leader, endpoint = leader_first(etcd_cluster3)
    _, store = backend_and_store(endpoint, uuid.uuid4().hex[:8])
    round_store = dist.PrefixStore("torch.rendezvous.r.0", store)
    round_store.set("MASTER_PORT", "29500")

    leader.kill()

    assert round_store.get("MASTER_PORT") == b"29500"
    assert round_store.add("agents", 1) == 1
    round_store.wait(["MASTER_PORT"], timedelta(seconds=5))


def test_a_dead_first_endpoint_is_skipped_from_the_start(etcd_cluster3: EtcdCluster) -> None:
    first = etcd_cluster3.members[0]
    first.kill()
    backend, _ = backend_and_store(etcd_cluster3.endpoint, uuid.uuid4().hex[:8])
    assert backend.get_state() is None
    assert backend.set_state(b"created")[2]
