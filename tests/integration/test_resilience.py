"""Preemption, spot notices, hangs, crashes and divergence with real torchrun agents on gloo.

Each test runs simulated nodes (torchrun agents in their own process groups, chaos.cluster)
rendezvousing through c10d on 127.0.0.1, and checks what a user would: the job finishes,
no step is redone, and the data consumed equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from chaos.cluster import JobSpec, LocalCluster, Node, wait_for
from chaos.faults import SpotServer
from tests.jobs import BASE_ARGS, TRAIN, events, inspect, resumed_steps, train_ok

pytestmark = pytest.mark.integration

STEPS = 600
RDZV_CONF = {"join_timeout": "60", "last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


def job_args(workdir: Path, *extra: str) -> list[str]:
    return [*BASE_ARGS, "--max-steps", str(STEPS), "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "50",
            "--log-dir", str(workdir / "logs"), "--log-progress", "off", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: its data digest is what every recovered run must reproduce."""
    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    train_ok(["--max-steps", str(STEPS), "--checkpoint-dir", str(ckpt)], nproc=2)
    return inspect(str(ckpt))


def step_records(workdir: Path) -> list[dict]:
    path = workdir / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def node_events(workdir: Path, node: Node, kind: str = "", since: float = 0.0) -> list[dict]:
    """The events of the ranks that ran on ``node`` (their torchrun agent is the node's), from ``since`` on."""
    return [event for event in events(workdir / "logs", kind) if event.get("agent_pid") == node.pid
            and event["time"] >= since]


def exits(workdir: Path, node: Node, since: float = 0.0) -> list[tuple[str, int]]:
    return [(event["reason"], event["status"]) for event in node_events(workdir, node, "exit", since)]


def logged_steps(workdir: Path) -> list[int]:
    return [r["step"] for r in step_records(workdir)]


def wait_for_step(workdir: Path, step: int, world_size: int) -> int:
    """Wait until a step >= ``step`` ran at ``world_size`` (all nodes joined); return the newest step."""
    def reached() -> int | None:
        records = step_records(workdir)
        if records and records[-1]["world_size"] == world_size and records[-1]["step"] >= step:
            return records[-1]["step"]
        return None

    return wait_for(reached, 180, f"step {step} at world size {world_size}")


def make_cluster(workdir: Path, nnodes: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 prefork: bool = True) -> LocalCluster:
    """``prefork=False`` for a test that stops a worker with SIGSTOP: under the fork server the agent's child is
    the worker's launcher, which a SIGSTOP stops without stopping the worker."""
    spec = JobSpec(script=TRAIN, args=job_args(workdir, *extra), nnodes=nnodes, nproc_per_node=2,
                   rdzv_conf=dict(RDZV_CONF), run_id=workdir.name, max_restarts=5, env=env or {}, prefork=prefork)
    return LocalCluster(spec, workdir)


def check_no_step_redone_and_same_data(workdir: Path, reference: dict) -> None:
    steps = logged_steps(workdir)
    assert steps == sorted(steps) and len(steps) == len(set(steps)), "a step was logged twice: work was redone"
    assert steps[-1] == STEPS
    final = inspect(str(workdir / "ckpt"))
    assert final["step"] == STEPS
    assert final["data_digest"] == reference["data_digest"]


def agreed_stop_step(workdir: Path, since: float) -> int:
    """The step at which every rank agreed to stop after ``since`` (there must be one, the same on every rank).

    Events before ``since`` are left out: when the second node's agent joins after the first round
    closed (a slow start on a loaded machine), the first node stopped once already to let it in."""
    steps = {event["step"] for event in events(workdir / "logs", "stop_agreed") if event["time"] >= since}
    assert len(steps) == 1, steps
    return steps.pop()


def check_stop_saved_and_resumed(workdir: Path, survivor: Node, leaving: Node, source: str, since: float) -> int:
    """After ``since``, the leaving node's ranks were asked and stopped as preempted, the survivor's as
    peer-lost, at one step, whose checkpoint was committed, and from which the survivor resumed; returns that step."""
    stop = agreed_stop_step(workdir, since)
    assert {event["reason"] for event in node_events(workdir, leaving, "stop_requested", since)} == {source}
    agreed_here = {(event["reason"], event["source"]) for event in node_events(workdir, leaving, "stop_agreed", since)}
    assert agreed_here == {("preempted", source)}
    assert {event["reason"] for event in node_events(workdir, survivor, "stop_agreed", since)} == {"peer-lost"}
    assert stop in [event["step"] for event in events(workdir / "logs", "committed")]  # the emergency checkpoint
    assert exits(workdir, leaving, since) == [("preempted", 0)] * 2
    assert exits(workdir, survivor, since).count(("peer-lost", 75)) == 2
    resumed = {event["step"] for event in node_events(workdir, survivor, "resumed", since)}
    assert resumed == {stop}  # exactly the agreed step
    return stop


def test_preempted_node_loses_no_work(tmp_path: Path, reference: dict) -> None:
    with make_cluster(tmp_path, "1:2") as cluster:
        survivor, leaving = cluster.start(2).nodes
        at_signal = wait_for_step(tmp_path, 80, world_size=4)
        signalled_at = time.time()
        leaving.signal_agent(signal.SIGTERM)
        leaving.wait(timeout=60)
        assert survivor.wait(timeout=180) == 0, survivor.output()[-4000:]
    assert check_stop_saved_and_resumed(tmp_path, survivor, leaving, "signal:SIGTERM", signalled_at) >= at_signal
    check_no_step_redone_and_same_data(tmp_path, reference)


@pytest.mark.slow  # the same agreement and save path as test_preempted_node_loses_no_work; the poller has unit tests
def test_spot_notice_on_one_node_loses_no_work(tmp_path: Path, reference: dict) -> None:
    spot = SpotServer().start()  # AWS's instance-action path per node: 404 until a notice is issued
    try:
        with make_cluster(tmp_path, "1:2") as cluster:
            survivor = cluster.add_node()
            leaving = cluster.add_node(["--resilience-spot-notice-url", spot.url("leaving"),
                                        "--resilience-spot-poll-interval-s", "0.5"])
            at_notice = wait_for_step(tmp_path, 80, world_size=4)
            notified_at = time.time()
            spot.notify("leaving")
            leaving.wait(timeout=60)
            assert survivor.wait(timeout=180) == 0, survivor.output()[-4000:]
    finally:
        spot.close()
    assert check_stop_saved_and_resumed(tmp_path, survivor, leaving, "spot-notice", notified_at) >= at_notice
    assert {event["detail"] for event in node_events(tmp_path, leaving, "exit")} == {"spot-notice"}
    check_no_step_redone_and_same_data(tmp_path, reference)


HANG_ARGS = ("--resilience-watchdog-timeout-s", "4", "--dist-collective-timeout-s", "60", "--log-per-rank-files")


@pytest.mark.slow  # 60 s; CI time. The hang-worker chaos scenario covers a stopped worker too
def test_stopped_worker_becomes_a_restart_with_stacks_in_the_log(tmp_path: Path, reference: dict) -> None:
    with make_cluster(tmp_path, "1", HANG_ARGS, prefork=False) as cluster:
        node = cluster.start(1).nodes[0]
        wait_for_step(tmp_path, 60, world_size=2)
        victim = wait_for(node.worker_pids, 30, "worker pids")[-1]
        import os

        os.kill(victim, signal.SIGSTOP)
        assert node.wait(timeout=180) == 0, node.output()[-4000:]
        out = node.output()
    fired = events(tmp_path / "logs", "watchdog_fired")
    assert fired and {event["phase"] for event in fired} <= {"collective", "step", "data"}
    assert "Current thread" in out or "Thread 0x" in out  # faulthandler's stack dump, for whoever reads the log
    assert {(event["reason"], event["status"]) for event in events(tmp_path / "logs", "exit")} >= {
        (fired[0]["reason"], 76), ("done", 0)}
    assert events(tmp_path / "logs", "resumed")
    check_no_step_redone_after_checkpoint(tmp_path, reference)


def check_no_step_redone_after_checkpoint(workdir: Path, reference: dict) -> None:
    """After a crash or hang, steps since the last checkpoint are redone (by design); data stays exact."""
    final = inspect(str(workdir / "ckpt"))
    assert final["step"] == STEPS and final["data_digest"] == reference["data_digest"]


@pytest.mark.slow  # the chaos set's hang-node scenario covers it too
def test_stopped_node_is_left_behind_after_the_heartbeat_timeout(tmp_path: Path, reference: dict) -> None:
    with make_cluster(tmp_path, "1:2", HANG_ARGS, prefork=False) as cluster:
        survivor, frozen = cluster.start(2).nodes
        wait_for_step(tmp_path, 60, world_size=4)
        frozen.signal_node(signal.SIGSTOP)
        wait_for(lambda: [e for e in node_events(tmp_path, survivor, "resumed") if e["world_size"] == 2], 120,
                 "the survivor to re-form alone")
        frozen.signal_node(signal.SIGKILL)
        assert survivor.wait(timeout=180) == 0, survivor.output()[-4000:]
    assert any(reason.startswith("hang:") and status == 76 for reason, status in exits(tmp_path, survivor))
    check_no_step_redone_after_checkpoint(tmp_path, reference)


@pytest.mark.slow  # 31 s; CI time. ci-mix and crash-worker restart after a failed worker too
def test_crash_in_one_rank_restarts_and_the_summary_names_it(tmp_path: Path, reference: dict) -> None:
    with make_cluster(tmp_path, "1", env={"ELASTIC_DDP_FAULT": "crash:1:70"}) as cluster:
        node = cluster.start(1).nodes[0]
        assert node.wait(timeout=240) == 0, node.output()[-4000:]
        out = node.output()
    crashed = [event for event in events(tmp_path / "logs", "exit") if event["rank"] == 1 and event["reason"] == "error"]
    assert [event["status"] for event in crashed] == [1]
    assert crashed[0]["error"].startswith("InjectedCrash: injected crash on rank 1")
    # the survivor says why it stopped (its connection to rank 1 closed), and the agent restarted the group (which
    # failure torchrun's own line names is a race: the survivor's peer-lost exit often comes before the crash's)
    survivor = [event for event in events(tmp_path / "logs", "exit") if event["rank"] == 0 and event["status"] != 0]
    assert [(event["reason"], event["status"]) for event in survivor] == [("peer-lost", 75)], survivor
    assert re.search(r"failed \(exitcode: (1|75)\) local_rank: [01] \(pid: \d+\)", out), out[-4000:]
    # both ranks resume from the survivor's node memory, at one step between the last commit (50) and the crash
    resumed = resumed_steps(tmp_path / "logs")
    assert set(resumed) == {0, 1} and len(set(resumed.values())) == 1 and 50 < resumed[0] <= 70, resumed
    assert {event["source"] for event in events(tmp_path / "logs", "resumed")} == {"replica"}
    check_no_step_redone_after_checkpoint(tmp_path, reference)


@pytest.mark.slow  # the digest and the majority rule have unit tests
def test_divergence_is_detected_naming_the_rank(tmp_path: Path) -> None:
    args = ("--resilience-consistency-every", "10")
    with make_cluster(tmp_path, "1", args, env={"ELASTIC_DDP_FAULT": "corrupt:1:65"}) as cluster:
        node = cluster.start(1).nodes[0]
        assert node.wait(timeout=240) == 0, node.output()[-4000:]
    diverged = [event for event in events(tmp_path / "logs", "exit") if event["reason"] == "divergence"]
    assert {(event["rank"], event["status"], event["step"]) for event in diverged} == {(0, 77, 70), (1, 77, 70)}
    assert all("step 70: parameters of rank(s) 1 differ from the other ranks'" in event["error"] for event in diverged)
    assert resumed_steps(tmp_path / "logs") == {0: 50, 1: 50}


def test_the_survivor_of_a_crashed_peer_explains_itself_in_one_line_without_a_traceback() -> None:
    """Rank 1 raises in step 5; rank 0's next all-reduce finds the connection closed. Before, rank 0
    printed gloo's raw traceback beside the real cause."""
    from tests.jobs import BASE_ARGS, TORCHRUN, TRAIN, run

    result = run(TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0", TRAIN, *BASE_ARGS, "--max-steps", "50"],
                 timeout=120, env={"ELASTIC_DDP_FAULT": "crash:1:5"})
    assert result.returncode != 0
    rank0 = [line for line in result.output.splitlines() if line.startswith("[rank0]:")]
    assert not any("Traceback" in line for line in rank0), "\n".join(rank0)
    survivor = [line for line in result.output.splitlines() if "/0 " in line and "exit: reason=peer-lost status=75" in line]
    assert len(survivor) == 1 and "a peer left during a collective" in survivor[0], result.output[-3000:]
