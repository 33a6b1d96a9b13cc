"""elastic_ddp.prefork with real processes: a stand-in agent (tests/fixtures/prefork_agent.py)
starts launchers the way torchrun does, and the launchers' fork server forks the workers."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.cluster import fork_servers, kill_fork_servers, parent_pid, process_alive, wait_for
from elastic_ddp import prefork

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
WORKER = str(FIXTURES / "prefork_worker.py")
REPO = FIXTURES.parents[1]
START_S = 120.0  # the first launch waits for the server to import torch
WAIT_S = 30.0


class Agent:
    """The stand-in agent process and the JSON lines it prints."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(FIXTURES / "prefork_agent.py")], cwd=REPO,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(json.loads(line))

    def start(self, *argv: str, stdin: str = "", env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        """Start a launcher of WORKER with ``argv``; its pid."""
        request = {"argv": [WORKER, *argv], "stdin": stdin, "env": env or {}, "cwd": cwd}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.lines.get(timeout=WAIT_S)["launcher"]

    def result(self, timeout: float = START_S) -> dict:
        return self.lines.get(timeout=timeout)

    def run(self, *argv: str, **kwargs) -> dict:
        self.start(*argv, **kwargs)
        return self.result()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=WAIT_S)


@pytest.fixture
def agent() -> Iterator[Agent]:
    """An agent of its own (its server starts with its first launch)."""
    yield from _agent()


@pytest.fixture(scope="module")
def warm_agent() -> Iterator[Agent]:
    """One agent for the tests of worker behaviour, its server started once."""
    for agent in _agent():
        assert agent.run("exit", "0")["rc"] == 0
        yield agent


def _agent() -> Iterator[Agent]:
    agent = Agent()
    try:
        yield agent
    finally:
        if agent.process.poll() is None:
            agent.process.kill()
            agent.process.wait()
        kill_fork_servers(agent.process.pid)


def report(result: dict) -> dict:
    assert result["rc"] == 0, result["err"]
    return json.loads(result["out"])


def test_workers_after_the_first_are_forked_by_one_server_with_torch_imported(warm_agent: Agent, tmp_path: Path) -> None:
    first = report(warm_agent.run("report", "a b", stdin="line one\n", env={"PREFORK_TEST": "x=1"}, cwd=str(tmp_path)))
    second = report(warm_agent.run("report", "--flag", stdin="line two\n", env={"PREFORK_TEST": "y"}))
    servers = fork_servers(warm_agent.process.pid)
    assert len(servers) == 1
    assert first["ppid"] == second["ppid"] == servers[0]
    assert first["agent"] == second["agent"] == warm_agent.process.pid  # for leaving the job after a spot notice
    assert first["torch_preloaded"] and second["torch_preloaded"]
    assert first["argv"] == [WORKER, "report", "a b"] and second["argv"] == [WORKER, "report", "--flag"]
    assert (first["cwd"], second["cwd"]) == (str(tmp_path), str(REPO))
    assert (first["env"], second["env"]) == ("x=1", "y")
    assert (first["stdin"], second["stdin"]) == ("line one", "line two")


def test_exit_status_is_the_workers(warm_agent: Agent) -> None:
    assert warm_agent.run("exit", "0")["rc"] == 0
    assert warm_agent.run("exit", "75")["rc"] == 75


def test_sigterm_to_the_launcher_reaches_the_worker(warm_agent: Agent, tmp_path: Path) -> None:
    launcher = warm_agent.start("wait", str(tmp_path / "ready"))
    _ready_worker(tmp_path / "ready")
    os.kill(launcher, signal.SIGTERM)
    assert warm_agent.result(WAIT_S)["rc"] == 7  # the worker's SIGTERM handler chose it


def test_sigkill_of_the_launcher_kills_the_worker(warm_agent: Agent, tmp_path: Path) -> None:
    launcher = warm_agent.start("wait", str(tmp_path / "ready"))
    worker = _ready_worker(tmp_path / "ready")
    assert worker != launcher and process_alive(worker)
    os.kill(launcher, signal.SIGKILL)
    assert warm_agent.result(WAIT_S)["rc"] == -signal.SIGKILL
    wait_for(lambda: not process_alive(worker), WAIT_S, f"worker {worker} to die with its launcher")


def test_a_worker_killed_by_a_signal_ends_its_launcher_by_the_same_signal(warm_agent: Agent, tmp_path: Path) -> None:
    warm_agent.start("wait", str(tmp_path / "ready"))
    os.kill(_ready_worker(tmp_path / "ready"), signal.SIGKILL)
    assert warm_agent.result(WAIT_S)["rc"] == -signal.SIGKILL


def test_the_server_exits_with_its_agent(agent: Agent) -> None:
    agent.run("exit", "0")
    servers = fork_servers(agent.process.pid)
    assert len(servers) == 1
    agent.close()
    wait_for(lambda: not process_alive(servers[0]), WAIT_S, "the fork server to exit after its agent")


def test_a_server_that_cannot_preload_leaves_the_launcher_to_run_the_script_itself(agent: Agent) -> None:
    result = agent.run("report", env={"ELASTIC_DDP_PREFORK_PRELOAD": "no_such_module_here"})
    assert "preloading no_such_module_here failed" in result["err"] and "running" in result["err"]
    worker = report(result)
    assert not worker["torch_preloaded"] and worker["ppid"] == worker["agent"] == agent.process.pid  # exec'd


def _ready_worker(path: Path) -> int:
    """The pid a ``wait`` worker wrote to ``path`` once it was ready."""
    wait_for(path.exists, WAIT_S, f"the worker to write {path}")
    return int(path.read_text())


@pytest.fixture
def importing_server(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A fork server for this process as its agent (its pid), whose imports block until ``release``
    exists; it writes ``imported`` when they are done."""
    release, imported = tmp_path / "release", tmp_path / "imported"
    env = {**os.environ, "ELASTIC_DDP_PREFORK_PRELOAD": "tests.fixtures.prefork_gate",
           "PREFORK_GATE_RELEASE": str(release), "PREFORK_GATE_IMPORTED": str(imported)}
    prefork.start_server(os.getpid(), WORKER, env)
    try:
        wait_for(_importing, START_S, "the server to listen while it imports")
        servers = fork_servers(os.getpid())
        assert len(servers) == 1 and parent_pid(servers[0]) != os.getpid(), "the server did not detach from its starter"
        yield servers[0], release, imported
    finally:
        assert not kill_fork_servers(os.getpid()), "the fork server did not die"


def _importing() -> bool:
    """Whether a fork server of this process listens on its warming socket."""
    sock = prefork._connect(prefork.warming_address(os.getpid()))
    if sock is not None:
        sock.close()
    return sock is not None


def test_an_agent_without_an_importing_server_does_not_wait() -> None:
    assert prefork.wait_until_warm(os.getpid(), timeout=WAIT_S) is None


def _waiting_once_connected(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once :func:`prefork.wait_until_warm` holds its connection to the warming socket (before that, a server
    gone would read as none importing)."""
    connected = threading.Event()
    connect = prefork._connect

    def noting(address: str) -> socket.socket | None:
        sock = connect(address)
        if sock is not None:
            connected.set()
        return sock

    monkeypatch.setattr(prefork, "_connect", noting)
    return connected


def test_the_wait_for_a_warm_server_ends_once_its_imports_are_done(importing_server,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, release, imported = importing_server
    connected = _waiting_once_connected(monkeypatch)
    waited: queue.Queue[float | None] = queue.Queue()
    threading.Thread(target=lambda: waited.put(prefork.wait_until_warm(os.getpid(), timeout=START_S)), daemon=True).start()
    assert connected.wait(WAIT_S), "the wait did not reach the importing server"
    with pytest.raises(queue.Empty):
        waited.get(timeout=1.0)  # still importing: the wait goes on
    release.touch()
    assert waited.get(timeout=START_S) > 1.0
    assert imported.exists(), "the wait ended before the server's imports were done"
    assert prefork.wait_until_warm(os.getpid(), timeout=WAIT_S) is None  # warm: no wait any more


def test_the_wait_ends_when_an_importing_server_dies(importing_server, monkeypatch: pytest.MonkeyPatch) -> None:
    server, _, imported = importing_server
    connected = _waiting_once_connected(monkeypatch)
    waited: queue.Queue[float | None] = queue.Queue()
    threading.Thread(target=lambda: waited.put(prefork.wait_until_warm(os.getpid(), timeout=START_S)), daemon=True).start()
    assert connected.wait(WAIT_S), "the wait did not reach the importing server"
    os.kill(server, signal.SIGKILL)
    assert waited.get(timeout=WAIT_S) is not None
    assert not imported.exists()
