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
