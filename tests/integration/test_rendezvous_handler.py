"""torch's DynamicRendezvousHandler on etcd-v3: entry point, ranks, outages, a real torchrun job."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch.distributed.run
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from chaos.cluster import fork_servers, kill_fork_servers
from elastic_ddp import prefork
from elastic_ddp.rendezvous import handler_factory, reach
from elastic_ddp.rendezvous.etcd import EtcdRendezvousHandler
from elastic_ddp.rendezvous.rounds import node_key
from tests.fixtures.etcd_proc import EtcdServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fixtures" / "rdzv_worker.py"


@pytest.fixture(autouse=True)
def _keep_excepthook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler makes torchrun's process print this package's errors in one line; not pytest's."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


def params(endpoint: str, run_id: str, nodes: int, **conf: str) -> RendezvousParameters:
    conf.setdefault("last_call_timeout", "1")
    return RendezvousParameters("etcd-v3", endpoint, run_id, nodes, nodes, local_addr="127.0.0.1", **conf)


def test_entry_point_is_registered_for_torchrun() -> None:
    points = entry_points(group="torchrun.handlers")
    assert "etcd-v3" in points.names, "elastic_ddp is not installed: run `pip install -e . --no-deps`"
    assert points["etcd-v3"].load() is handler_factory


def test_registry_returns_a_handler_on_torchs_public_contract_named_etcd_v3(etcd_server: EtcdServer) -> None:
    handler = get_rendezvous_handler(params(etcd_server.endpoint, "registry", 1))
    assert isinstance(handler, EtcdRendezvousHandler) and isinstance(handler, RendezvousHandler)
    assert handler.get_backend() == "etcd-v3"
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    handler.shutdown()


def test_three_nodes_get_distinct_ranks_and_one_world_size(etcd_server: EtcdServer) -> None:
    run_id = uuid.uuid4().hex[:8]
    outcomes: dict[int, tuple[int, int, str, int]] = {}
    errors: list[BaseException] = []
    all_joined = threading.Barrier(3, timeout=60)

    def node(index: int) -> None:
        try:
            handler = get_rendezvous_handler(params(etcd_server.endpoint, run_id, 3))
            info = handler.next_rendezvous()
            store_info = info.bootstrap_store_info
            outcomes[index] = (info.rank, info.world_size, store_info.master_addr, store_info.master_port)
            all_joined.wait()  # closing before the others saw the round would fail them
            handler.shutdown()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors
    assert sorted(outcome[0] for outcome in outcomes.values()) == [0, 1, 2]
    assert {outcome[1:] for outcome in outcomes.values()} == {next(iter(outcomes.values()))[1:]}
    assert next(iter(outcomes.values()))[1] == 3


HEARTBEAT_EVERY_S = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
"""A peer silent for 2 s leaves the round: for the tests of a peer gone."""


def _two_nodes_in_one_round(endpoint: str, join_timeout: str, **conf: str) -> list[EtcdRendezvousHandler]:
    """Two handlers of a 1:2 job that completed one round together (heartbeats every 60 s unless ``conf`` says)."""
    conf = {"last_call_timeout": "1", "keep_alive_interval": "60", "join_timeout": join_timeout, **conf}
    run_id = uuid.uuid4().hex[:8]
    handlers = [get_rendezvous_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1",
                                                            **conf)) for _ in range(2)]
    sizes: list[int] = []
    threads = [threading.Thread(target=lambda h=h: sizes.append(h.next_rendezvous().world_size)) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sizes == [2, 2]
    return handlers


def test_a_node_that_leaves_lets_the_others_re_form_without_waiting_for_its_heartbeats(etcd_server: EtcdServer) -> None:
    """What an agent ended by SIGTERM does at exit: the survivor's next round is itself alone at
    once, not after the leaver's heartbeats expired (3 minutes here)."""
    leaver, survivor = _two_nodes_in_one_round(etcd_server.endpoint, join_timeout="20")
    leaver.leave()
    assert survivor.next_rendezvous().world_size == 1
    survivor.shutdown()


def test_without_leaving_the_survivor_waits_for_the_departed_node(etcd_server: EtcdServer) -> None:
    """The control: a node that goes silently stays in the round, so the survivor's re-join times out."""
    silent, survivor = _two_nodes_in_one_round(etcd_server.endpoint, join_timeout="4")
    with pytest.raises(RendezvousTimeoutError):
        survivor.next_rendezvous()
    for handler in (silent, survivor):
        handler.shutdown()


def test_a_survivors_poll_counts_a_waiting_node_once_a_peer_of_its_round_stopped_heartbeating(
        etcd_server: EtcdServer) -> None:
    """A peer gone silently (a node frozen or cut off, whose connections stay open) is removed from the round
    by torch's heartbeat rule, but a survivor whose collective blocks instead of failing never restarts for
    it. The survivor's poll counts a waiting node once the peer is removed, so its agent stops the workers
    (whose group watch abandons the blocked step) and re-forms without the peer."""
    silent, survivor = _two_nodes_in_one_round(etcd_server.endpoint, join_timeout="20", **HEARTBEAT_EVERY_S)
    assert survivor.num_nodes_waiting() == 0
    silent._stop_heartbeats()
    silent._listener.close()  # its agent is gone too (a frozen one's would not answer either: tests/unit/test_reach.py)
    stopped = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - stopped < 10, "the survivor's poll never saw its peer gone"
        time.sleep(0.1)
    assert time.monotonic() - stopped < 2 * 1 + 1 + 1  # the heartbeat rule (2 s), a heartbeat's lag, a poll
    assert survivor.next_rendezvous().world_size == 1
    survivor.shutdown()


def test_a_peer_that_lost_only_etcd_is_not_a_waiting_node_until_its_agent_stops_answering(
        etcd_server: EtcdServer) -> None:
    """A peer whose keep-alives no longer reach etcd leaves the round there, but while its agent answers this
    node's probe (it lost etcd, not its peers) the survivor's poll counts no waiting node: its workers train on
    with the peer's. Once the peer's agent stops answering, the poll counts one."""
    cut, survivor = _two_nodes_in_one_round(etcd_server.endpoint, join_timeout="20", **HEARTBEAT_EVERY_S)
    cut._stop_heartbeats()
    stopped = time.monotonic()
    while len(survivor._state_holder.state.participants) == 2:  # the lease expires; the round loses the peer
        assert time.monotonic() - stopped < 10, "the peer never left the round in etcd"
        survivor.num_nodes_waiting()
        time.sleep(0.1)
    for _ in range(20):  # two seconds of the agent's polls: more than one keep_alive_interval
        assert survivor.num_nodes_waiting() == 0, "a peer whose agent answers was counted as waiting"
        time.sleep(0.1)
    cut._listener.close()
    closed = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - closed < 1 + 1 + 1, "the peer's agent stopped answering, and the poll never saw it"
        time.sleep(0.1)
    assert survivor.next_rendezvous().world_size == 1
    survivor.shutdown()


def test_a_peer_that_leaves_while_its_agent_answers_is_a_waiting_node_at_once(etcd_server: EtcdServer) -> None:
    """A node that leaves on purpose (a preempted agent's exit, a step-out) marks its key as leaving before its
    lease goes: the survivor's poll counts a waiting node at once, though the leaver's agent still answers its
    probe (one that lost only etcd would be left to train on)."""
    leaver, survivor = _two_nodes_in_one_round(etcd_server.endpoint, join_timeout="20", **HEARTBEAT_EVERY_S)
    leaver.leave()
    assert reach.answers(reach.parse_address(leaver.member().probe.encode()), timeout=2.0)  # type: ignore[arg-type]
    left = time.monotonic()
    while survivor.num_nodes_waiting() == 0:
        assert time.monotonic() - left < 1, "a peer that left, whose agent answers, was not counted as waiting"
        time.sleep(0.05)
    assert survivor.next_rendezvous().world_size == 1
    survivor.shutdown()
    leaver.shutdown()


def test_a_node_joins_once_its_fork_server_is_warm(etcd_server: EtcdServer) -> None:
    """While this agent's fork server imports (it listens on its warming socket: here the test holds
    that socket), the node does not join; it does at once when the socket closes."""
    handler = get_rendezvous_handler(params(etcd_server.endpoint, uuid.uuid4().hex[:8], 1))
    warming = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    warming.bind(prefork.warming_address(os.getpid()))
    warming.listen(8)
    sizes: queue.Queue[int] = queue.Queue()
    threading.Thread(target=lambda: sizes.put(handler.next_rendezvous().world_size), daemon=True).start()
    try:
        with pytest.raises(queue.Empty):
            sizes.get(timeout=2.0)  # a round of one node would have completed at once
    finally:
        warming.close()
    assert sizes.get(timeout=30) == 1
    handler.shutdown()


def test_next_rendezvous_fails_within_read_timeout_when_etcd_is_down(etcd_server: EtcdServer) -> None:
    handler = get_rendezvous_handler(params(etcd_server.endpoint, "down", 1, read_timeout="2", join_timeout="60"))
    etcd_server.stop()
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=etcd_server.endpoint):
        handler.next_rendezvous()
    assert time.monotonic() - start < 10


def _one_node_in_a_round(endpoint: str) -> EtcdRendezvousHandler:
    """A 1-node job's handler after its first round (read_timeout 30 s, connect_timeout 2 s)."""
    handler = get_rendezvous_handler(params(endpoint, uuid.uuid4().hex[:8], 1, read_timeout="30", join_timeout="90",
                                            connect_timeout="2", keep_alive_interval="60"))
    assert handler.next_rendezvous().world_size == 1
    return handler


def test_the_agents_poll_gives_up_on_a_dead_etcd_within_connect_timeout_not_read_timeout(etcd_server: EtcdServer) -> None:
    """The agent polls num_nodes_waiting while its workers train; a poll that waits out read_timeout holds
    the agent that long after its workers have exited (a job whose etcd is gone as it ends)."""
    handler = _one_node_in_a_round(etcd_server.endpoint)
    etcd_server.kill()
    started = time.monotonic()
    assert handler.num_nodes_waiting() == 0
    assert time.monotonic() - started < 2 + 2


def test_the_agents_poll_does_not_wait_behind_a_heartbeat_stuck_on_etcd(etcd_server: EtcdServer) -> None:
    """A heartbeat holds the handler's lock while its write waits on etcd (up to read_timeout); the poll
    takes the same lock, and gives up on it within connect_timeout."""
    handler = _one_node_in_a_round(etcd_server.endpoint)
    lock = handler._heartbeat_lock  # type: ignore[attr-defined]  # what torch's heartbeat holds during its write
    with lock:
        started = time.monotonic()
        poll = threading.Thread(target=lambda: results.append(handler.num_nodes_waiting()))
        results: list[int] = []
        poll.start()
        poll.join(timeout=30)
        took = time.monotonic() - started
    assert results == [0]
    assert took < 2 + 2


def test_torchrun_with_no_etcd_at_the_endpoint_fails_within_15_s_in_one_line_naming_it(tmp_path: Path) -> None:
    """Before: two minutes and more of silence (the first join waited read_timeout, then retried)."""
    from chaos.cluster import free_port

    endpoint = "127.0.0.1:%d" % free_port()
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=etcd-v3",
         "--rdzv-endpoint=%s" % endpoint, "--rdzv-id=closed", str(REPO / "examples" / "train.py"), "--max-steps", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert time.monotonic() - started < 15
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, lines
    assert lines[0].startswith("torchrun: error: etcd-v3: no etcd member answered at %s" % endpoint)


def test_torchs_v2_etcd_backend_on_an_etcd_without_v2_says_to_use_etcd_v3_in_one_line(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
                             "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd_server.endpoint}", "--rdzv-id=v2",
                             str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("torchrun: error:")]
    assert len(errors) == 1 and "use --rdzv-backend=etcd-v3" in errors[0] and "404" in errors[0], result.stderr[-3000:]


def test_the_doctor_says_when_an_etcd_has_no_v2_api_and_which_backend_to_use(etcd_server: EtcdServer) -> None:
    from elastic_ddp.doctor import check_endpoint

    report = check_endpoint(etcd_server.endpoint, timeout_s=5)
    assert report.startswith("OK ") and "this etcd has no v2 API: use --rdzv-backend=etcd-v3" in report, report


def test_a_reversed_node_range_is_one_usage_line_not_a_traceback(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=3:1", "--nproc-per-node=1",
                             "--rdzv-backend=etcd-v3", "--rdzv-endpoint=127.0.0.1:2379", str(script)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "torchrun: error: min_nodes must be > 0 and <= max_nodes, got min_nodes=3, max_nodes=1"], result.stderr[-3000:]


def test_a_first_contact_within_connect_timeout_is_enough(etcd_server: EtcdServer) -> None:
    handler = get_rendezvous_handler(params(etcd_server.endpoint, "contact", 1, connect_timeout="1"))
    assert isinstance(handler, EtcdRendezvousHandler)
    handler.shutdown()


def torchrun(endpoint: str, run_id: str, out_dir: Path, log: Path, share_store: str | None) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", "--monitor-interval=0.5",
        "--rdzv-backend=etcd-v3", "--rdzv-endpoint=%s" % endpoint, "--rdzv-id=%s" % run_id,
        "--rdzv-conf=last_call_timeout=1,join_timeout=120,read_timeout=30",
        "--local-addr=127.0.0.1", str(WORKER), str(out_dir),
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if share_store is not None:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = share_store
    with open(log, "wb") as output:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.parametrize("share_store", [None, "0"], ids=["unset", "asked-to-share"])
def test_two_torchrun_agents_form_a_gloo_job_through_etcd_v3_on_a_store_their_rank_0_worker_hosts(
    etcd_server: EtcdServer,
    tmp_path: Path,
    share_store: str | None,
) -> None:
    """Workers use a TCPStore that rank 0's worker hosts on a port published through the etcd store, not the
    rank-0 agent's long-lived one, whatever TORCH_DISABLE_SHARE_RDZV_TCP_STORE says (torch's handlers read it)."""
    run_id = uuid.uuid4().hex[:8]
    agents = [
        torchrun(etcd_server.endpoint, run_id, tmp_path, tmp_path / ("agent-%d.log" % i), share_store) for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in agents:
            stop_process_group(agent)
    logs = "\n".join((tmp_path / ("agent-%d.log" % i)).read_text(errors="replace")[-3000:] for i in range(2))
    assert [agent.returncode for agent in agents] == [0, 0], logs
    reports = [json.loads((tmp_path / ("rank-%d.json" % rank)).read_text()) for rank in range(2)]
    assert {report["world_size"] for report in reports} == {2}
    assert {report["sum"] for report in reports} == {3.0}
    assert sorted(report["group_rank"] for report in reports) == [0, 1]
    assert {report["use_agent_store"] for report in reports} == {"False"}


def test_a_torchrun_agent_starts_its_fork_server_and_joins_once_it_is_warm(
        etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler in an agent whose command line runs the workers through ``-m elastic_ddp.prefork``
    (torchrun's, here this process's) starts the node's fork server before it joins, rather than
    leaving it to the first worker's launcher after the rendezvous, and joins once the server is warm."""
    handler = get_rendezvous_handler(params(etcd_server.endpoint, uuid.uuid4().hex[:8], 1))
    monkeypatch.setattr(sys, "argv", [torch.distributed.run.__file__, "--nnodes=1", "-m", "elastic_ddp.prefork",
                                      str(WORKER), "out"])
    try:
        assert handler.next_rendezvous().world_size == 1
        assert len(fork_servers(os.getpid())) == 1
        assert prefork.wait_until_warm(os.getpid(), timeout=1) is None, "joined while the server still imported"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.connect(prefork.server_address(os.getpid(), str(WORKER)))  # the address the launchers use
        server.close()
    finally:
        handler.shutdown()
        assert not kill_fork_servers(os.getpid()), "the fork server did not die"


def _three_nodes_the_third_cut_off(endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                   cut_off: threading.Event) -> list[EtcdRendezvousHandler]:
    """Three handlers of a 1:3 job (1 s heartbeats and probes). The third's probe listener is closed, so
    nobody reaches it, and while ``cut_off`` is set its probes (made on a thread named ``node-2``, or on one of
    that thread's helpers) fail."""
    conf = {"last_call_timeout": "1", "keep_alive_interval": "1", "join_timeout": "60", "reach_timeout": "1"}
    run_id = uuid.uuid4().hex[:8]
    handlers = [get_rendezvous_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 3,
                                                            local_addr="127.0.0.1", **conf)) for _ in range(3)]
    probe = reach.probe

    def probe_unless_cut_off(addresses, timeout):  # type: ignore[no-untyped-def]
        cut = cut_off.is_set() and threading.current_thread().name.startswith("node-2")  # its own or its helpers'
        return frozenset() if cut else probe(addresses, timeout)

    monkeypatch.setattr(reach, "probe", probe_unless_cut_off)
    handlers[2]._probe_listener().close()  # type: ignore[attr-defined]
    return handlers


def test_a_node_cut_off_from_its_peers_but_not_from_etcd_is_left_out_and_rejoins_when_it_reaches_them(
        etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three agents of a 1:3 job; the third neither reaches the others nor is reached (its probe listener is
    closed, its probes fail) but it heartbeats to etcd. The round leaves it out and the other two re-form at
    world size 2 (without the check they would keep including it); it waits, and once its links are back it
    re-joins the next round, which all three form."""
    cut_off = threading.Event()
    cut_off.set()
    handlers = _three_nodes_the_third_cut_off(etcd_server.endpoint, monkeypatch, cut_off)
    isolated = handlers[2]
    sizes: dict[int, int] = {}

    def join(index: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: sizes.__setitem__(index, handlers[index].next_rendezvous().world_size),
                                  name=f"node-{index}", daemon=True)
        thread.start()
        return thread

    first = [join(index) for index in range(3)]
    for thread in first[:2]:
        thread.join(timeout=60)
    assert sizes == {0: 2, 1: 2}
    assert first[2].is_alive()  # stepped out, waiting to reach the others
    assert handlers[0].num_nodes_waiting() == 0

    cut_off.clear()
    isolated._listener = reach.ProbeListener("127.0.0.1")  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while handlers[0].num_nodes_waiting() == 0:  # the agent's own poll: someone waits for the next round
        assert time.monotonic() < deadline, "the node never re-joined after its links came back"
        time.sleep(0.1)
    second = [join(index) for index in range(2)]
    for thread in [*second, first[2]]:
        thread.join(timeout=60)
    assert sizes == {0: 3, 1: 3, 2: 3}
    for handler in handlers:
        handler.shutdown()


def test_a_node_left_out_waits_for_the_others_even_while_they_are_between_rounds(
        etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The left-out node steps out last: the other two already left the checked round for the next, where
    they wait for it to form. The node must still count them as
    the job's nodes and wait until it reaches them; re-joining at once put it in the next round again, and
    every node paid one more check (a re-formation 15 s late in a three-namespace chaos run)."""
    cut_off = threading.Event()
    cut_off.set()
    handlers = _three_nodes_the_third_cut_off(etcd_server.endpoint, monkeypatch, cut_off)
    isolated = handlers[2]
    others = {handler._this_node for handler in handlers[:2]}  # type: ignore[attr-defined]
    step_out = isolated._step_out  # type: ignore[attr-defined]
    step_outs: list[int] = []

    def step_out_last(left_out: frozenset[int], world_size: int) -> None:
        rounds_ = isolated._rounds  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while not step_outs:  # until the other two left the checked round for the next, and wait there
            joined, _ = rounds_._client.range_prefix(rounds_.join_prefix(1))
            if {kv.key.rsplit(b"/", 1)[-1].decode() for kv in joined} >= {node_key(node) for node in others}:
                break
            assert time.monotonic() < deadline, "the other two never left the checked round"
            time.sleep(0.05)
        step_outs.append(isolated._state_holder.state.round)  # type: ignore[attr-defined]
        step_out(left_out, world_size)

    monkeypatch.setattr(isolated, "_step_out", step_out_last)
    rounds: dict[int, tuple[int, int]] = {}
    closed: list[int] = []

    def join(index: int) -> threading.Thread:
        def run() -> None:
            try:
                info = handlers[index].next_rendezvous()
            except RendezvousClosedError:  # the job ended while it waited
                closed.append(index)
                return
            rounds[index] = (info.world_size, handlers[index]._state_holder.state.round)  # type: ignore[attr-defined]
        thread = threading.Thread(target=run, name=f"node-{index}", daemon=True)
        thread.start()
        return thread

    threads = [join(index) for index in range(3)]
    for thread in threads[:2]:
        thread.join(timeout=60)
    try:
        assert rounds == {0: (2, 1), 1: (2, 1)}, "the other two re-formed only after another round with node 2"
        assert step_outs == [0], "node 2 re-joined while it still could not reach the others"
        assert threads[2].is_alive()  # still waiting to reach them
    finally:
        for handler in handlers:
            handler.shutdown()
    threads[2].join(timeout=30)
    assert closed == [2]
