"""The sample ledger: rank 0's samples.jsonl as the runtime writes it, read back and validated, and the chaos
verifier's ``sample-ledger`` check over it (the final lineage: duplicates, gaps, the chain to the final digest)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from chaos.scenario import LEDGER_FLAG, parse_scenario, with_script
from chaos.verify import (
    CheckpointFacts,
    LedgerFacts,
    audit_ledger,
    check_ledger,
    ledger_digest,
    read_ledger_facts,
    run_checks,
)
from elastic_ddp.config import CheckpointConfig, LogConfig, TrainConfig, fingerprint
from elastic_ddp.data import ElasticSampler
from elastic_ddp.errors import ConfigError
from elastic_ddp.events import SAMPLES_FILE, EventLog, LedgerEntry, SampleLedger, parse_ledger, read_ledger
from elastic_ddp.runtime import Runtime
from tests.unit.test_chaos_verify import clean_facts

DATASET, BATCH = 200, 64  # three steps an epoch; drop_last skips the last 8 positions


def lineage(steps: int, seed: int = 0) -> list[LedgerEntry]:
    """The entries of steps 1..steps as ElasticSampler plans them."""
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=seed, rank=0, world_size=1)
    entries = []
    for step in range(1, steps + 1):
        plan = sampler.plan()
        ids = tuple(sorted(sampler.global_ids(plan).tolist()))
        entries.append(LedgerEntry(step, plan.epoch, plan.start, plan.stop, 2, ids))
        sampler.commit(plan)
    return entries


def final_digest(steps: int) -> str:
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(steps):
        sampler.commit(sampler.plan())
    return sampler.data_digest


def final(steps: int) -> CheckpointFacts:
    return CheckpointFacts(f"/c/step-{steps:08d}", steps, 2, "m" * 64, final_digest(steps))


def line(entry: LedgerEntry, **changes: object) -> str:
    record = {"time": 1.0, "step": entry.step, "epoch": entry.epoch, "start": entry.start, "stop": entry.stop,
              "world_size": entry.world_size, "ids": list(entry.ids), **changes}
    return json.dumps(record)


# -- writing and reading ----------------------------------------------------------------------


def test_what_the_writer_appends_reads_back_across_launches(tmp_path: Path) -> None:
    first, second = lineage(2)
    ledger = SampleLedger(str(tmp_path))
    ledger.record(first.step, first.epoch, first.start, first.stop, 2, first.ids)
    ledger.close()
    ledger = SampleLedger(str(tmp_path))  # a restart appends to the same file
    ledger.record(second.step, second.epoch, second.start, second.stop, 3, second.ids)
    ledger.close()
    read = read_ledger(tmp_path)
    assert read is not None
    entries, problems = read
    assert problems == []
    assert entries == [replace(first, line=1), replace(second, world_size=3, line=2)]


def test_a_line_cut_short_by_a_crash_costs_that_line_only(tmp_path: Path) -> None:
    first, second = lineage(2)
    (tmp_path / SAMPLES_FILE).write_text(line(first) + "\n" + line(second)[:30])  # killed in the middle of a write
    ledger = SampleLedger(str(tmp_path))
    ledger.record(second.step, second.epoch, second.start, second.stop, 2, second.ids)
    ledger.close()
    read = read_ledger(tmp_path)
    assert read is not None
    entries, problems = read
    assert [entry.line for entry in entries] == [1, 3]
    assert len(problems) == 1 and problems[0].startswith("line 2: not JSON")


def test_lines_that_are_not_entries_are_named_and_the_others_read() -> None:
    good = lineage(1)[0]
    lines = [
        line(good),
        "{not json",
        "[1, 2]",
        line(good, stop=good.stop + 1),       # one position more than ids
        line(good, ids=list(reversed(good.ids))),
        line(good, step=True),
        line(good, ids=[-1] * len(good.ids)),
        json.dumps({"step": 2}),
        "",
    ]
    entries, problems = parse_ledger(lines)
    assert [entry.line for entry in entries] == [1]
    assert [problem.split(":")[0] for problem in problems] == [
        "line 2", "line 3", "line 4 (step 1)", "line 5 (step 1)", "line 6 (step True)", "line 7 (step 1)", "line 8 (step 2)"]
    assert "64 ids for 65 positions" in problems[2] and "not sorted" in problems[3] and "step not an integer" in problems[4]
    assert "without epoch, start, stop, world_size, ids" in problems[6]


def test_no_file_is_none_and_the_check_is_skipped_not_passed_or_failed(tmp_path: Path) -> None:
    assert read_ledger(tmp_path) is None
    facts = read_ledger_facts(tmp_path)
    check = check_ledger(facts, final(6))
    assert check.skipped and check.passed
    assert check.message.startswith(f"skipped: no {SAMPLES_FILE} in {tmp_path}")


# -- the check ----------------------------------------------------------------------------------


def test_a_clean_lineage_has_no_duplicate_and_no_gap_and_chains_to_the_final_digest() -> None:
    entries = lineage(200)
    check = check_ledger(LedgerFacts(entries), final(200))
    assert check.passed and not check.skipped, check
    assert check.message == ("ledger: 12,800 samples in 200 steps, 0 duplicates, 0 gaps; steps 1-200 chain to the "
                             "final checkpoint's data digest")
    assert ledger_digest(entries) == final_digest(200)


def test_a_step_redone_after_a_restart_counts_by_its_last_line() -> None:
    """Steps 1-5, a crash, a resume from step 3: steps 4-5 are written again, then 6. The first attempt's step 5
    held other samples (a bug of that attempt); only the redo reached the final model, so the check passes."""
    entries = lineage(6)
    wrong = replace(entries[4], ids=entries[3].ids, start=entries[3].start, stop=entries[3].stop)  # step 4's again
    written = [*entries[:4], wrong, *entries[3:]]
    check = check_ledger(LedgerFacts(written), final(6))
    assert check.passed, check
    assert check.message.startswith("ledger: 384 samples in 6 steps, 0 duplicates, 0 gaps")
    late = check_ledger(LedgerFacts([*entries, wrong]), final(6))  # the wrong line written last: it counts
    assert not late.passed
    assert "step 5: positions [0, 64) of epoch 1 after step 4's [0, 64)" in late.message
    assert late.message.startswith("ledger: 384 samples in 6 steps, 64 duplicates, 2 gaps")


def test_a_sample_trained_on_twice_in_an_epoch_is_a_duplicate() -> None:
    entries = lineage(3)
    twice = entries[0].ids[0]
    ids = tuple(sorted((twice, *entries[1].ids[1:])))
    entries[1] = replace(entries[1], ids=ids)
    audit = audit_ledger(entries, 3)
    assert (audit.duplicates, audit.gaps, audit.samples) == (1, 0, 192)
    assert audit.findings == [f"step 2: sample {twice} of epoch 0 was already in step 1"]
    assert not check_ledger(LedgerFacts(entries), final(3)).passed


def test_the_same_sample_in_another_epoch_is_no_duplicate() -> None:
    audit = audit_ledger(lineage(9), 9)  # three epochs: every sample id recurs, once an epoch
    assert (audit.duplicates, audit.gaps, audit.steps) == (0, 0, 9)


def test_skipped_positions_a_missing_step_and_a_new_epoch_not_at_zero_are_gaps() -> None:
    entries = lineage(6)
    moved = replace(entries[1], start=entries[1].start + 1, stop=entries[1].stop + 1)
    audit = audit_ledger([entries[0], moved, entries[2], entries[4], replace(entries[5], start=64, stop=128)], 6)
    assert audit.gaps == 4
    assert audit.findings == [
        "step 2: positions [65, 129) of epoch 0 after step 1's [0, 64)",
        "step 3: positions [128, 192) of epoch 0 after step 2's [65, 129)",
        "step 4: no line in the ledger",
        "step 6: positions [64, 128) of epoch 1 after step 5's [64, 128)",
    ]
    first = audit_ledger([replace(entries[0], epoch=1)], 1)
    assert first.findings == ["step 1: the first step holds positions [0, 64) of epoch 1, not the run's beginning"]
    jump = audit_ledger([entries[0], replace(entries[3], step=2, epoch=2)], 2)
    assert jump.findings == ["step 2: positions [0, 64) of epoch 2 after step 1 in epoch 0"]


def test_steps_after_the_final_checkpoint_are_not_counted_and_missing_ones_fail() -> None:
    entries = lineage(8)
    assert check_ledger(LedgerFacts(entries), final(6)).message.startswith("ledger: 384 samples in 6 steps")
    short = check_ledger(LedgerFacts(entries[:5]), final(6))
    assert not short.passed and "step 6: no line in the ledger" in short.message


def test_a_lineage_that_chains_to_another_digest_fails() -> None:
    check = check_ledger(LedgerFacts(lineage(6, seed=1)), final(6))  # contiguous, distinct, but other samples
    assert not check.passed and "chain to data digest" in check.message


def test_unreadable_lines_are_reported_with_the_verdict() -> None:
    check = check_ledger(LedgerFacts(lineage(3), ["line 2: not JSON (x): '{'"]), final(3))
    assert check.passed
    assert check.message.endswith("; 1 unreadable line(s) not used: line 2: not JSON (x): '{'")
    assert not check_ledger(LedgerFacts([], ["line 1: not JSON"]), None).passed


def test_run_checks_adds_the_ledger_check_when_the_ledger_was_read() -> None:
    facts = clean_facts()
    assert "sample-ledger" not in [check.name for check in run_checks(facts)]
    checks = run_checks(replace(facts, ledger=LedgerFacts(missing="no samples.jsonl")))
    assert checks[-1].name == "sample-ledger" and checks[-1].skipped


# -- the flag, the runtime and the chaos job --------------------------------------------------------


def test_the_flag_is_a_log_option_that_is_not_fingerprinted_and_needs_a_log_dir() -> None:
    assert ("sample_ledger", "needs --log-dir") in LogConfig(sample_ledger=True).problems()
    assert LogConfig(dir="/l", sample_ledger=True).problems() == []
    assert fingerprint(TrainConfig()) == fingerprint(TrainConfig(log=LogConfig(dir="/l", sample_ledger=True)))


def test_every_scenario_job_writes_the_ledger_unless_another_script_replaces_its_args() -> None:
    job: dict[str, object] = {"script": "examples/train.py", "max_steps": 10, "checkpoint_every": 5}
    document = {"name": "t", "description": "d", "timeout_s": 60, "job": job,
                "cluster": {"nodes": "1", "start_nodes": 1}, "faults": []}
    scenario = parse_scenario(document, "t")
    assert scenario.job.args.count(LEDGER_FLAG) == 1
    off = parse_scenario({**document, "job": {**job, "args": ["--no-log-sample-ledger"]}}, "t")
    assert LEDGER_FLAG not in off.job.args
    assert LEDGER_FLAG not in with_script(scenario, "examples/byo_loop/train.py").job.args


def _runtime(tmp_path: Path, sampler: ElasticSampler, model: torch.nn.Module, **kwargs: object) -> Runtime:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    events = EventLog(str(tmp_path / "logs"), run_id="t", rank=0)
    return Runtime.for_loop(model=model, optimizer=optimizer, sampler=sampler, events=events,
                            checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=3, save_final=False,
                                                        replica_every=0), **kwargs)  # type: ignore[arg-type]


def _train(tmp_path: Path, until: int) -> None:
    """The library path at world size 1: resume, then steps up to ``until`` (checkpoints every 3, no final one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    with _runtime(tmp_path, sampler, model, sample_ledger=True) as runtime:
        step = runtime.restore()
        while step < until:
            plan = sampler.plan()
            model.zero_grad()
            model(torch.ones(plan.size, 2)).sum().backward()
            runtime.state.optimizer.step()
            sampler.commit(plan)
            step += 1
            if runtime.after_step(step).stop:
                break


def test_the_runtime_writes_each_committed_step_and_a_restart_redoes_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _train(tmp_path, 5)   # checkpoint at step 3; steps 4-5 are lost with the process
    _train(tmp_path, 7)   # resumes at 3: steps 4-5 again, then 6-7
    read = read_ledger(tmp_path / "logs")
    assert read is not None
    entries, problems = read
    assert problems == []
    assert [entry.step for entry in entries] == [1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert entries[:5] == [replace(entry, world_size=1, line=number) for number, entry in enumerate(lineage(5), 1)]
    assert entries[3].ids == entries[5].ids  # the redone step consumed the same samples
    audit = audit_ledger(entries, 6)  # the newest checkpoint: step 6
    assert (audit.steps, audit.duplicates, audit.gaps) == (6, 0, 0)
    assert ledger_digest(audit.lineage) == final_digest(6)


def test_the_runtime_refuses_a_ledger_without_a_log_dir(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="log.sample_ledger: needs a log directory"):
        Runtime.for_loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler,
                         sample_ledger=True)
