"""``elastic-ddp doctor`` on three nodes in network namespaces (real torchrun agents, etcd, gloo over veths):
healthy, it exits 0; with 50 ms added to one node's link, it names that node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from chaos.cluster import JobSpec, LocalCluster
from chaos.etcd import start_etcd
from chaos.netns import Fabric, unavailable
from chaos.scenario import ETCD_CONF, REPO

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]

DOCTOR = str(REPO / "elastic_ddp" / "doctor.py")
NODES = 3


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[tuple[Fabric, str]]:
    """The namespaces, with etcd in its own and a host made for each node; etcd's endpoint."""
    with ExitStack() as stack:
        fabric = stack.enter_context(Fabric())
        etcd = start_etcd("embedded", tmp_path / "etcd", stack, fabric=fabric)
        for index in range(NODES):
            fabric.add_host(f"n{index}")
        yield fabric, etcd.endpoint


def run_doctor(fabric: Fabric, endpoint: str, workdir: Path) -> tuple[dict[str, int], dict]:
    """The doctor on every node; each agent's exit status and rank 0's JSON report."""
    report = workdir / "doctor.json"
    spec = JobSpec(script=DOCTOR, args=["--report", str(report), "--rdzv-endpoint", endpoint, "--sizes-kib", "4,256",
                                        "--iters", "5"],
                   nnodes=str(NODES), nproc_per_node=1, rdzv_backend="etcd-v3", rdzv_endpoint=endpoint,
                   rdzv_conf=dict(ETCD_CONF), run_id=f"doctor-{fabric.run}", max_restarts=0, prefork=False)
    with LocalCluster(spec, workdir, fabric) as cluster:
        cluster.start(NODES)
        codes = cluster.wait_all(timeout=180)
    return codes, json.loads(report.read_text())


def test_on_a_healthy_cluster_the_doctor_finds_nothing_and_exits_0(fabric: tuple[Fabric, str], tmp_path: Path) -> None:
    codes, report = run_doctor(*fabric, tmp_path)
    assert report["findings"] == [] and report["exit_status"] == 0, report["findings"]
    assert set(codes.values()) == {0}, codes
    measured = report["measurements"]
    assert sorted(measured["addresses"]) == sorted(host.address for name, host in fabric[0].hosts.items() if name[0] == "n")
    assert measured["endpoints"] == {fabric[1]: measured["endpoints"][fabric[1]]}
    assert measured["endpoints"][fabric[1]].startswith("OK")
    assert len(measured["pairs"]) == 3 and all(row["busbw_gbps"] > 0 for row in measured["allreduce"])


@pytest.mark.slow  # CI time; the doctor's slow-node analysis has unit tests
def test_with_50_ms_on_one_nodes_link_the_doctor_names_that_node(fabric: tuple[Fabric, str], tmp_path: Path) -> None:
    net, endpoint = fabric
    net.latency("n2", ["n0", "n1"], delay_ms=50)
    codes, report = run_doctor(net, endpoint, tmp_path)
    slow = [finding for finding in report["findings"] if finding["kind"] == "SLOW NODE"]
    assert len(slow) == 1 and f"({net.hosts['n2'].address})" in slow[0]["message"], report["findings"]
    assert not [finding for finding in report["findings"] if finding["kind"] == "SLOW LINK"], report["findings"]
    assert report["exit_status"] == 1 and 1 in codes.values(), codes
