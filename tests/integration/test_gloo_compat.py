"""The words of gloo that the runtime still reads: the fast path of a lost peer's exit reason.

A lost peer is known from the agent (:mod:`elastic_ddp.resilience.group`); gloo's message only lets a rank
whose collective raised name the reason at once (:func:`elastic_ddp.resilience.exits.peer_loss`). This
test fails when a torch release words it differently, so the fast path cannot silently stop working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from chaos.cluster import free_port

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "gloo_peer_dies.py"


def test_gloo_still_says_a_peer_closed_the_connection_in_words_peer_loss_recognises() -> None:
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), str(rank), str(port)], stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["raised"] == "RuntimeError", outcome
    assert outcome["recognised"], outcome["message"]


ABANDON = Path(__file__).resolve().parents[1] / "fixtures" / "group_abandon.py"


def _abandon_and_form_again(path: str) -> list[dict[str, object]]:
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(ABANDON), str(rank), str(port), path], stdout=subprocess.PIPE,
                              text=True) for rank in (0, 1, 2)]
    try:
        outs = [ranks[rank].communicate(timeout=120)[0] for rank in (0, 1)]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _formed_again(outcome: dict[str, object], how: str) -> None:
    timings = {name: outcome.pop(name) for name in ("abandon_s", "form_s")}
    assert outcome == {"raised": True, "how": how, "group_left": False, "sum": 2.0, "model_kept": True}, outcome
    assert all(isinstance(seconds, float) and seconds >= 0 for seconds in timings.values()), timings


def test_survivors_abort_the_broken_group_where_torch_can_and_form_a_new_one_in_process() -> None:
    how = "abort" if callable(getattr(dist.ProcessGroup, "abort", None)) else "destroy"
    for outcome in _abandon_and_form_again("abort"):
        _formed_again(outcome, how)


def test_without_abort_survivors_destroy_the_broken_group_and_form_a_new_one_in_process() -> None:
    for outcome in _abandon_and_form_again("destroy"):
        _formed_again(outcome, "destroy")
