"""The chaos verifier over synthetic facts: events and agent lines, each check, recovery metrics and goodput."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from chaos.faults import Commit, FaultRecord
from chaos.report import NO_MATPLOTLIB, build_report, markdown, write_report
from chaos.scenario import ScenarioError, parse_scenario
from chaos.verify import (
    NOT_REACHED,
    CheckpointFacts,
    JobEvent,
    NodeOutcome,
    ReferenceFacts,
    RunFacts,
    StepRecord,
    WeightComparison,
    check_data,
    check_events,
    check_faults_fired,
    check_final_checkpoint,
    check_kept_processes,
    check_loads,
    check_survivors,
    check_weights,
    fault_metrics,
    goodput,
    job_events,
    noticed,
    parse_agent_log,
    parse_metrics,
    run_checks,
)
from elastic_ddp.events import parse_events

T0 = 1_800_000_000.0
ROOT = "/w/ckpt"


def digest(step: int, salt: str = "0") -> str:
    """A 64-character stand-in for a sha256 digest; another ``salt`` gives another digest of the same step."""
    return f"{salt}{step:063d}"


def reference(world_size: int = 2) -> ReferenceFacts:
    final = CheckpointFacts(f"{ROOT}/step-00000100", 100, world_size, "m" * 64, digest(100))
    return ReferenceFacts(world_size, "/ref/ckpt", final, {step: digest(step) for step in range(20, 101, 20)}, 10.0)


def steps(first: int, last: int, start: float, world: int = 2, dt: float = 0.1) -> list[StepRecord]:
    return [StepRecord(step, start + dt * (step - first + 1), world, dt) for step in range(first, last + 1)]


def event(when: float, kind: str, **fields: object) -> JobEvent:
    return JobEvent(T0 + when, fields.pop("node", "node0"), kind, **fields)  # type: ignore[arg-type]


def clean_facts() -> RunFacts:
    """One interruption: rank 1 killed at t=5.0 (step 45); resumed from step 40 at t=9."""
    final = CheckpointFacts(f"{ROOT}/step-00000100", 100, 2, "m" * 64, digest(100))
    commits = [Commit(step, digest(step), 2, T0 + step * 0.1 + 0.05) for step in (20, 40, 60, 80, 100)]
    events = [
        event(-1.0, "process_group_formed", rank=0, world_size=2),
        event(0.0, "started_fresh", rank=0, world_size=2, reason="no-checkpoint"),
        event(4.05, "committed", rank=0, step=40, path=f"{ROOT}/step-00000040"),
        event(5.3, "agent-failure", node="node1"),
        event(5.4, "exit", rank=0, reason="peer-lost"),
        event(6.0, "agent-rendezvous"),
        event(8.0, "process_group_formed", rank=0, world_size=2),
        event(9.0, "resumed", rank=0, step=40, path=f"{ROOT}/step-00000040", world_size=2),
        event(9.0, "resumed", rank=1, step=40, path=f"{ROOT}/step-00000040", world_size=2, node="node1"),
        event(20.0, "done", rank=0, step=100),
    ]
    records = [*steps(1, 45, T0), *steps(41, 100, T0 + 9.0)]
    fault = FaultRecord(0, "kill-worker", "0:kill-worker", fired_at=T0 + 5.0, target="rank 1 (pid 7)", detail="SIGKILL")
    return RunFacts("t", 100, False, T0 - 2.0, T0 + 15.0, False, [NodeOutcome("node0", 0), NodeOutcome("node1", 0)], [fault],
                    records, events, commits, final, "", reference())


# -- parsing ----------------------------------------------------------------------------


def record(when: float, kind: str, rank: int = 0, agent_pid: int = 11, **fields: object) -> str:
    """One line of an events file, as elastic_ddp.events writes it."""
    return json.dumps({"time": T0 + when, "event": kind, "run_id": "t", "rank": rank, "host": "h", "pid": 100 + rank,
                       "agent_pid": agent_pid, **fields})


def test_event_records_become_job_events_on_the_node_of_their_agent() -> None:
    lines = [
        record(0.0, "process_group_formed", world_size=4, backend="gloo", store="127.0.0.1:1", agent_store=False,
               restart_count=0),
        record(1.0, "resumed", rank=2, agent_pid=12, step=60, path="s3://b/p/step-00000060", saved_world_size=4,
               world_size=2, rank_state_reused=False, source="storage"),
        record(2.0, "exit", rank=1, agent_pid=99, reason="peer-lost", status=75, detail="a peer left"),
    ]
    records, problems = parse_events(lines)
    formed, resumed, exit_ = job_events(records, {11: "node0", 12: "node3"})
    assert not problems
    assert (formed.node, formed.kind, formed.world_size, formed.time) == ("node0", "process_group_formed", 4, T0)
    assert (resumed.node, resumed.rank, resumed.step, resumed.path, resumed.world_size) == (
        "node3", 2, 60, "s3://b/p/step-00000060", 2)
    assert (exit_.node, exit_.reason, exit_.text) == ("agent 99", "peer-lost", "a peer left")


def test_the_torchrun_agents_lines_become_events() -> None:
    log = "\n".join([
        "E1130 03:19:35.250000 11719 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
        "local_rank: 0 (pid: 15406) of binary: python",
        "I1130 03:19:36.500000 11719 torch/distributed/elastic/agent/server/api.py:553] [default] Rendezvous complete "
        "for workers. Result:",
        "2026-11-30 03:19:34,000 ERROR [run/1 80] elastic_ddp.resilience.exits: exit: reason=peer-lost status=75",
        "[rank0]: RuntimeError: Connection reset by peer",
    ])
    events = parse_agent_log(log, "node3", 2026)
    assert [e.kind for e in events] == ["agent-failure", "agent-rendezvous"]  # the runtime's own lines are not read
    base = time.mktime(time.strptime("2026-11-30 03:19:35", "%Y-%m-%d %H:%M:%S"))
    assert events[0].time == pytest.approx(base + 0.25) and events[0].node == "node3"


def test_metrics_lines_without_a_loss_or_half_written_are_skipped() -> None:
    lines = ['{"step": 1, "loss": 2.0, "world_size": 2, "time": 5.0, "step_time_s": 0.1}',
             '{"step": 1, "eval_accuracy": 0.5, "time": 5.1}', '[1, "loss"]', '{"loss": 1.0}', '{"step": 2, "lo']
    assert parse_metrics(lines) == [StepRecord(1, 5.0, 2, 0.1)]


# -- checks ---------------------------------------------------------------------------------


def test_a_clean_recovery_passes_every_check() -> None:
    checks = run_checks(clean_facts())
    assert [c.name for c in checks] == ["events-file", "job-finished", "faults-fired", "survivors-exit-0",
                                        "final-checkpoint", "data-digest", "model-weights", "no-partial-load"]
    assert all(c.passed for c in checks), checks


def test_a_run_whose_events_lack_the_resume_after_a_kill_fails() -> None:
    """The run redid steps 41-45 after the kill, so an attempt resumed; without its event the check fails."""
    facts = clean_facts()
    assert check_loads(facts.events, facts.commits, facts.faults, facts.steps).passed  # with the resume: passes
    events = [e for e in facts.events if e.kind != "resumed"]
    check = check_loads(events, facts.commits, facts.faults, facts.steps)
    assert not check.passed
    assert "step 41 at world size 2 came after step 45" in check.message and "no resume" in check.message
    failed = {c.name for c in run_checks(replace(facts, events=events)) if not c.passed}
    assert failed == {"no-partial-load"}


def test_an_attempt_that_formed_and_trained_without_a_resume_event_fails() -> None:
    """Resumed exactly where it stopped (no step redone, same world size): the process group it formed shows
    the new attempt."""
    facts = clean_facts()
    steps = [*facts.steps[:45], *[replace(s, step=s.step + 5) for s in facts.steps[45:] if s.step + 5 <= 100]]
    events = [e for e in facts.events if e.kind != "resumed"]
    check = check_loads(events, facts.commits, facts.faults, steps)
    assert not check.passed and "formed its process group" in check.message and "step 46" in check.message


def test_a_fault_after_which_workers_failed_needs_a_resume_even_without_steps() -> None:
    facts = clean_facts()
    events = [e for e in facts.events if e.kind not in ("resumed", "process_group_formed") or e.time < T0]
    steps = [s for s in facts.steps if s.time < T0 + 5.0]
    check = check_loads(events, facts.commits, facts.faults, steps)
    assert not check.passed
    assert "fault 0:kill-worker was followed by a new attempt (node0 rank 0: exit peer-lost)" in check.message


def test_a_fault_that_landed_as_the_job_finished_needs_no_resume() -> None:
    facts = clean_facts()
    late = FaultRecord(1, "preempt-node", "1:preempt-node", fired_at=T0 + 19.9, target="node1")
    events = [*facts.events, event(20.1, "exit", rank=1, reason="done", node="node1")]
    assert check_loads(events, facts.commits, [*facts.faults, late], facts.steps).passed


def test_a_fresh_start_after_a_commit_lost_the_work_and_fails() -> None:
    facts = clean_facts()
    events = [e if e.kind != "resumed" else replace(e, kind="started_fresh", step=None, reason="no-checkpoint")
              for e in facts.events]
    check = check_loads(events, facts.commits, facts.faults, facts.steps)
    assert not check.passed and "rank 0 started fresh" in check.message and "had been committed before" in check.message


def test_steps_without_any_event_fail_the_events_check_and_the_load_check() -> None:
    facts = clean_facts()
    assert not check_events([], [], facts.steps).passed
    check = check_loads([], facts.commits, facts.faults, facts.steps)
    assert not check.passed and "do not say how the job began" in check.message


def test_invalid_event_lines_fail_the_events_check_naming_them() -> None:
    facts = clean_facts()
    _, problems = parse_events(["{}", "garbage", record(1.0, "exit", reason="done", status=0)])
    check = check_events(problems, facts.events, facts.steps)
    assert not check.passed and check.message.startswith("line 1: unknown event None; line 2: not JSON")
    assert check_events([], facts.events, facts.steps).message == "8 events, every line valid"


def test_a_diverging_data_digest_names_the_first_bad_step() -> None:
    facts = clean_facts()
    commits = [c if c.step < 60 else replace(c, data_digest=digest(c.step, "x")) for c in facts.commits]
    check = check_data(commits, facts.reference, facts.final)
    assert not check.passed
    assert "the checkpoint of step 60 consumed other samples than the reference run" in check.message
    assert "last matching checkpoint: step 40" in check.message


def test_a_final_digest_that_differs_fails_even_when_no_step_is_comparable() -> None:
    facts = clean_facts()
    final = replace(facts.final, data_digest=digest(1, "y"))
    check = check_data([], facts.reference, final)
    assert not check.passed and "the final checkpoint (step 100)" in check.message


def test_weights_must_be_bitwise_equal_when_the_world_size_never_changed() -> None:
    facts = clean_facts()
    check = check_weights(facts.steps, replace(facts.final, model_digest="z" * 64), facts.reference, None)
    assert not check.passed and "step 100" in check.message and "never changed (2)" in check.message


def test_weights_after_a_world_size_change_are_compared_within_the_tolerance() -> None:
    facts = clean_facts()
    mixed = [*facts.steps[:10], *[replace(s, world_size=1) for s in facts.steps[10:]]]
    final = replace(facts.final, model_digest="z" * 64)
    assert check_weights(mixed, final, facts.reference, WeightComparison(False, True, 3e-8, "fc.weight")).passed
    failed = check_weights(mixed, final, facts.reference, WeightComparison(False, False, 0.02, "fc.weight"))
    assert not failed.passed and "step 100: fc.weight differs by 0.02" in failed.message


def test_a_survivor_that_failed_is_named_and_removed_nodes_are_not_judged() -> None:
    nodes = [NodeOutcome("node0", 1), NodeOutcome("node1", -9, removed_by="1:kill-node"), NodeOutcome("node2", None)]
    check = check_survivors(nodes)
    assert not check.passed and check.message == "node0 exited 1; node2 still ran at the end"
    assert check_survivors([NodeOutcome("node0", 0), NodeOutcome("node1", -9, "x")]).passed


def test_a_node_that_arrived_after_the_job_finished_is_reported_not_failed() -> None:
    late = NodeOutcome("node8", 1, arrived_late=True)
    check = check_survivors([NodeOutcome("node4", 0), late])
    assert check.passed and check.message == "node4 exited 0; node8 arrived after the job had finished (rendezvous closed)"
    assert not check_survivors([NodeOutcome("node4", 1), late]).passed


def test_a_final_checkpoint_short_of_max_steps_fails_naming_its_step() -> None:
    facts = clean_facts()
    check = check_final_checkpoint(replace(facts.final, step=80), "", 100)
    assert not check.passed and "step 80, not 100" in check.message
    assert not check_final_checkpoint(None, "step-00000100/x: sha256 mismatch", 100).passed


def test_a_fault_that_never_fired_fails_the_run() -> None:
    check = check_faults_fired([FaultRecord(0, "add-node", "0:add-node", skipped=NOT_REACHED)])
    assert not check.passed and "0:add-node (the job ended before its trigger)" in check.message


def test_an_open_schedule_may_outlast_the_job_but_not_skip_a_fault() -> None:
    fired = FaultRecord(0, "add-node", "0:add-node", fired_at=T0)
    left = FaultRecord(1, "add-node", "1:add-node", skipped=NOT_REACHED)
    check = check_faults_fired([fired, left], open_schedule=True)
    assert check.passed and "1 fault(s) fired; the job finished before the other 1" in check.message
    skipped = FaultRecord(2, "kill-node", "2:kill-node", skipped="node1 is not running")
    assert not check_faults_fired([fired, skipped], open_schedule=True).passed


def test_a_resume_from_a_corrupted_checkpoint_is_a_partial_load() -> None:
    facts = clean_facts()
    corrupt = FaultRecord(1, "corrupt-checkpoint", "1:corrupt", fired_at=T0 + 6.0,
                          target=f"{ROOT}/step-00000040/replicated-x.eddp")
    check = check_loads(facts.events, facts.commits, [*facts.faults, corrupt], facts.steps)
    assert not check.passed and "resume at step 40" in check.message and "corrupted" in check.message


def test_a_resume_from_a_step_never_committed_is_a_partial_load() -> None:
    facts = clean_facts()
    events = [e for e in facts.events if e.kind != "committed"]
    check = check_loads(events, [c for c in facts.commits if c.step != 40], facts.faults, facts.steps)
    assert not check.passed and "step-00000040 was never seen committed before it was loaded" in check.message


def test_a_resume_after_an_uncommit_without_a_new_commit_is_a_partial_load() -> None:
    facts = clean_facts()
    events = [*facts.events, event(8.5, "uncommitted", rank=0, path=f"{ROOT}/step-00000040")]
    check = check_loads(sorted(events, key=lambda e: e.time), [], facts.faults, facts.steps)
    assert not check.passed and "un-committed" in check.message


def test_a_failed_restore_fails_the_load_check() -> None:
    facts = clean_facts()
    events = [*facts.events, event(8.7, "restore_failed", rank=1, text="step-00000040/rank-1.eddp: size 3 bytes")]
    check = check_loads(events, facts.commits, facts.faults, facts.steps)
    assert not check.passed and "node0 rank 1: restore failed: step-00000040/rank-1.eddp" in check.message


# -- metrics ----------------------------------------------------------------------------------


def test_recovery_metrics_are_measured_from_the_fault() -> None:
    facts = clean_facts()
    metrics = fault_metrics(facts.faults[0], facts.events, facts.steps, None)
    assert metrics.detect_s == pytest.approx(0.3)
    assert metrics.agents_rendezvous_s == pytest.approx(1.0)
    assert metrics.rendezvous_s == pytest.approx(3.0)
    assert metrics.first_step_s == pytest.approx(4.1)
    assert metrics.steps_redone == 5 and metrics.resumed_step == 40 and metrics.world_size_after == 2
    assert metrics.stall_s == pytest.approx(4.1)  # from the kill at 5.0 (step 45 done at 4.5) to step 41 at 9.1
    assert not metrics.overlapped


def test_a_fault_the_job_never_noticed_has_no_recovery_figures_but_its_stall() -> None:
    facts = clean_facts()
    record = FaultRecord(0, "storage-outage", "0:storage-outage", fired_at=T0 + 10.0)
    steps = [s for s in facts.steps if not T0 + 10.0 < s.time < T0 + 13.0]  # no step for 3 s after it
    metrics = fault_metrics(record, facts.events[:-1], steps, None)
    assert metrics.detect_s is None and metrics.rendezvous_s is None and metrics.steps_redone is None
    assert metrics.stall_s == pytest.approx(3.0)


def test_a_normal_exit_is_not_a_detection() -> None:
    assert not noticed(event(1.0, "exit", rank=1, reason="done"))
    assert noticed(event(1.0, "exit", rank=1, reason="peer-lost")) and noticed(event(1.0, "stop_requested"))


def test_what_the_job_noticed_after_the_next_fault_is_not_this_faults() -> None:
    facts = clean_facts()
    record = FaultRecord(1, "restart-etcd", "1:restart-etcd", fired_at=T0 + 4.0)
    assert fault_metrics(record, facts.events, facts.steps, T0 + 5.0).detect_s is None


def test_a_next_fault_before_recovery_marks_the_overlap() -> None:
    facts = clean_facts()
    assert fault_metrics(facts.faults[0], facts.events, facts.steps, T0 + 7.0).overlapped


def test_goodput_counts_only_the_last_execution_of_each_step() -> None:
    # 45 steps of 0.1 s, 5 of them (41-45) lost, then 60 steps of 0.1 s; 17 s of wall time
    facts = clean_facts()
    value = goodput(facts.steps, [T0, T0 + 9.0], facts.started_at, facts.ended_at)
    assert value == pytest.approx(100 * 0.1 / 17.0)


def test_goodput_of_an_uninterrupted_run_is_its_step_time_over_wall_time() -> None:
    records = steps(1, 50, T0, dt=0.2)
    assert goodput(records, [T0], T0, T0 + 10.0) == pytest.approx(1.0)
    assert goodput([], [], T0, T0 + 10.0) == 0.0


def test_goodput_uses_the_step_time_for_the_first_step_of_an_attempt() -> None:
    # a resume at t=5 (emergency checkpoint of step 10): the gap from step 10 to 11 is not step time
    records = [*steps(1, 10, T0, dt=0.1), StepRecord(11, T0 + 8.0, 1, 0.15), StepRecord(12, T0 + 8.1, 1, 0.1)]
    assert goodput(records, [T0, T0 + 5.0], T0, T0 + 10.0) == pytest.approx((1.0 + 0.15 + 0.1) / 10.0)


# -- report --------------------------------------------------------------------------------------


def test_the_report_has_one_entry_per_fault_and_a_table_row_per_check() -> None:
    scenario = parse_scenario({"name": "t", "job": {"script": "examples/train.py", "max_steps": 100, "checkpoint_every": 20},
                               "cluster": {"nodes": "1:2", "start_nodes": 2},
                               "faults": [{"kind": "kill-worker", "at_step": 45, "target": "rank:1"}]})
    facts = clean_facts()
    report = build_report(scenario, facts, run_checks(facts))
    assert report["passed"] and report["faults"][0]["steps_redone"] == 5 and report["faults"][0]["fired_at_s"] == 7.0
    text = markdown(report)
    assert "# Chaos: t - PASSED" in text and "| data-digest | pass |" in text
    assert "| 0:kill-worker | 7.0 | rank 1 (pid 7) | 0.3 | 1.0 | 3.0 | 4.1 | 4.1 | 5 | 2 | SIGKILL |" in text


def test_the_report_prints_the_scenarios_goodput_before_and_target_next_to_the_runs() -> None:
    document = {"name": "t", "job": {"script": "examples/train.py", "max_steps": 100, "checkpoint_every": 20},
                "cluster": {"nodes": "1:2", "start_nodes": 2},
                "goodput": {"before": 0.5, "before_after_startup": 0.6, "before_note": "last year", "target": 0.1,
                            "target_after_startup": 0.2}}
    facts = clean_facts()
    report = build_report(parse_scenario(document), facts, run_checks(facts))
    text = markdown(report)
    assert "goodput before, last year: 50.0% (60.0% after start-up)" in text
    assert "goodput target: at least 10.0% (20.0% after start-up): met" in text
    document["goodput"] = {"target_after_startup": 1.0}
    assert "goodput target: at least (100.0% after start-up): NOT met" in markdown(
        build_report(parse_scenario(document), facts, run_checks(facts)))
    del document["goodput"]
    assert "goodput before" not in markdown(build_report(parse_scenario(document), facts, run_checks(facts)))


def test_goodput_figures_must_be_shares_and_known() -> None:
    document = {"name": "t", "job": {"script": "examples/train.py", "max_steps": 100, "checkpoint_every": 20},
                "cluster": {"nodes": "1:2", "start_nodes": 2}, "goodput": {"target": 97, "after": 0.9}}
    with pytest.raises(ScenarioError, match=r"(?s)goodput.target: is a share.*got 97.*goodput.after: unknown key"):
        parse_scenario(document)


def test_without_matplotlib_the_report_says_so_and_has_no_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    facts = clean_facts()
    scenario = parse_scenario({"name": "t", "job": {"script": "examples/train.py", "max_steps": 100, "checkpoint_every": 20},
                               "cluster": {"nodes": "1:2", "start_nodes": 2}})
    files = write_report(build_report(scenario, facts, run_checks(facts)), facts, tmp_path)
    assert files.png is None and files.png_note == NO_MATPLOTLIB
    assert NO_MATPLOTLIB in files.markdown.read_text()
    assert '"timeline_png": null' in files.json.read_text()


def test_a_long_scenarios_reference_run_gets_the_scenarios_time_not_15_minutes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fault-a-minute's clean reference (22,000 steps at world size 3) takes about 18 minutes on two cores; it
    timed out at the reference's fixed 900 s although the scenario allows itself 1,500."""
    import chaos.runner
    from chaos.runner import RunOptions, run_scenario
    from chaos.scenario import load_scenario

    limits: list[float] = []

    class Stop(Exception):
        pass

    def reference_run(job, world_size, cache_dir, timeout_s=900.0):  # type: ignore[no-untyped-def]
        limits.append(timeout_s)
        raise Stop

    monkeypatch.setattr(chaos.runner, "reference_run", reference_run)
    scenario = load_scenario("fault-a-minute")
    with pytest.raises(Stop):
        run_scenario(scenario, RunOptions(workdir=tmp_path / "work", cache_dir=tmp_path / "cache"))
    assert limits == [scenario.timeout_s]


def in_process_run(node1_pids: list[int], node0_pids: list[int]) -> tuple[list[JobEvent], list[FaultRecord]]:
    """rank 1 (node1) is killed at t=5; node0's worker goes on; node1's new worker(s) join at t=7."""
    events = [event(0.0, "started_fresh", rank=0, pid=node0_pids[0]),
              event(0.0, "started_fresh", rank=1, node="node1", pid=node1_pids[0]),
              *(event(5.5 + i, "resumed", rank=0, pid=pid, source="live") for i, pid in enumerate(node0_pids)),
              *(event(7.0, "resumed", rank=1, node="node1", pid=pid, source="replica") for pid in node1_pids[1:])]
    return events, [FaultRecord(0, "kill-worker", "0:kill-worker", fired_at=T0 + 5.0, target="rank 1 (pid 99)")]


def test_in_process_the_node_a_fault_hit_may_start_workers_again_and_the_others_keep_theirs() -> None:
    check = check_kept_processes(*in_process_run([11, 12], [10]), nproc_per_node=1)
    assert check.passed and "node0 (1 process(es))" in check.message, check


def test_in_process_a_survivor_whose_worker_was_started_again_fails_naming_the_node_and_its_processes() -> None:
    check = check_kept_processes(*in_process_run([11, 12], [10, 13]), nproc_per_node=1)
    assert not check.passed and check.message.startswith("node0: 2 worker processes (10, 13)"), check


def test_the_rank_a_fault_names_is_the_node_that_held_it_last_when_ranks_moved() -> None:
    """After an in-process shrink rank 0 may be another node's worker: the fault hits the latest holder."""
    events = [event(0.0, "started_fresh", rank=0, pid=10), event(0.0, "started_fresh", rank=1, node="node1", pid=11),
              event(3.0, "resumed", rank=0, node="node1", pid=11, source="live"),
              event(6.0, "resumed", rank=0, pid=12, source="replica")]
    faults = [FaultRecord(0, "kill-worker", "0:kill-worker", fired_at=T0 + 2.0, target="rank 0 (pid 1)"),
              FaultRecord(1, "kill-worker", "1:kill-worker", fired_at=T0 + 5.0, target="rank 0 (pid 2)")]
    check = check_kept_processes(events, faults, nproc_per_node=1)
    assert not check.passed and "every node that trained was hit" in check.message, check
    check = check_kept_processes(events, faults[1:], nproc_per_node=1)
    assert not check.passed and check.message.startswith("node0: 2 worker processes"), check


def test_a_live_resume_loaded_nothing_and_needs_no_commit() -> None:
    facts = clean_facts()
    facts.events.append(event(9.5, "resumed", rank=0, step=45, source="live", world_size=1))
    assert check_loads(facts.events, facts.commits, facts.faults, facts.steps).passed


def test_a_node_a_fault_added_is_not_hit_by_it_and_must_keep_its_processes() -> None:
    events = [event(0.0, "started_fresh", rank=0, pid=10), event(3.0, "resumed", rank=1, node="node1", pid=11),
              event(6.0, "resumed", rank=1, node="node1", pid=12, source="replica")]
    faults = [FaultRecord(0, "kill-node", "0:kill-node", fired_at=T0 + 1.0, target="node0"),
              FaultRecord(1, "add-node", "1:add-node", fired_at=T0 + 2.0, target="node1")]
    check = check_kept_processes(events, faults, nproc_per_node=1)
    assert not check.passed and check.message.startswith("node1: 2 worker processes (11, 12)"), check


def test_in_process_the_survivors_re_formation_is_the_recovery_not_the_restarted_workers_join() -> None:
    """Killed at t=5: the survivor re-forms at 5.1 and steps at 5.2, before any agent line; the restarted
    worker's join (a later group) is not what the figures time."""
    record = FaultRecord(0, "kill-worker", "0:kill-worker", fired_at=T0 + 5.0, target="rank 1 (pid 99)")
    events = [event(5.1, "process_group_formed", rank=0, world_size=1),
              event(5.1, "resumed", rank=0, step=50, source="live", world_size=1),
              event(5.6, "agent-failure", node="node1"),
              event(6.0, "process_group_formed", rank=0, world_size=2)]
    figures = fault_metrics(record, events, steps(51, 60, T0 + 5.1), None)
    assert figures.detect_s == pytest.approx(0.1) and figures.rendezvous_s == pytest.approx(0.1)
    assert figures.first_step_s == pytest.approx(0.2) and figures.steps_redone == 0
