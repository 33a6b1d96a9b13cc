"""Restart reliability over ``etcd-v3``: consecutive ``kill -9`` of a random worker, each one
followed by a worker-group restart that must form its process group and resume.

The agents run without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` in their environment: the
``etcd-v3`` handler itself gives every attempt a fresh worker store (a new MASTER_PORT), which is
what makes restarts reliable (``elastic_ddp/rendezvous/RESTARTS.md``). The same loop under
torch's default shared agent store is measured, not tested, in ``benchmarks/rendezvous.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chaos.cluster import wait_for
from tests.fixtures.etcd_jobs import (
    FRESH_STORE_ENV,
    Restart,
    committed_step,
    job_args,
    kill_worker,
    make_job,
    wait_for_restart,
)
from tests.fixtures.etcd_proc import EtcdServer
from tests.jobs import AS_A_USER_RUNS_IT, REPO, TORCHRUN, done_event, events, run, train_ok

pytestmark = pytest.mark.integration

NODES = 2
RESTART_TIMEOUT_S = 120


def run_with_kills(etcd_server: EtcdServer, workdir: Path, kills: int, steps: int, seed: int,
                   prefork: bool = False, extra: tuple[str, ...] = ()) -> tuple[list[Restart], str]:
    """Two one-worker nodes over etcd-v3; ``kills`` times: kill a random worker, wait for the
    restart to complete a step, then for it to commit a checkpoint newer than the one it resumed
    from (so every attempt resumes from further on). Returns the restarts and the nodes' logs."""
    job = make_job(workdir, job_args(workdir, steps, *extra, checkpoint_every=10), backend="etcd-v3",
                   endpoint=etcd_server.endpoint, nnodes=str(NODES), nproc=1, max_restarts=kills + 5,
                   unset=(FRESH_STORE_ENV,), prefork=prefork)
    rng = random.Random(seed)
    restarts = []
    with job:
        job.start(NODES)
        wait_for(lambda: committed_step(workdir) > 0, 180, "the job's first checkpoint")
        for _ in range(kills):
            _, killed_at, old = kill_worker(job, rng)
            restart = wait_for_restart(job, workdir, killed_at, old, NODES, RESTART_TIMEOUT_S)
            restarts.append(restart)
            wait_for(lambda: committed_step(workdir) >= restart.step, 60, "a checkpoint of step %d or later" % restart.step)
        for node in job.nodes:
            assert node.wait(timeout=300) == 0, node.output()[-4000:]
        output = "\n".join(node.output() for node in job.nodes)
    assert done_event(workdir / "logs")["step"] == steps
    return restarts, output


def check_resumed_further_each_time(workdir: Path, kills: int) -> None:
    """Each restart resumed from a newer checkpoint than the one before (rank 0's resumed events)."""
    resumed = [event["step"] for event in events(workdir / "logs", "resumed") if event["rank"] == 0]
    assert len(resumed) == kills and resumed == sorted(set(resumed)), resumed


def check_fresh_store_per_attempt(workdir: Path, attempts: int) -> None:
    """Every attempt's rank 0 formed its group on a different MASTER_PORT, none of them in the agent's
    long-lived store."""
    formed = [event for event in events(workdir / "logs", "process_group_formed") if event["rank"] == 0]
    stores = [event["store"] for event in formed]
    assert len(stores) >= attempts, stores
    assert len(set(stores)) == len(stores), "a MASTER_PORT was reused across attempts: %s" % stores
    assert not any(event["agent_store"] for event in formed)


@pytest.fixture(scope="module")
def reference_400(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """400 uninterrupted steps at the same world size (2), for a bitwise comparison."""
    logs = tmp_path_factory.mktemp("reference-400")
    train_ok(["--max-steps", "400", "--log-progress", "off", "--log-dir", str(logs)], nproc=NODES)
    return done_event(logs)


@pytest.mark.slow  # CI time; ci-mix and the kill-worker tests restart in CI
def test_three_worker_kills_in_a_row_all_restart_and_end_with_bitwise_equal_weights(
    etcd_server: EtcdServer, tmp_path: Path, reference_400: dict
) -> None:
    restarts, _ = run_with_kills(etcd_server, tmp_path, kills=3, steps=400, seed=5)
    assert len(restarts) == 3
    assert [r.attempts for r in restarts] == [1] * 3, restarts  # every first restart formed its group
    check_resumed_further_each_time(tmp_path, kills=3)
    check_fresh_store_per_attempt(tmp_path, attempts=4)
    assert done_event(tmp_path / "logs")["model_digest"] == reference_400["model_digest"]


@pytest.mark.slow  # CI time; the chaos tests restart prefork workers in CI
def test_prefork_workers_restart_from_the_fork_server_and_end_with_bitwise_equal_weights(
    etcd_server: EtcdServer, tmp_path: Path, reference_400: dict
) -> None:
    """``-m elastic_ddp.prefork``: the launcher is what torchrun starts and kill -9 hits, the
    training runs in the fork server's child; kills and restarts behave exactly as without it."""
    restarts, output = run_with_kills(etcd_server, tmp_path, kills=3, steps=400, seed=3, prefork=True)
    assert [r.attempts for r in restarts] == [1] * 3, restarts
    assert "elastic_ddp.prefork" not in output  # the launcher logs only when it had to run a worker itself
    check_resumed_further_each_time(tmp_path, kills=3)
    assert done_event(tmp_path / "logs")["model_digest"] == reference_400["model_digest"]


@pytest.mark.slow  # CI time; keyed streams' bitwise resume is unit-tested (test_rng_keyed.py), rescues restart in CI
def test_a_run_with_dropout_restarts_from_the_survivor_s_rescue_and_ends_bitwise_equal_to_an_uninterrupted_run(
    etcd_server: EtcdServer, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Dropout draws at every step. The RNG streams are keyed by step, so the survivor of a kill keeps its live
    state, the restart resumes from it (the lost rank's streams re-derived, as every rank's are at each step),
    and the weights still equal an uninterrupted run's bit for bit."""
    dropout = ("--model-dropout", "0.1")
    logs = tmp_path_factory.mktemp("reference-dropout")
    train_ok(["--max-steps", "200", "--log-progress", "off", "--log-dir", str(logs), *dropout], nproc=NODES)
    _, output = run_with_kills(etcd_server, tmp_path, kills=1, steps=200, seed=7, extra=dropout)
    rescues = [event for event in events(tmp_path / "logs", "replica_saved") if event["reason"] == "rescue"]
    assert rescues, output[-3000:]
    (resumed,) = [event for event in events(tmp_path / "logs", "resumed") if event["rank"] == 0]
    assert resumed["source"] == "replica" and resumed["step"] == max(event["step"] for event in rescues), resumed
    assert not resumed["rank_state_reused"], resumed  # the rescue holds no rank's streams: each re-derived its own
    assert done_event(tmp_path / "logs")["model_digest"] == done_event(logs)["model_digest"]


@pytest.mark.slow
def test_thirty_worker_kills_in_a_row_all_restart_and_finish(etcd_server: EtcdServer, tmp_path: Path) -> None:
    restarts, _ = run_with_kills(etcd_server, tmp_path, kills=30, steps=2000, seed=30)
    assert len(restarts) == 30
    assert [r.attempts for r in restarts] == [1] * 30, restarts
    check_resumed_further_each_time(tmp_path, kills=30)
    check_fresh_store_per_attempt(tmp_path, attempts=31)


def test_a_standalone_restart_in_torchrun_s_own_store_forms_its_group_quietly() -> None:
    """``torchrun --standalone`` as a user types it shares the agent's long-lived store across attempts; each
    attempt's keys are kept apart, so a restart whose rank 1 starts late does not meet the failed attempt's
    addresses (it did: rank 0 dialled the dead rank 1, or both waited for gloo's connect timeout), and nothing
    asks the user to set a variable."""
    script = str(REPO / "tests" / "fixtures" / "slow_first_rank_restart.py")
    result = run([*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", script],
                 timeout=120, unset=AS_A_USER_RUNS_IT)
    assert result.returncode == 0, result.output[-4000:]
    assert not [line for line in result.output.splitlines() if "share torchrun's long-lived agent store" in line]


@pytest.mark.slow  # each attempt compiles (tens of seconds on 2 cores); test_lm.py's compiled resume runs in CI
def test_a_compiled_run_restarts_from_the_survivor_s_rescue(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """--compile leaves the module, and so the live state the survivor keeps and the replicas, as without it."""
    _, output = run_with_kills(etcd_server, tmp_path, kills=1, steps=300, seed=11, extra=("--compile",))
    rescues = [event for event in events(tmp_path / "logs", "replica_saved") if event["reason"] == "rescue"]
    assert rescues, output[-3000:]
    (resumed,) = [event for event in events(tmp_path / "logs", "resumed") if event["rank"] == 0]
    assert resumed["source"] == "replica", resumed
