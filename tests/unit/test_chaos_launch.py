"""``python -m chaos launch`` argument checks (no processes)."""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from chaos.cluster import JobSpec
from chaos.launch import _hold, add_arguments, launch, node_range
from chaos.scenario import ScenarioError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_node_ranges_are_min_max_or_a_single_count() -> None:
    assert node_range("2:3") == (2, 3)
    assert node_range("2") == (2, 2)
    for bad in ("3:2", "0:1", "a:b", "1:2:3"):
        with pytest.raises(ScenarioError, match=f"--nodes '{bad}'"):
            node_range(bad)


def test_the_script_follows_a_double_dash() -> None:
    args = parse("--nodes", "1:2", "--", "examples/train.py", "--max-steps", "5")
    assert args.command == ["--", "examples/train.py", "--max-steps", "5"]


def test_launch_without_a_script_says_how_to_name_one() -> None:
    with pytest.raises(ScenarioError, match="name the training script after --"):
        launch(parse("--nodes", "1:2"))


def test_a_start_count_outside_the_node_range_is_refused() -> None:
    with pytest.raises(ScenarioError, match="--nodes-start 4 is outside --nodes 1:2"):
        launch(parse("--nodes", "1:2", "--nodes-start", "4", "--", "examples/train.py"))


def test_prefork_is_the_default_and_puts_the_launcher_module_before_the_script() -> None:
    prefork = JobSpec(script="train.py", args=["--max-steps", "5"]).torchrun_command()
    plain = JobSpec(script="train.py", args=["--max-steps", "5"], prefork=False).torchrun_command()
    assert plain[-3:] == ["train.py", "--max-steps", "5"] and "elastic_ddp.prefork" not in plain
    assert prefork[-5:] == ["-m", "elastic_ddp.prefork", "train.py", "--max-steps", "5"]
    assert prefork[:-3] == plain[:-3] + ["-m", "elastic_ddp.prefork"]
    assert parse("--", "train.py").prefork and not parse("--no-prefork", "--", "train.py").prefork


def test_scenarios_start_workers_warm_unless_a_hang_fault_needs_plain_processes() -> None:
    from chaos.scenario import load_scenario, scenario_names

    for name in scenario_names():
        scenario = load_scenario(name)
        hangs = any(fault.kind in ("hang-worker", "hang-node") for fault in scenario.faults)
        assert scenario.cluster.prefork == (not hangs), name


@pytest.mark.parametrize(("flags", "named"), [
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--etcd", "notaport"], "'notaport' is not HOST:PORT"),
    (["--etcd", "127.0.0.1:2379,h2:x"], "'h2:x' is not HOST:PORT"),
])
def test_bad_launch_values_are_refused_before_anything_starts(flags: list[str], named: str) -> None:
    with pytest.raises(ScenarioError, match=named):
        launch(parse("--nodes", "1:2", *flags, "--", "examples/train.py"))


def test_a_work_directory_serves_one_launch_at_a_time(tmp_path: Path) -> None:
    with ExitStack() as first:
        _hold(tmp_path, first)
        with ExitStack() as second, pytest.raises(ScenarioError, match=f"in use by another launch \\(pid {os.getpid()}\\)"):
            _hold(tmp_path, second)
    with ExitStack() as third:  # released with the first launch
        _hold(tmp_path, third)


def test_the_in_process_mode_is_the_etcd_v3_rendezvous_s() -> None:
    assert parse("--in-process", "--", "examples/train.py").in_process
    with pytest.raises(ScenarioError, match="--in-process: the in-process mode is the etcd-v3 rendezvous's, not c10d's"):
        launch(parse("--in-process", "--rdzv-backend", "c10d", "--", "examples/train.py"))
