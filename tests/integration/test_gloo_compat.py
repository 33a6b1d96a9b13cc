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
