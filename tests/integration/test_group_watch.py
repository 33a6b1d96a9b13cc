"""A rank whose collective blocks (its peer gone but its connections open, as under NCCL) exits
``peer-lost`` once its agent stops the group, keeping its live state for the restart.

Two processes of a hand-written loop on the runtime (tests/fixtures/stalled_peer.py); the test plays the
agent: it sends SIGTERM, as torchrun's agent does to every worker when it stops a group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos.cluster import free_port, wait_for
from elastic_ddp.runtime import ABANDON_GRACE_S
from tests.jobs import events

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "stalled_peer.py"


def test_a_rank_blocked_in_a_collective_exits_peer_lost_with_a_rescue_once_its_agent_stops_the_group(
    tmp_path: Path,
) -> None:
    port, logs = free_port(), tmp_path / "logs"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "ELASTIC_DDP_REPLICA_DIR": str(tmp_path / "replicas"), "LOCAL_WORLD_SIZE": "1"}
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path / "ckpt"), str(logs)],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        wait_for(lambda: (logs / "stalled").exists() or any(r.poll() is not None for r in ranks), 120, "rank 1 to stall")
        assert ranks[0].poll() is None, ranks[0].communicate()[0][-3000:]
        ranks[0].send_signal(signal.SIGTERM)
        told = time.monotonic()
        code = ranks[0].wait(timeout=60)
        took = time.monotonic() - told
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    output = ranks[0].stdout.read() if ranks[0].stdout else ""  # type: ignore[union-attr]
    assert code == 75, output[-3000:]
    assert took < ABANDON_GRACE_S + 3, output[-3000:]
    exits = [(e["reason"], e["status"]) for e in events(logs, "exit") if e["rank"] == 0]
    assert exits == [("peer-lost", 75)]
    rescued = [e["step"] for e in events(logs, "replica_saved") if e["rank"] == 0 and e["reason"] == "rescue"]
    assert rescued == [5]
