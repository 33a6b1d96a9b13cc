"""How an ``etcd-v3`` job ends when something goes wrong as it ends, or while it trains.

- A node preempted (its agent SIGTERMed) just after its workers finished must not hold the other
  nodes in torchrun's exit barrier: they exit 0 within seconds, not after the barrier's 300 s.
- A job whose workers all finished exits 0 even when etcd is gone by then.
- An etcd outage longer than ``read_timeout`` while the job trains does not stop it.
- A configuration mistake ends the job after its first attempt on every node, restarts left or not,
  with the workers' status (2) and the mistake as each agent's last line.

Every job is the example trainer on simulated nodes (``chaos.cluster``) with a real etcd. The
agents' monitor interval is long (2 s) so that a fault aimed between "the workers exited" and "the
agent noticed" lands there: that is the moment each of these used to go wrong. Which step a job
reached is read from its checkpoints (manifests), never from log text.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from chaos.cluster import Node, process_alive, wait_for
from tests.fixtures.etcd_jobs import ETCD_CONF, committed_step, job_args, last_step, make_job, steps_after
from tests.fixtures.etcd_proc import EtcdServer
from tests.jobs import events, inspect

pytestmark = pytest.mark.integration

STEPS = 30
MONITOR_S = 2.0
LINGER_S = 2.5 * MONITOR_S
LINGERING_TRAIN = Path(__file__).resolve().parents[1] / "fixtures" / "lingering_train.py"
MISTAKEN_TRAIN = Path(__file__).resolve().parents[1] / "fixtures" / "mistaken_train.py"
JOB_TIMEOUT_S = 180


def exit_code_within(node: Node, timeout: float) -> int:
    try:
        return node.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("node %s still running %.0f s later:\n%s" % (node.name, timeout, node.output()[-4000:])) from None


def workers_exited(workdir: Path, node: Node) -> bool:
    """The final checkpoint is committed and ``node``'s workers have exited, but its agent has not
    reaped them yet (it does so on its next monitor pass, and then enters the exit barrier)."""
    workers = node.worker_pids()
    return committed_step(workdir) == STEPS and bool(workers) and not any(map(process_alive, workers))


def test_a_node_preempted_as_its_workers_finish_does_not_hold_the_other_node(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    job = make_job(tmp_path, job_args(tmp_path, STEPS, checkpoint_every=STEPS), backend="etcd-v3",
                   endpoint=etcd_server.endpoint, nnodes="2", nproc=1, max_restarts=0)
    job.spec.monitor_interval_s = MONITOR_S
    with job:
        first, second = job.start(2).nodes
        wait_for(lambda: workers_exited(tmp_path, second), JOB_TIMEOUT_S, "node1's workers to exit after the last checkpoint",
                 interval=0.02)
        second.signal_agent(signal.SIGTERM)
        preempted_at = time.monotonic()
        code = exit_code_within(first, 30)
        took = time.monotonic() - preempted_at
        second.wait(timeout=30)
    assert code == 0, first.output()[-4000:]
    assert took < 10, "node0 exited %.1f s after node1 was preempted:\n%s" % (took, first.output()[-3000:])


def test_a_config_mistake_ends_the_job_after_one_attempt_on_every_node(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """torchrun's agent restarts a failed worker group whatever its status: without the job-end record each
    node would fail max_restarts + 1 times with the same mistake."""
    job = make_job(tmp_path, job_args(tmp_path, STEPS), backend="etcd-v3", endpoint=etcd_server.endpoint,
                   nnodes="2", nproc=1, max_restarts=3, env={"MISTAKE": "unused-parameter"})
    job.spec.script = str(MISTAKEN_TRAIN)
    with job:
        nodes = job.start(2).nodes
        codes = [exit_code_within(node, 120) for node in nodes]
    outputs = "\n\n".join(node.output()[-3000:] for node in nodes)
    assert codes == [2, 2], outputs
    exits = [(e["rank"], e["reason"], e["status"]) for e in events(tmp_path / "logs", "exit")]
    assert sorted(exits) == [(0, "config", 2), (1, "config", 2)], exits  # one attempt: one exit per rank
    for node in nodes:
        last = node.output().strip().splitlines()[-1]
        assert last.startswith("torchrun: error: rank ") and "--ddp-find-unused-parameters" in last, node.output()[-3000:]


@pytest.mark.slow  # CI time: the store's unit tests give up the exit barrier when etcd does not answer
def test_a_finished_job_exits_0_when_etcd_is_gone(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """etcd dies after the last checkpoint, while the workers are still exiting: the agents' monitor polls
    (every MONITOR_S) land in that window, where each used to wait out read_timeout before the agent could
    see its workers finish. The workers here linger after the run ends until etcd is dead, and then for
    LINGER_S more, so at least two polls always land there."""
    gate = tmp_path / "etcd-killed"
    job = make_job(tmp_path, job_args(tmp_path, STEPS, checkpoint_every=STEPS), backend="etcd-v3",
                   endpoint=etcd_server.endpoint, nnodes="2", nproc=1, max_restarts=0,
                   conf={**ETCD_CONF, "connect_timeout": "2"},
                   env={"LINGER_GATE": str(gate), "LINGER_S": str(LINGER_S)})
    job.spec.script = str(LINGERING_TRAIN)
    job.spec.monitor_interval_s = MONITOR_S
    with job:
        nodes = job.start(2).nodes
        wait_for(lambda: committed_step(tmp_path) == STEPS, JOB_TIMEOUT_S, "the job's last checkpoint")
        etcd_server.kill()
        gate.touch()
        killed_at = time.monotonic()
        codes = [exit_code_within(node, 60) for node in nodes]
        took = time.monotonic() - killed_at
    assert codes == [0, 0], "\n\n".join(node.output()[-3000:] for node in nodes)
    # read_timeout is 30 s in these jobs: nothing at the end may wait for it. What may: the workers'
    # linger, one poll and the shutdown's probe (connect_timeout each), a monitor interval or two
    assert took < LINGER_S + 14, "the agents exited %.1f s after etcd was killed" % took


@pytest.mark.slow  # 40 s; partition-etcd (slow) shows the same in namespaces, and the default suite neared 15 minutes
def test_an_etcd_outage_longer_than_read_timeout_does_not_stop_a_training_job(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    steps, outage_s = 6000, 8.0  # four read_timeouts; a step takes a few ms, so training outlasts the outage
    conf = {**ETCD_CONF, "read_timeout": "2"}
    args = job_args(tmp_path, steps, "--log-every", "20", checkpoint_every=1000)
    job = make_job(tmp_path, args, backend="etcd-v3", endpoint=etcd_server.endpoint, nnodes="1", nproc=2,
                   max_restarts=0, conf=conf)
    with job:
        node = job.start(1).nodes[0]
        wait_for(lambda: last_step(tmp_path) >= 20, JOB_TIMEOUT_S, "training")
        etcd_server.stop()
        stopped_at = time.time()
        wait_for(lambda: steps_after(tmp_path, stopped_at + outage_s) or not node.running, outage_s + 60,
                 "a step %.0f s into the etcd outage" % outage_s)
        assert node.running, node.output()[-3000:]
        assert last_step(tmp_path) < steps, "the job ended before the outage did; make it longer"
        etcd_server.start()
        code = exit_code_within(node, JOB_TIMEOUT_S)
    assert code == 0, node.output()[-4000:]
    assert inspect(str(tmp_path / "ckpt"))["step"] == steps
