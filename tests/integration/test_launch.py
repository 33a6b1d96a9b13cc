"""``elastic-ddp launch`` (what ``scripts/run.sh`` runs): on one work directory, launched again after it failed,
after it was stopped, after it finished, and after it was already complete; every process it started gone soon
after it is killed with SIGKILL; its console's progress lines while the job trains (scripts/run.sh, no terminal),
its interrupt line, and a configuration mistake's message as its last line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_ddp.lifeline import LAUNCHER_PID_ENV
from tests.jobs import REPO, child_env, events, run

pytestmark = pytest.mark.integration


def command(workdir: Path, max_steps: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "elastic_ddp.cli", "launch", "--nodes", "1:2", "--nproc-per-node", "1",
            "--workdir", str(workdir), *more, "--", str(REPO / "examples" / "train.py"), "--max-steps", str(max_steps),
            "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", "10", "--log-dir", str(workdir / "logs"),
            "--log-every", "10"]


def rank0(workdir: Path, kind: str) -> list[dict]:
    return [event for event in events(workdir / "logs", kind) if event["rank"] == 0]


def stop_after(workdir: Path, max_steps: int, step: int) -> str:
    """Launch, SIGTERM the launcher (Ctrl-C's twin) once rank 0 committed ``step``; its output, once it exited
    with SIGTERM's status."""
    launcher = subprocess.Popen(command(workdir, max_steps), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(event["step"] >= step for event in rank0(workdir, "committed") if (workdir / "logs").exists()):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        output = launcher.communicate(timeout=120)[0]
        assert launcher.returncode == 128 + signal.SIGTERM, output[-3000:]
        return output
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def newest_commit(workdir: Path) -> int:
    return max((event["step"] for event in rank0(workdir, "committed")), default=0)


@pytest.mark.slow  # CI time: .ci/run runs it in its third part (SLOW_SET)
def test_a_launch_goes_on_from_its_work_directory_after_a_failure_a_stop_and_the_end(tmp_path: Path) -> None:
    """Each launch finds what the previous one left (its embedded etcd's data with the rendezvous it closed,
    its node logs, its checkpoints) and trains on from the newest checkpoint; a run already complete resumes
    at its last step, trains nothing and exits 0; each summary shows its own launch only."""
    failed = run(command(tmp_path, 150, "--max-restarts", "0"), env={"ELASTIC_DDP_FAULT": "crash:1:25"}, timeout=300)
    assert failed.returncode != 0, failed.output[-3000:]
    for launch in ("stopped", "finished", "again", "longer"):
        resumes, committed = len(rank0(tmp_path, "resumed")), newest_commit(tmp_path)
        if launch == "stopped":
            output = stop_after(tmp_path, 150, committed + 20)
            assert output.rstrip().splitlines()[-1] == (
                "elastic-ddp launch: interrupted (SIGTERM); every process it started was stopped"), output[-3000:]
            assert "chaos" not in output, output[-3000:]
        else:
            result = run(command(tmp_path, {"finished": 150, "again": 150, "longer": 170}[launch]), timeout=300)
            assert result.returncode == 0, f"{launch}: {result.output[-3000:]}"
        # where the previous launch left it: its newest checkpoint, or a newer replica it left in node memory
        assert rank0(tmp_path, "resumed")[resumes]["step"] >= committed, launch
    assert [event["step"] for event in rank0(tmp_path, "done")][-3:] == [150, 150, 170]
    assert newest_commit(tmp_path) == 170
    summary = result.output[result.output.rindex("node0: exit"):]
    assert summary.rstrip().splitlines()[-1].startswith("elastic-ddp: done at step 170 "), summary
    assert "step 150 " not in summary, summary


# -- every process it started dies with it ------------------------------------------------------


def started_by(launcher: int) -> dict[int, psutil.Process]:
    """Every live process of the launch: the launcher's descendants, and the processes that carry its pid in their
    environment (the fork servers detach from their parent, and their workers are their children)."""
    family = {}
    try:
        family = {child.pid: child for child in psutil.Process(launcher).children(recursive=True)}
    except psutil.NoSuchProcess:
        pass
    for process in psutil.process_iter():
        try:
            if process.pid not in family and process.environ().get(LAUNCHER_PID_ENV) == str(launcher):
                family[process.pid] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return family


def alive(processes: dict[int, psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has ended: it only waits for its new parent to reap it)."""
    running = []
    for process in processes.values():
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            continue
    return running


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def wait_training(launcher: subprocess.Popen, workdir: Path, ranks: int, timeout: float = 180) -> None:
    """Until every rank took its first step (the launcher must still run)."""
    deadline = time.monotonic() + timeout
    while len({event["rank"] for event in events(workdir / "logs", "first_step")} if (workdir / "logs").exists()
               else set()) < ranks:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
        time.sleep(0.2)


def cmdlines(processes: list[psutil.Process]) -> list[str]:
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()))
        except psutil.Error:
            continue
    return lines


@pytest.mark.parametrize("prefork", [True, False], ids=["prefork", "no-prefork"])
def test_every_process_a_launch_started_dies_with_it_when_it_is_killed(tmp_path: Path, prefork: bool) -> None:
    """kill -9 of the launcher while its two nodes train: the agents, the workers (forked by the fork servers, or
    started by torchrun itself with --no-prefork), the fork servers, the DataLoader processes and the embedded
    etcd are all gone within 10 s, although none of them was signalled by anyone but the kernel."""
    more = [] if prefork else ["--no-prefork"]
    launcher = subprocess.Popen(command(tmp_path, 100_000, *more), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    family: dict[int, psutil.Process] = {}
    try:
        wait_training(launcher, tmp_path, ranks=2)
        family = started_by(launcher.pid)
        lines = cmdlines(list(family.values()))
        agents = [line for line in lines if "torch.distributed.run" in line]
        assert len(agents) == 2 and sum("etcd" in line.split()[0] for line in lines) == 1, lines
        workers = [line for line in lines if "examples/train.py" in line and "torch.distributed.run" not in line]
        assert len(workers) >= 2, lines
        if prefork:
            assert any("--serve" in line for line in lines), lines
        launcher.kill()
        launcher.communicate()
        deadline = time.monotonic() + 10
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(family)
        assert not left, f"still running 10 s after kill -9 of the launcher: {cmdlines(left)}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        kill_all(alive(family) + alive(started_by(launcher.pid)))


def test_ctrl_c_stops_every_process_and_says_so_as_elastic_ddp(tmp_path: Path) -> None:
    launcher = subprocess.Popen(command(tmp_path, 100_000), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    family: dict[int, psutil.Process] = {}
    try:
        wait_training(launcher, tmp_path, ranks=2)
        family = started_by(launcher.pid)
        launcher.send_signal(signal.SIGINT)
        output = launcher.communicate(timeout=120)[0]
        assert launcher.returncode == 128 + signal.SIGINT, output[-3000:]
        assert output.rstrip().splitlines()[-1] == (
            "elastic-ddp launch: interrupted (SIGINT); every process it started was stopped"), output[-3000:]
        assert "chaos" not in output, output[-3000:]
        assert not alive(family), cmdlines(alive(family))  # stopped before the launcher returned
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        kill_all(alive(family))


# -- the console --------------------------------------------------------------------------------

PROGRESS_LINE = re.compile(r"^\d\d:\d\d:\d\d step (\d+)/(\d+) \(\d+%\)(?: \| loss [\d.]+ \| [\d.]+ samples/s \| world \d+)?")


def test_run_sh_shows_progress_lines_while_the_job_trains(tmp_path: Path) -> None:
    """scripts/run.sh without a terminal: progress lines of rising steps, then each node's exit, then the end; the
    lines' steps are ones rank 0 trained, and they came before the job's end (its done event's step is the last)."""
    steps = 1500
    result = run(["scripts/run.sh", "--max-steps", str(steps), "--eval-every", "500"], timeout=300,
                 env={"SETUP": "0", "RUNS": str(tmp_path), "PROGRESS_EVERY": "1"})
    assert result.returncode == 0, result.output[-3000:]
    lines = result.output.splitlines()
    end = next(index for index, line in enumerate(lines) if line.startswith("node0: exit"))
    progress = [(index, int(match[1]), int(match[2])) for index, line in enumerate(lines)
                if (match := PROGRESS_LINE.match(line))]
    assert all(index < end and total == steps for index, _, total in progress), result.output[-3000:]
    trained = [step for _, step, _ in progress]
    assert trained == sorted(trained) and len(set(trained)) == len(trained), trained
    assert len([step for step in trained if 1 < step < steps]) >= 2, result.output[-3000:]  # while it trained
    assert [event["step"] for event in events(tmp_path / "logs", "done") if event["rank"] == 0] == [steps]
    assert re.fullmatch(rf"elastic-ddp: done at step {steps} \(epoch \d+, loss [\d.]+, accuracy [\d.]+\)", lines[-1]), lines[-3:]
    assert "chaos" not in result.output


MISTAKEN_TRAIN = REPO / "tests" / "fixtures" / "mistaken_train.py"


def test_a_configuration_mistake_is_the_consoles_last_line(tmp_path: Path) -> None:
    """An unused parameter ends the etcd-v3 job at its first step on both nodes: the console says each node's status
    and ends with the message of the workers' exit event, not torchrun's error banner."""
    launch = [sys.executable, "-m", "elastic_ddp.cli", "launch", "--nodes", "2", "--max-restarts", "3", "--workdir",
              str(tmp_path), "--", str(MISTAKEN_TRAIN), "--max-steps", "20", "--log-dir", str(tmp_path / "logs")]
    result = run(launch, env={"MISTAKE": "unused-parameter"}, timeout=300)
    assert result.returncode == 1, result.output[-3000:]
    exits = [event for event in events(tmp_path / "logs", "exit") if event["reason"] == "config"]
    assert exits and all(event["status"] == 2 for event in exits), result.output[-3000:]
    lines = result.output.rstrip().splitlines()
    first = exits[0]
    message = " ".join(line.strip() for line in first["error"].strip().splitlines())
    assert lines[-1] == f"elastic-ddp: rank {first['rank']} ended the job (config, exit status 2): {message}", lines[-4:]
    assert sorted(lines[-3:-1]) == [f"node0: exit 2 ({tmp_path / 'node0.log'})", f"node1: exit 2 ({tmp_path / 'node1.log'})"]
    assert not any(set(line.strip()) == {"="} for line in lines), result.output[-3000:]
