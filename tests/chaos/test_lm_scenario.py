"""The language-model example through the chaos runner: ``chaos/scenarios/lm-chaos.toml``.

A GPT on stdlib bytes (examples/lm/train.py, 0.9 M parameters, float32) at world size 2 through a
killed worker, a preempted node (world size 1) and a node that joins (world size 2 again); the
verifier compares it with a clean run at world size 2. About two minutes on 2 cores with its
reference run (70 s without), hence ``slow``.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from chaos.report import build_report, markdown, write_report
from chaos.runner import RunOptions, run_scenario
from chaos.scenario import load_scenario
from chaos.verify import run_checks

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_lm_loses_no_sample_and_stays_within_tolerance_through_kill_preempt_and_join(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    scenario = load_scenario("lm-chaos")
    assert scenario.job.script.endswith("examples/lm/train.py")
    options = RunOptions(workdir=tmp_path / "work", cache_dir=tmp_path_factory.mktemp("lm-chaos-cache"),
                         progress=io.StringIO())
    facts = run_scenario(scenario, options)
    checks = run_checks(facts)
    report = build_report(scenario, facts, checks)
    write_report(report, facts, tmp_path / "report")
    text = markdown(report)

    assert not [f"{check.name}: {check.message}" for check in checks if not check.passed], text
    assert [record.kind for record in facts.faults if record.fired] == ["kill-worker", "preempt-node", "add-node"], text
    assert {step.world_size for step in facts.steps} == {1, 2}, text
    assert sum(event.kind == "resumed" and event.rank == 0 for event in facts.events) >= 3, text
    assert facts.steps[-1].step == scenario.job.max_steps, text


def test_the_lm_on_s3_shards_loses_no_sample_through_a_cold_cache_join_slow_and_failed_reads_a_kill_and_a_preemption(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``chaos/scenarios/lm-shards.toml``: about a minute and a half, plus its reference run."""
    scenario = load_scenario("lm-shards")
    options = RunOptions(workdir=tmp_path / "work", cache_dir=tmp_path_factory.mktemp("lm-shards-cache"),
                         progress=io.StringIO())
    facts = run_scenario(scenario, options)
    checks = run_checks(facts)
    text = markdown(build_report(scenario, facts, checks))

    assert not [f"{check.name}: {check.message}" for check in checks if not check.passed or check.skipped], text
    assert [record.kind for record in facts.faults if record.fired] == [
        "add-node", "slow-storage", "storage-outage", "kill-worker", "preempt-node"], text
    assert {step.world_size for step in facts.steps} == {1, 2}, text
    budget = int(scenario.job.args[scenario.job.args.index("--data-shards-cache-bytes") + 1])
    for node in ("node0", "node1"):  # the joining node's cache started empty and filled from S3, within its budget
        pieces = [path.stat().st_size for path in (tmp_path / "work" / "node-cache" / node).glob("*/*")]
        assert pieces and sum(pieces) <= budget, (node, sum(pieces))
