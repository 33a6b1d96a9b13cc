"""In-process re-formation on the runtime: when a peer dies, the survivors keep their process, their model and
optimizer, form a membership of two in place (``Runtime.reform``) and go on from the last complete step with
the data an uninterrupted run consumed (three gloo processes on one store; no torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_ddp.data import ElasticSampler
from tests.fixtures.etcd_proc import EtcdServer
from tests.jobs import BASE_ARGS, TORCHRUN, TRAIN, child_env, done_event, events, train_ok

pytestmark = pytest.mark.integration

SHRINK = Path(__file__).resolve().parents[1] / "fixtures" / "inprocess_shrink.py"
STEPS, SAMPLES, BATCH = 12, 120, 12


def _uninterrupted_data_digest() -> str:
    sampler = ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(STEPS):
        sampler.commit(sampler.plan())
    return sampler.data_digest


@pytest.mark.parametrize("dies", [2, 0], ids=["the-last-rank-dies", "rank-0-dies"])
def test_survivors_of_a_lost_peer_agree_on_the_next_membership_and_go_on_in_their_own_process(
        tmp_path: Path, dies: int) -> None:
    """The survivors agree on the next membership through the store (its generation 1, them alone, in their old
    order), form it in place and finish every step in their own process, none redone, with the data an
    uninterrupted run consumed; when rank 0 dies, the old rank 1 becomes rank 0 and writes rank 0's records."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, str(SHRINK), str(rank), str(store.port), str(tmp_path), str(dies)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1, 2)]
    survivors = [rank for rank in (0, 1, 2) if rank != dies]
    try:
        outs = {rank: ranks[rank].communicate(timeout=120) for rank in survivors}
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [9 if rank == dies else 0 for rank in (0, 1, 2)], \
        {rank: err[-3000:] for rank, (_, err) in outs.items()}
    for new_rank, old_rank in enumerate(survivors):
        survivor = json.loads(outs[old_rank][0].strip().splitlines()[-1])
        assert survivor["pid"] == survivor["pid_at_end"] == ranks[old_rank].pid  # the process that started, to the end
        assert survivor["step"] == STEPS and survivor["trained"] == list(range(1, STEPS + 1)), survivor  # none redone
        assert survivor["data_digest"] == _uninterrupted_data_digest()
        assert (survivor["generation"], survivor["rank"]) == (1, new_rank), survivor
        assert survivor["members"] == [f"worker{rank}" for rank in survivors], survivor
        assert survivor["form_s"] is not None and survivor["form_s"] >= 0
        assert 0 <= survivor["agree_s"] <= survivor["next_step_s"], survivor
    (went_on,) = [event for event in events(tmp_path / "logs", "resumed") if event["rank"] == 0]
    assert went_on["pid"] == ranks[survivors[0]].pid, went_on
    assert (went_on["source"], went_on["saved_world_size"], went_on["world_size"]) == ("live", 3, 2), went_on
    assert went_on["step"] in (5, 6), went_on  # the last step every rank completed, or the one the agreement closed


JOIN = Path(__file__).resolve().parents[1] / "fixtures" / "inprocess_join.py"
JOIN_STEPS, JOIN_SAMPLES = 60, 240


def test_a_worker_that_joins_a_running_membership_enters_at_a_step_boundary_and_the_members_keep_their_process(
        tmp_path: Path) -> None:
    """Two members train; a newcomer builds while they do, joins (generation 1, ranked last), and receives the
    members' state of the step where they let it in, over the group: nobody redoes a step, the members keep their
    processes, and all three end with the uninterrupted run's data and one model."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, str(JOIN), str(rank), str(store.port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1, 2)]
    try:
        outs = [process.communicate(timeout=120) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [0, 0, 0], [err[-3000:] for _, err in outs]
    ends = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    sampler = ElasticSampler(JOIN_SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(JOIN_STEPS):
        sampler.commit(sampler.plan())
    joined_at = ends[2]["resumed"]
    assert 5 <= joined_at < JOIN_STEPS, ends[2]
    for rank, (end, process) in enumerate(zip(ends, ranks, strict=True)):
        assert end["pid"] == end["pid_at_end"] == process.pid
        assert (end["generation"], end["rank"], end["world_size"]) == (1, rank, 3), end
        expected = list(range(1, JOIN_STEPS + 1)) if rank < 2 else list(range(joined_at + 1, JOIN_STEPS + 1))
        assert end["step"] == JOIN_STEPS and end["trained"] == expected, end  # none redone, none skipped
        assert end["data_digest"] == sampler.data_digest
    assert len({end["model_digest"] for end in ends}) == 1
    newcomer = [event for event in events(tmp_path / "logs", "resumed") if event["pid"] == ranks[2].pid]
    assert [(event["source"], event["step"], event["saved_world_size"], event["world_size"]) for event in newcomer] == [
        ("replica", joined_at, 2, 3)], newcomer
    assert newcomer[0]["path"].startswith("replica of step"), newcomer  # from a member, over the group


JOIN_LEAVE = Path(__file__).resolve().parents[1] / "fixtures" / "inprocess_join_leave.py"
JOIN_LEAVE_STEPS, JOIN_LEAVE_SAMPLES = 40, 480


def test_a_join_and_a_departure_at_one_step_let_the_joiner_in_first_and_the_leaver_out_after(tmp_path: Path) -> None:
    """Three members train; a newcomer joins, and its generation closes with all three members' watchers in it;
    at the step that agreement carries, rank 2 is preempted (SIGTERM). Every rank goes on in the join's
    membership of four first, then rank 2 leaves at the next agreement and the other three train to the end in
    their own processes, with the uninterrupted run's data and one model (the join's membership held the leaver,
    whose absence failed the group's formation)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, str(JOIN_LEAVE), str(rank), str(store.port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(4)]
    try:
        outs = [process.communicate(timeout=150) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [0, 0, 0, 0], [err[-3000:] for _, err in outs]
    ends = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    leaver, stayers = ends[2], [ends[0], ends[1], ends[3]]
    assert leaver["stopped"] == "preempted" and (leaver["generation"], leaver["world_size"]) == (1, 4), leaver
    assert leaver["trained"] == list(range(1, leaver["step"] + 1)), leaver
    sampler = ElasticSampler(JOIN_LEAVE_SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(JOIN_LEAVE_STEPS):
        sampler.commit(sampler.plan())
    joined_at = ends[3]["trained"][0] - 1
    assert joined_at < leaver["step"] < JOIN_LEAVE_STEPS, (joined_at, leaver)
    for rank, end in zip((0, 1, 2), stayers, strict=True):
        assert end["pid"] == end["pid_at_end"] and end["stopped"] is None, end
        assert (end["generation"], end["rank"], end["world_size"]) == (2, rank, 3), end
        first = 1 if rank < 2 else joined_at + 1
        assert end["step"] == JOIN_LEAVE_STEPS and end["trained"] == list(range(first, JOIN_LEAVE_STEPS + 1)), end
        assert end["data_digest"] == sampler.data_digest
    assert len({end["model_digest"] for end in stayers}) == 1


REPO = Path(__file__).resolve().parents[2]
TORCHRUN_FIXTURE = REPO / "tests" / "fixtures" / "inprocess_torchrun.py"
TORCHRUN_STEPS, TORCHRUN_SAMPLES = 40, 480


def two_in_process_agents(endpoint: str, tmp_path: Path, script: list[str], env: dict[str, str],
                          max_restarts: int, *, nnodes: str = "2", added_once: Path | None = None) -> list[int]:
    """Two one-worker torchrun agents on the etcd-v3 handler with ``in_process=true``, run to their end (node
    ``n``'s script arguments get ``{node}`` replaced by ``n``); their exit statuses, their logs in the message
    of a failing assertion. ``added_once``: a third agent is started once that file exists (``nnodes`` then
    allows it), and its status comes last."""
    run_id = uuid.uuid4().hex[:8]
    agents: list[subprocess.Popen[bytes]] = []

    def start(node: int) -> None:
        with open(tmp_path / f"agent-{node}.log", "wb") as log:
            agents.append(subprocess.Popen(
                [*TORCHRUN, f"--nnodes={nnodes}", "--nproc-per-node=1", f"--max-restarts={max_restarts}",
                 "--monitor-interval=0.5", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
                 f"--rdzv-id={run_id}", "--rdzv-conf=last_call_timeout=1,join_timeout=120,read_timeout=30,in_process=true",
                 "--local-addr=127.0.0.1", *(part.replace("{node}", str(node)) for part in script)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        for node in range(2):
            start(node)
        if added_once is not None:
            deadline = time.monotonic() + 120
            while not added_once.exists() and agents[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # polls for the file the job writes
            start(2)
        for agent in agents:
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return [agent.returncode for agent in agents]


def agent_logs(tmp_path: Path) -> str:
    return "\n".join(log.read_text(errors="replace")[-4000:] for log in sorted(tmp_path.glob("agent-*.log")))


def test_under_torchrun_in_process_mode_the_survivor_of_a_lost_worker_keeps_its_process(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Two torchrun agents on the etcd-v3 handler with ``in_process=true``; node 1's worker dies at step 4. Its
    agent has no restart left and leaves; node 0's worker (its steps last 50 ms, so its agent polls the handler
    several times meanwhile) agrees on a membership of its own, goes on in its
    process and finishes every step with the data an uninterrupted run consumed, and its agent, told of no
    waiting node while the membership lives, ends 0 without waiting for an exit barrier."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ELASTIC_DDP_TEST_DIES="1:4")
    statuses = two_in_process_agents(etcd_server.endpoint, tmp_path, [str(TORCHRUN_FIXTURE), str(tmp_path)], env, 0)
    assert statuses[0] == 0 and statuses[1] != 0, agent_logs(tmp_path)
    (report,) = tmp_path.glob("rank-0-*.json")
    survivor = json.loads(report.read_text())
    assert (tmp_path / "pids-0.txt").read_text().split() == [str(survivor["pid"])]  # never restarted
    sampler = ElasticSampler(TORCHRUN_SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(TORCHRUN_STEPS):
        sampler.commit(sampler.plan())
    assert survivor["step"] == TORCHRUN_STEPS, survivor
    assert [step for step, _ in survivor["trained"]] == list(range(1, TORCHRUN_STEPS + 1)), survivor
    assert survivor["data_digest"] == sampler.data_digest, survivor
    assert (survivor["generation"], survivor["rank"], survivor["world_size"]) == (1, 0, 1), survivor
    assert not list(tmp_path.glob("rank-1-*.json"))
    started = [event for event in events(tmp_path / "logs", "resumed") if event["source"] == "live"]
    assert [event["pid"] for event in started] == [survivor["pid"]], started


def test_under_torchrun_in_process_mode_a_restarted_worker_joins_the_survivor_which_keeps_its_process(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """As above, but node 1's agent has restarts left: the handler finds the survivor's membership going on and
    has node 1's new worker join it (a round of its own for its agent; node rank 1 kept). The survivor lets it in
    at a step boundary and keeps its process; both end at the last step with the uninterrupted run's data, no
    step trained twice by the survivor, and the newcomer starting from the step it was let in at."""
    steps = 100
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ELASTIC_DDP_TEST_DIES="1:4", ELASTIC_DDP_TEST_STEPS=str(steps))
    statuses = two_in_process_agents(etcd_server.endpoint, tmp_path, [str(TORCHRUN_FIXTURE), str(tmp_path)], env, 1)
    assert statuses == [0, 0], agent_logs(tmp_path)
    (survivor_report,) = tmp_path.glob("rank-0-*.json")
    (joiner_report,) = tmp_path.glob("rank-1-*.json")
    survivor, joiner = json.loads(survivor_report.read_text()), json.loads(joiner_report.read_text())
    assert (tmp_path / "pids-0.txt").read_text().split() == [str(survivor["pid"])]  # never restarted
    first, restarted = (int(pid) for pid in (tmp_path / "pids-1.txt").read_text().split())
    assert joiner["pid"] == restarted != first
    sampler = ElasticSampler(TORCHRUN_SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(steps):
        sampler.commit(sampler.plan())
    assert [step for step, _ in survivor["trained"]] == list(range(1, steps + 1)), survivor
    assert 4 <= joiner["resumed"] < steps, joiner
    assert [step for step, _ in joiner["trained"]] == list(range(joiner["resumed"] + 1, steps + 1)), joiner
    for report in (survivor, joiner):
        assert report["step"] == steps and report["data_digest"] == sampler.data_digest, report
        assert report["world_size"] == 2 and report["generation"] >= 1, report
    assert (survivor["rank"], joiner["rank"]) == (0, 1)
    assert survivor["generation"] == joiner["generation"]


def test_under_torchrun_in_process_mode_a_node_added_to_a_running_job_joins_without_stopping_the_members(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """A third agent starts while two train (``--nnodes=2:3``): its handler finds their membership going on and
    its worker joins it under a new node rank; the members let it in at a step boundary in their own processes,
    and all three end at the last step with the uninterrupted run's data."""
    steps = 100
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               ELASTIC_DDP_TEST_STEPS=str(steps), ELASTIC_DDP_TEST_MARK_AT="5")
    statuses = two_in_process_agents(etcd_server.endpoint, tmp_path, [str(TORCHRUN_FIXTURE), str(tmp_path)], env, 0,
                                     nnodes="2:3", added_once=tmp_path / "reached")
    assert statuses == [0, 0, 0], agent_logs(tmp_path)
    reports = {path.name.split("-")[1]: json.loads(path.read_text()) for path in tmp_path.glob("rank-*.json")}
    assert sorted(reports) == ["0", "1", str(1 << 16 | 1)], reports  # the added node's rank: above any round's
    newcomer = reports.pop(str(1 << 16 | 1))
    sampler = ElasticSampler(TORCHRUN_SAMPLES, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    for _ in range(steps):
        sampler.commit(sampler.plan())
    for node, member in reports.items():
        assert (tmp_path / f"pids-{node}.txt").read_text().split() == [str(member["pid"])]  # never restarted
        assert [step for step, _ in member["trained"]] == list(range(1, steps + 1)), member
    assert 5 <= newcomer["resumed"] < steps, newcomer
    assert [step for step, _ in newcomer["trained"]] == list(range(newcomer["resumed"] + 1, steps + 1)), newcomer
    for report in (*reports.values(), newcomer):
        assert report["step"] == steps and report["data_digest"] == sampler.data_digest, report
        assert (report["world_size"], report["generation"]) == (3, 1), report
    assert [reports["0"]["rank"], reports["1"]["rank"], newcomer["rank"]] == [0, 1, 2]


def test_the_trainer_path_under_torchrun_in_process_mode_goes_on_in_the_survivors_process_and_lets_the_restart_in(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """examples/train.py on two torchrun agents with ``in_process=true``; rank 1 raises at its 10th step. Rank 0's
    worker, never restarted, goes on alone from its live state; rank 1's agent restarts its worker, which builds
    and joins the running membership, and the survivor lets it in at a step boundary, handing it the state of
    that step. Both end at step 300 with the data an uninterrupted run consumed."""
    model = ["--model-hidden-dim", "512", "--model-num-layers", "4", "--global-batch-size", "256"]  # ~20 ms steps
    train_ok([*model, "--max-steps", "300", "--checkpoint-dir", str(tmp_path / "ref-ckpt"), "--log-dir",
              str(tmp_path / "ref-logs")])
    env = child_env({"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "ELASTIC_DDP_FAULT": "crash:1:10"})
    script = [TRAIN, *BASE_ARGS, *model, "--max-steps", "300", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--log-dir", str(tmp_path / "logs"), "--checkpoint-replica-dir", str(tmp_path / "node{node}")]
    statuses = two_in_process_agents(etcd_server.endpoint, tmp_path, script, env, 3)
    assert statuses == [0, 0], agent_logs(tmp_path)
    done = done_event(tmp_path / "logs")
    assert done["step"] == 300 and done["data_digest"] == done_event(tmp_path / "ref-logs")["data_digest"], done
    started = events(tmp_path / "logs", "started_fresh")
    assert len(started) == 2, started  # one per launch rank
    survivor = next(event["pid"] for event in started if event["rank"] == 0)
    resumed = events(tmp_path / "logs", "resumed")
    (went_on,) = [event for event in resumed if event["source"] == "live" and event["world_size"] == 1]
    assert went_on["pid"] == survivor and went_on["saved_world_size"] == 2 and went_on["step"] in (9, 10), went_on
    joined = [event for event in resumed if event["pid"] not in (survivor, *(e["pid"] for e in started))]
    assert joined and {event["world_size"] for event in joined} == {2}, resumed
    (let_in,) = [event for event in resumed if event["pid"] == survivor and event["world_size"] == 2]
    assert let_in["step"] == joined[0]["step"] > went_on["step"], resumed
    assert {event["pid"] for event in events(tmp_path / "logs", "done")} == {survivor, joined[0]["pid"]}
