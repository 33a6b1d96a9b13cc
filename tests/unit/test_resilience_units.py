"""Stop requests, the spot-notice poller, the watchdog and the consistency digest, without torchrun."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from elastic_ddp.resilience.consistency import disagreeing_ranks, parameter_digest
from elastic_ddp.resilience.exits import ExitReason, peer_loss
from elastic_ddp.resilience.stop import SpotNoticePoller, StopRequests


def test_sigterm_becomes_a_stop_request_and_a_second_one_acts_as_usual() -> None:
    script = (
        "import os, signal, time\n"
        "from elastic_ddp.resilience.stop import StopRequests\n"
        "stop = StopRequests(); stop.install_signal_handlers()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('reason', stop.reason, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "reason signal:SIGTERM" in result.stdout
    assert result.returncode == -signal.SIGTERM


def test_first_reason_wins() -> None:
    stop = StopRequests()
    stop.request("spot-notice")
    stop.request("signal:SIGTERM")
    assert stop.requested and stop.reason == "spot-notice"


class Metadata(BaseHTTPRequestHandler):
    status = 404
    body = b""

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/notice"
    server.shutdown()
    server.server_close()
    Metadata.status, Metadata.body = 404, b""


@pytest.mark.parametrize(("status", "body", "notice"), [
    (404, b"Not Found", False), (200, b"FALSE", False), (500, b"oops", False),
    (200, b'{"action": "terminate"}', True), (200, b"TRUE", True),
])
def test_poller_reads_aws_and_gcp_answers(metadata_url: str, status: int, body: bytes, notice: bool) -> None:
    Metadata.status, Metadata.body = status, body
    poller = SpotNoticePoller(metadata_url, 1.0, StopRequests())
    assert bool(poller.check()) is notice


def test_poller_raises_the_stop_flag_when_a_notice_appears(metadata_url: str) -> None:
    stop = StopRequests()
    poller = SpotNoticePoller(metadata_url, 0.05, stop).start()
    try:
        assert not stop.requested
        Metadata.status, Metadata.body = 200, b'{"action": "stop"}'
        poller._thread.join(timeout=10)
        assert stop.reason == "spot-notice"
    finally:
        poller.close()


def test_unreachable_metadata_endpoint_is_not_a_notice() -> None:
    poller = SpotNoticePoller("http://127.0.0.1:9/none", 0.5, StopRequests())
    assert poller.check() is None


def test_watchdog_dumps_stacks_and_exits_with_the_hang_status() -> None:
    script = (
        "import time\n"
        "from elastic_ddp.resilience.watchdog import PhaseLimit, Watchdog\n"
        "dog = Watchdog({'collective': PhaseLimit(0.5, 'hang')}, poll_s=0.05).start()\n"
        "dog.enter('collective')\n"
        "time.sleep(30)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitReason.HANG.status
    assert "no progress in phase 'collective'" in result.stderr
    assert "Thread 0x" in result.stderr or "Current thread" in result.stderr


def test_watchdog_leaves_a_progressing_process_alone() -> None:
    from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog

    exits: list[int] = []
    dog = Watchdog({Phase.STEP: PhaseLimit(0.3, "hang")}, poll_s=0.02, exit=exits.append).start()
    try:
        for _ in range(40):
            dog.enter(Phase.STEP)
            threading.Event().wait(0.02)
        dog.enter(Phase.IDLE)  # no limit: may last forever
        threading.Event().wait(0.5)
    finally:
        dog.close()
    assert exits == []


def test_watchdog_ends_a_stuck_phase_in_process_with_its_status() -> None:
    from chaos.cluster import wait_for
    from elastic_ddp.resilience.watchdog import Phase, PhaseLimit, Watchdog

    exits: list[int] = []
    dog = Watchdog({Phase.COLLECTIVE: PhaseLimit(0.2, "hang"), Phase.EMERGENCY_SAVE: PhaseLimit(0.2, "save-deadline")},
                   poll_s=0.02, exit=exits.append).start()
    try:
        dog.enter(Phase.COLLECTIVE)
        wait_for(lambda: exits, 10, "the watchdog to fire")
    finally:
        dog.close()
    assert exits == [ExitReason.HANG.status]


def test_a_phase_name_that_is_not_a_phase_is_an_error_not_a_phase_without_a_limit() -> None:
    from elastic_ddp.resilience.watchdog import PhaseLimit, Watchdog

    with pytest.raises(ValueError, match="colective"):
        Watchdog({"colective": PhaseLimit(1.0, "hang")})
    dog = Watchdog({"collective": PhaseLimit(1.0, "hang")})
    with pytest.raises(ValueError, match="chekpoint"):
        dog.enter("chekpoint")


def test_exit_codes_distinguish_restart_reasons() -> None:
    assert ExitReason.DONE.status == ExitReason.PREEMPTED.status == 0
    assert ExitReason.HANG.status == 76 and ExitReason.HANG.label("collective") == "hang:collective"
    assert ExitReason.CONFIG.status == 2
    failures = [reason for reason in ExitReason if reason not in (ExitReason.DONE, ExitReason.PREEMPTED)]
    assert len({reason.status for reason in failures}) == len(failures)


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234",
    "NCCL error in: ProcessGroupNCCL.cpp:2027, remote process exited or there was a network error, NCCL version "
    "2.27.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "NCCL communicator was aborted on rank 1. Original reason for failure was: [Rank 1] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=60000) ran for 60012 milliseconds",
])
def test_a_lost_peer_is_known_from_words_of_gloo_and_nccl(message: str) -> None:
    assert peer_loss(RuntimeError(message)) is not None
    assert peer_loss(torch.distributed.DistBackendError(message)) is not None


@pytest.mark.parametrize("message", [
    "NCCL communicator was aborted on rank 1. Original reason for failure was: CUDA error: an illegal memory access "
    "was encountered",
    "CUDA error: device-side assert triggered",
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)",
])
def test_a_device_fault_or_a_bug_is_not_a_lost_peer(message: str) -> None:
    assert peer_loss(RuntimeError(message)) is None


def test_parameter_digest_sees_a_single_bit() -> None:
    model = torch.nn.Linear(8, 4)
    before = parameter_digest(model)
    with torch.no_grad():
        bits = model.weight.view(-1).view(torch.int32)
        bits[5] ^= 1
    assert parameter_digest(model) != before


def test_disagreeing_ranks_are_those_outside_the_majority() -> None:
    assert disagreeing_ranks([7, 7, 9, 7]) == [2]
    assert disagreeing_ranks([7, 7, 7]) == []
    assert disagreeing_ranks([1, 2]) == [1]  # a tie: rank 0's digest wins


def test_stop_agreement_spans_the_interval_with_short_steps_and_runs_every_step_with_long_ones() -> None:
    from elastic_ddp.resilience.agreement import agreement_interval

    assert agreement_interval(0.010, 0.25) == 25
    assert agreement_interval(0.100, 0.25) == 3
    assert agreement_interval(0.300, 0.25) == 1
    assert agreement_interval(0.010, 0.0) == 1  # 0: every step
    assert agreement_interval(0.0, 0.25) == 1  # no step time measured yet
    assert agreement_interval(1e-7, 10.0) == 1000  # bounded
