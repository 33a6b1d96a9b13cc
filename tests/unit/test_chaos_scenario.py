"""Scenario files: parsing, defaults, and validation errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chaos.scenario import ScenarioError, Target, in_process, load_scenario, parse_scenario, scenario_names


def document(**overrides: Any) -> dict[str, Any]:
    """A valid scenario document; ``overrides`` replace whole top-level entries."""
    base: dict[str, Any] = {
        "name": "t",
        "job": {"script": "examples/train.py", "args": ["--optim-warmup-steps", "5"], "max_steps": 100,
                "checkpoint_every": 20},
        "cluster": {"nodes": "1:2", "start_nodes": 2},
        "faults": [{"kind": "kill-worker", "at_step": 30, "target": "rank:1"}],
    }
    base.update(overrides)
    return base


def problems_of(data: dict[str, Any]) -> str:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, "t.toml")
    return str(caught.value)


def test_a_valid_document_parses_with_defaults() -> None:
    scenario = parse_scenario(document())
    assert scenario.cluster.rdzv_backend == "etcd-v3" and scenario.cluster.etcd == "embedded"
    assert scenario.cluster.checkpoint == "local" and scenario.cluster.nproc_per_node == 1
    assert scenario.cluster.start_world_size == 2 and scenario.cluster.min_nodes == 1
    assert scenario.job.script.endswith("examples/train.py") and Path(scenario.job.script).is_absolute()
    fault = scenario.faults[0]
    assert fault.target == Target(form="rank", index=1) and fault.trigger.at_step == 30 and fault.label == "0:kill-worker"


def test_every_library_scenario_is_valid() -> None:
    names = scenario_names()
    assert {"demo", "ci-mix", "spot-day", "bad-hour", "flapping-node"} <= set(names)
    for name in names:
        load_scenario(name)


def test_the_library_has_a_scenario_for_every_fault_kind() -> None:
    from chaos.scenario import FAULT_KINDS

    used = {fault.kind for name in scenario_names() for fault in load_scenario(name).faults}
    assert used == set(FAULT_KINDS)


def test_an_unknown_key_is_named_with_its_table() -> None:
    data = document()
    data["cluster"]["node"] = "1:2"
    data["faults"][0]["at_stpe"] = 3
    message = problems_of(data)
    assert "cluster.node: unknown key" in message
    assert "faults[0].at_stpe: unknown key" in message


def test_every_problem_is_reported_at_once() -> None:
    data = document(timeout_s="long")
    data["cluster"]["nodes"] = "3:1"
    data["job"]["max_steps"] = 0
    message = problems_of(data)
    assert "timeout_s: must be a number" in message
    assert "cluster.nodes: '3:1' is not MIN:MAX" in message
    assert "job.max_steps: must be >= 1" in message


def test_a_missing_required_key_is_named() -> None:
    data = document()
    del data["job"]["checkpoint_every"]
    assert "job.checkpoint_every: is required" in problems_of(data)


def test_runner_owned_flags_in_job_args_are_refused() -> None:
    data = document()
    data["job"]["args"] = ["--checkpoint-dir=/tmp/x"]
    assert "job.args: --checkpoint-dir is set by the runner" in problems_of(data)


def test_a_target_the_kind_does_not_take_is_refused() -> None:
    message = problems_of(document(faults=[{"kind": "kill-node", "at_step": 3, "target": "rank:1"},
                                           {"kind": "restart-etcd", "at_s": 3, "duration_s": 2, "target": "node:0"}]))
    assert "faults[0].target: 'rank:1' is not one of node:N, random, newest" in message
    assert "faults[1].target: this fault kind takes no target" in message


def test_a_fault_without_a_trigger_is_refused() -> None:
    assert "faults[0]: give at least one trigger" in problems_of(document(faults=[{"kind": "kill-worker"}]))


def test_c10d_with_an_etcd_is_refused_rather_than_ignored() -> None:
    data = document()
    data["cluster"].update(rdzv_backend="c10d")
    assert "cluster.etcd: rdzv_backend 'c10d' does not use etcd; set etcd = 'none' (not 'embedded')" in problems_of(data)


def test_the_in_process_mode_is_the_etcd_v3_handler_s_in_a_file_and_on_the_command_line() -> None:
    data = document()
    data["cluster"].update(in_process=True)
    assert parse_scenario(data).cluster.in_process
    data["cluster"].update(rdzv_backend="c10d", etcd="none")
    assert "cluster.in_process: the in-process mode is the etcd-v3 handler's" in problems_of(data)
    del data["cluster"]["in_process"]
    with pytest.raises(ScenarioError, match="--in-process: t uses rdzv_backend 'c10d'"):
        in_process(parse_scenario(data))
    assert in_process(parse_scenario(document())).cluster.in_process


def test_etcd_faults_need_an_etcd_rendezvous() -> None:
    data = document(faults=[{"kind": "restart-etcd", "at_step": 5, "duration_s": 3},
                            {"kind": "kill-etcd-leader", "at_step": 5}])
    data["cluster"].update(rdzv_backend="c10d", etcd="none")
    message = problems_of(data)
    assert "faults[0] (restart-etcd): needs cluster.rdzv_backend = 'etcd-v3'" in message
    assert "faults[1] (kill-etcd-leader): needs cluster.etcd = 'cluster'" in message


def test_storage_faults_need_an_s3_checkpoint_and_a_duration() -> None:
    message = problems_of(document(faults=[{"kind": "storage-outage", "at_step": 5}]))
    assert "faults[0] (storage-outage).duration_s: must be > 0" in message
    assert "faults[0] (storage-outage): needs cluster.checkpoint = 's3'" in message


def test_crash_worker_needs_a_rank_and_a_step_alone() -> None:
    message = problems_of(document(faults=[{"kind": "crash-worker", "at_s": 5}]))
    assert "faults[0].target: is required (rank:N)" in message
    message = problems_of(document(faults=[{"kind": "crash-worker", "at_s": 5, "target": "rank:0"}]))
    assert "crash-worker fires inside the job" in message


def test_a_node_target_that_is_never_started_is_refused() -> None:
    message = problems_of(document(faults=[{"kind": "kill-node", "at_step": 5, "target": "node:2"}]))
    assert "faults[0] (kill-node).target: node:2 is never started (2 start, 0 added)" in message


def test_etcd_v3_without_etcd_is_refused() -> None:
    data = document()
    data["cluster"]["etcd"] = "none"
    assert "cluster.etcd: rdzv_backend 'etcd-v3' needs etcd" in problems_of(data)


def test_kill_during_save_waits_for_a_save_by_default() -> None:
    scenario = parse_scenario(document(faults=[{"kind": "kill-during-save", "at_step": 5, "target": "node:1"}]))
    assert scenario.faults[0].trigger.during_save


def test_an_unknown_scenario_name_lists_the_library() -> None:
    with pytest.raises(ScenarioError, match="no scenario 'nope'.*kill-worker"):
        load_scenario("nope")


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("name = \n")
    with pytest.raises(ScenarioError, match="bad.toml"):
        load_scenario(str(path))


def test_prefork_runs_workers_through_the_fork_server_but_cannot_host_sigstop_faults() -> None:
    data = document()
    data["cluster"].update(prefork=True)
    scenario = parse_scenario(data, "t.toml")
    assert scenario.cluster.prefork
    data = document(faults=[{"kind": "hang-worker", "at_step": 5, "target": "rank:1", "duration_s": 3}])
    data["cluster"].update(prefork=True)
    assert "faults[0] (hang-worker): SIGSTOP stops a prefork launcher, not its worker" in problems_of(data)


def test_network_faults_need_hosts_in_namespaces_and_namespaces_need_etcd() -> None:
    data = document(faults=[{"kind": "partition", "at_step": 5, "target": "node:1", "peers": "storage"},
                            {"kind": "packet-loss", "at_step": 5, "percent": 150},
                            {"kind": "heal", "at_step": 9}])
    message = problems_of(data)
    assert "faults[0] (partition): needs cluster.network = 'namespaces'" in message
    assert "faults[0] (partition).peers: 'storage' needs cluster.checkpoint = 's3'" in message
    assert "faults[1] (packet-loss).percent: must be <= 100, got 150" in message
    assert "faults[2] (heal): needs cluster.network = 'namespaces'" in message
    data = document(faults=[])
    data["cluster"].update(network="namespaces", rdzv_backend="c10d", etcd="none")
    assert "cluster.network: 'namespaces' needs rdzv_backend = 'etcd-v3'" in problems_of(data)


def test_a_partition_names_its_peers_and_direction() -> None:
    data = document(faults=[{"kind": "partition", "at_step": 5, "target": "node:1", "peers": "node:0",
                             "direction": "out", "duration_s": 10}])
    data["cluster"].update(network="namespaces")
    fault = parse_scenario(data).faults[0]
    assert (fault.peers, fault.direction, fault.duration_s) == ("node:0", "out", 10.0)
    data["faults"][0].update(peers="switch", direction="sideways")
    message = problems_of(data)
    assert "faults[0].peers: 'switch' is not one of nodes, etcd, storage, all, node:N" in message
    assert "faults[0].direction: 'sideways' is not one of both, out, in" in message


def test_a_dataset_writer_needs_its_flag_the_uri_placeholder_and_an_s3_endpoint() -> None:
    job = {"script": "examples/lm/train.py", "max_steps": 10, "checkpoint_every": 5}
    assert "give both" in problems_of(document(job={**job, "data_write": ["examples/lm/shards.py", "{uri}"]}))
    assert "no argument is '{uri}'" in problems_of(document(job={**job, "data_write": ["examples/lm/shards.py", "/x"],
                                                                   "data_uri_flag": "--data-shards-uri"}))
    assert "is not a file" in problems_of(document(job={**job, "data_write": ["nope.py", "{uri}"],
                                                      "data_uri_flag": "--data-shards-uri"}))
    writer = {**job, "data_write": ["examples/lm/shards.py", "{uri}"], "data_uri_flag": "--data-shards-uri"}
    assert "needs cluster.checkpoint = 's3'" in problems_of(document(job=writer))
    scenario = parse_scenario(document(job=writer, cluster={"nodes": "1:2", "start_nodes": 2, "checkpoint": "s3"}))
    command = scenario.job.data_command("s3://b/data")
    assert command[1].endswith("examples/lm/shards.py") and command[2:] == ["s3://b/data"]
