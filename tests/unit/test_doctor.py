"""The doctor's verdicts: pure functions of the measurements, no processes."""

from __future__ import annotations

import pytest

from elastic_ddp.doctor import (
    EXIT_BROKEN,
    EXIT_HEALTHY,
    EXIT_SLOW,
    OK,
    TIMEOUT,
    DoctorConfig,
    Measurements,
    bandwidth_row,
    diagnose,
    exit_status,
    node_rtts,
    render,
)

CONFIG = DoctorConfig()


def three_nodes(rtt: dict[tuple[int, int], float], compute: tuple[float, ...] = (10.0, 10.0, 10.0)) -> Measurements:
    """One rank per node; ``rtt`` by node pair (symmetric), 0.1 ms for pairs not given."""
    matrix = [[0.0 if i == j else rtt.get((min(i, j), max(i, j)), 0.1) for j in range(3)] for i in range(3)]
    return Measurements(world_size=3, nodes=[0, 1, 2], addresses=["10.0.0.1", "10.0.0.2", "10.0.0.3"],
                        cells=[[OK] * 3 for _ in range(3)], rtt_ms=matrix, compute_ms=list(compute))


def test_a_healthy_cluster_has_no_finding_and_exits_0() -> None:
    findings = diagnose(three_nodes({}), CONFIG)
    assert findings == [] and exit_status(findings) == EXIT_HEALTHY
    assert "healthy" in render(three_nodes({}), findings)


def test_a_node_whose_every_link_is_slow_is_named_once_by_its_address() -> None:
    findings = diagnose(three_nodes({(0, 2): 50.2, (1, 2): 50.4}), CONFIG)
    assert [finding.kind for finding in findings] == ["SLOW NODE"]
    assert findings[0].message.startswith("node2 (10.0.0.3): every link slow") and "50.4 ms" in findings[0].message
    assert exit_status(findings) == EXIT_SLOW


def test_one_slow_link_between_healthy_nodes_is_named_as_a_link() -> None:
    findings = diagnose(three_nodes({(0, 1): 30.0}), CONFIG)
    assert [(finding.kind, finding.message.split(" latency")[0]) for finding in findings] == [("SLOW LINK", "node0 \u2194 node1")]


def test_a_link_just_above_the_best_is_not_slow() -> None:
    assert diagnose(three_nodes({(0, 1): 0.4}), CONFIG) == []  # 4x the best, but not 10 ms more


def test_an_unreachable_rank_is_broken_and_comes_first() -> None:
    m = three_nodes({(0, 2): 50.0, (1, 2): 50.0})
    m.cells[0][2] = TIMEOUT
    findings = diagnose(m, CONFIG)
    assert findings[0].kind == "UNREACHABLE" and "rank 0 on node 0 -> rank 2 on node 2 (10.0.0.3): TIMEOUT" in findings[0].message
    assert exit_status(findings) == EXIT_BROKEN


def test_a_rank_with_slow_compute_is_a_straggler() -> None:
    findings = diagnose(three_nodes({}, compute=(10.0, 41.0, 10.0)), CONFIG)
    assert [finding.message for finding in findings] == [
        "rank 1 on node 1: compute 4.1\u00d7 the median (41.0 ms vs 10.0 ms)"]


def test_node_rtts_take_the_median_over_rank_pairs_of_both_directions() -> None:
    m = Measurements(world_size=4, nodes=[0, 0, 1, 1], addresses=["a"] * 4, cells=[[OK] * 4 for _ in range(4)],
                     rtt_ms=[[0, 0, 1, 3], [0, 0, 2, 4], [1, 2, 0, 0], [3, 4, 0, 0]])
    assert node_rtts(m) == {(0, 1): 2.5}


def test_bus_bandwidth_is_the_algorithm_bandwidth_times_2_n_minus_1_over_n() -> None:
    row = bandwidth_row(4_000_000, 0.001, 4)
    assert row["algbw_gbps"] == pytest.approx(4.0) and row["busbw_gbps"] == pytest.approx(6.0)
    assert bandwidth_row(4096, 0.001, 1)["busbw_gbps"] == 0.0


def test_every_bad_setting_is_reported_at_once() -> None:
    problems = DoctorConfig(sizes_kib=(), iters=0, slow_link_factor=1.0, rdzv_endpoints=("etcd",)).problems()
    assert problems == ["--sizes-kib: give sizes >= 1, got []", "--iters: must be >= 1, got 0",
                        "--slow-link-factor: must be > 1, got 1.0", "--rdzv-endpoint: 'etcd' is not HOST:PORT"]
