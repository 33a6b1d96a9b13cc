"""Storage faults during asynchronous saves: the error reaches every rank, nothing committed is lost."""

from __future__ import annotations

import json
import subprocess

import pytest

from chaos.cluster import wait_for
from tests.jobs import BASE_ARGS, TORCHRUN, TRAIN, child_env, events, inspect

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
    failed = events(logs, "save_failed")
    assert {event["rank"] for event in failed} == {0, 1}, output[-4000:]
    assert all("was not committed" in event["error"] for event in failed)
    assert sorted((event["rank"], event["reason"], event["status"]) for event in events(logs, "exit")) == [
        (0, "error", 1), (1, "error", 1)]
    facts = inspect(s3_server.uri)  # the newest committed checkpoint still verifies
    assert facts["step"] % 20 == 0 and facts["step"] >= 40


# Both doors are views of one Runtime, which votes on a failed background save: CI runs the library door,
# the slow set the trainer's too.
@pytest.mark.parametrize("path", [pytest.param("trainer", marks=pytest.mark.slow), "library"])
def test_a_background_save_failing_on_one_rank_stops_every_rank_at_the_same_step(path: str, tmp_path) -> None:
    """Rank 1's files of step 100 cannot be written. Before, each rank raised the failure at whichever step
    it happened to look, and the other waited in the next all-reduce until the collective timeout. Both paths
    (the library path: examples/byo_loop/train.py) vote the same way."""
    from tests.jobs import REPO, run

    script = str(REPO / "tests" / "fixtures" / "failing_save_train.py")
    logs = tmp_path / "logs"
    own = [*BASE_ARGS, "--dist-collective-timeout-s", "60", "--log-progress", "off"] if path == "trainer" else []
    result = run(TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0", script, *own,
                             "--max-steps", "100000", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50",
                             "--log-every", "10", "--log-dir", str(logs)],
                 timeout=120, env={"FAIL_SAVE_STEP": "100",
                                   "SCRIPT": "examples/train.py" if path == "trainer" else "examples/byo_loop/train.py"})
    assert result.returncode != 0
    assert {(event["rank"], event["step"]) for event in events(logs, "save_failed")} == {(0, 100), (1, 100)}
    exits = events(logs, "exit")
    assert {(event["rank"], event["reason"]) for event in exits} == {(0, "error"), (1, "error")}, result.output[-3000:]
    assert len({event["step"] for event in exits}) == 1, exits  # both ranks stopped at the same step
    assert all("step 100" in event["error"] and "No space left on device" in event["error"] for event in exits), exits
    assert inspect(str(tmp_path / "ckpt"))["step"] == 50
