"""The sample ledger of the example job: --log-sample-ledger under torchrun, a resume that redoes steps at
another world size, and the chaos verifier's check over what rank 0 wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.verify import CheckpointFacts, audit_ledger, check_ledger, read_ledger_facts
from tests.jobs import inspect, train_ok

pytestmark = pytest.mark.integration


@pytest.mark.slow  # CI time: .ci/run runs it in its third part (SLOW_SET)
def test_the_example_job_writes_every_committed_step_and_a_resume_appends_the_redone_ones(tmp_path: Path) -> None:
    """Six steps at world size 2 with a checkpoint at step 4 and none at the end (steps 5-6 are lost), then a
    resume to step 10 as one process: steps 5-6 are written again, and their last lines are the final lineage."""
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    common = ["--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--log-dir", logs, "--log-sample-ledger",
              "--global-batch-size", "32", "--log-progress", "off"]
    train_ok(["--max-steps", "6", "--no-checkpoint-save-final", *common], nproc=2)
    train_ok(["--max-steps", "10", *common])
    ledger = read_ledger_facts(Path(logs))
    assert not ledger.missing and ledger.problems == []
    assert [(entry.step, entry.world_size) for entry in ledger.entries] == [
        *((step, 2) for step in range(1, 7)), *((step, 1) for step in range(5, 11))]
    assert all(len(entry.ids) == 32 for entry in ledger.entries)
    redone = {entry.step: entry.ids for entry in ledger.entries if entry.world_size == 1}
    assert all(entry.ids == redone[entry.step] for entry in ledger.entries if entry.step in (5, 6))
    facts = inspect(ckpt)
    final = CheckpointFacts(facts["path"], facts["step"], facts["world_size"], facts["model_digest"], facts["data_digest"])
    audit = audit_ledger(ledger.entries, final.step)
    assert (audit.steps, audit.samples, audit.duplicates, audit.gaps) == (10, 320, 0, 0)
    check = check_ledger(ledger, final)
    assert check.passed and not check.skipped, check.message
