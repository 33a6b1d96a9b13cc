"""In-process re-formation on the runtime: when a peer dies, the survivors keep their process, their model and
optimizer, form a membership of two in place (``Runtime.reform``) and go on from the last complete step with
the data an uninterrupted run consumed (three gloo processes on one store; no torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.cluster import free_port
from elastic_ddp.data import ElasticSampler
from tests.jobs import events

pytestmark = pytest.mark.integration

SHRINK = Path(__file__).resolve().parents[1] / "fixtures" / "inprocess_shrink.py"
STEPS, SAMPLES, BATCH = 12, 120, 12


def _uninterrupted_data_digest() -> str:
    sampler = ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(STEPS):
        sampler.commit(sampler.plan())
    return sampler.data_digest


def test_survivors_of_a_lost_peer_go_on_in_their_own_process_from_the_last_complete_step(tmp_path: Path) -> None:
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(SHRINK), str(rank), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1, 2)]
    try:
        outs = [ranks[rank].communicate(timeout=120) for rank in (0, 1)]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [0, 0, 9], [err[-3000:] for _, err in outs]
    survivors = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for survivor, process in zip(survivors, ranks, strict=False):
        assert survivor["pid"] == survivor["pid_at_end"] == process.pid  # the process that started, to the end
        assert survivor["step"] == STEPS and survivor["trained"] == list(range(1, STEPS + 1)), survivor  # none redone
        assert survivor["data_digest"] == _uninterrupted_data_digest()
        assert survivor["form_s"] is not None and survivor["form_s"] >= 0
    (went_on,) = [event for event in events(tmp_path / "logs", "resumed") if event["rank"] == 0]
    assert (went_on["source"], went_on["saved_world_size"], went_on["world_size"]) == ("live", 3, 2), went_on
    assert went_on["step"] in (5, 6), went_on  # the last step every rank completed, or the one the agreement closed
