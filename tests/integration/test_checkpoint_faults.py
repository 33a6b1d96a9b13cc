"""Storage faults during asynchronous saves: the error reaches every rank, nothing committed is lost."""

from __future__ import annotations

import json
import subprocess

import pytest

from chaos.cluster import wait_for
from tests.jobs import BASE_ARGS, TORCHRUN, TRAIN, child_env, inspect

pytestmark = pytest.mark.integration


@pytest.mark.slow  # passes (63 s on an idle machine, 2026-11-30); kept out of the default set to hold CI under 15 min
def test_s3_outage_during_async_save_stops_every_rank_and_keeps_the_previous_checkpoint(s3_server, tmp_path) -> None:
    options = dict(s3_server.options)
    options["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 2, "mode": "standard"}}
    logs = tmp_path / "logs"
    command = TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0", TRAIN, *BASE_ARGS,
                          "--max-steps", "100000", "--checkpoint-dir", s3_server.uri, "--checkpoint-every", "20",
                          "--checkpoint-storage-options", json.dumps(options), "--log-dir", str(logs)]
    job = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        def committed_steps() -> list[int]:
            text = (logs / "metrics.jsonl").read_text() if (logs / "metrics.jsonl").exists() else ""
            return [r["step"] for r in map(json.loads, text.splitlines()) if "loss" in r] if text else []

        wait_for(lambda: (s := committed_steps()) and s[-1] >= 45, 300, "two checkpoints to be committed")
        s3_server.pause()  # the endpoint stops answering: connections hang until their timeouts
        output, _ = job.communicate(timeout=480)
    finally:
        if job.poll() is None:
            job.kill()
        s3_server.resume()
    assert job.returncode != 0
    failures = [line for line in output.splitlines() if "was not committed" in line and "ERROR" in line]
    ranks = {line.split("/", 2)[1].split()[0] for line in failures}  # "[run/RANK step]"
    assert ranks == {"0", "1"}, output[-4000:]
    assert output.count("exit: reason=error status=1") == 2
    facts = inspect(s3_server.uri)  # the newest committed checkpoint still verifies
    assert facts["step"] % 20 == 0 and facts["step"] >= 40


def test_a_background_save_failing_on_one_rank_stops_every_rank_at_the_same_step(tmp_path) -> None:
    """Rank 1's files of step 100 cannot be written. Before, each rank raised the failure at whichever step
    it happened to look, and the other waited in the next all-reduce until the collective timeout."""
    from tests.jobs import REPO, run

    script = str(REPO / "tests" / "fixtures" / "failing_save_train.py")
    result = run(TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0", script, *BASE_ARGS,
                             "--max-steps", "100000", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50",
                             "--dist-collective-timeout-s", "60", "--log-progress", "off", "--log-every", "10"],
                 timeout=120, env={"FAIL_SAVE_STEP": "100"})
    assert result.returncode != 0
    errors = [line for line in result.output.splitlines() if "ERROR" in line and "elastic_ddp.entry" in line]
    stopped = {line.split("/", 2)[1].split("]")[0] for line in errors}  # "[run/RANK STEP]" -> "RANK STEP"
    assert {entry.split()[0] for entry in stopped} == {"0", "1"}, result.output[-3000:]
    assert len({entry.split()[1] for entry in stopped}) == 1, stopped  # the same step on both ranks
    assert all("step 100" in line and "No space left on device" in line for line in errors), errors
    assert inspect(str(tmp_path / "ckpt"))["step"] == 50
