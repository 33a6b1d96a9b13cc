"""The workers' store connection: a rank waits for rank 0's store to listen, then connects."""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from chaos.cluster import free_port
from elastic_ddp.distributed import (
    KEEP_THE_PROCESS,
    NCCL_ERROR_HANDLING,
    LaunchEnv,
    _open_store,
    keep_the_process_on_nccl_errors,
    nccl_options,
    wait_until_listening,
)

HOST = "127.0.0.1"


def listen_later(port: int, delay_s: float, ready: threading.Event) -> threading.Thread:
    def serve() -> None:
        time.sleep(delay_s)  # the server's late start is the situation under test
        with socket.create_server((HOST, port)) as server:
            ready.set()
            server.settimeout(5)
            server.accept()[0].close()

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_returns_once_the_port_accepts() -> None:
    port, ready = free_port(), threading.Event()
    thread = listen_later(port, 0.1, ready)
    assert wait_until_listening(HOST, port, time.monotonic() + 10)
    assert ready.is_set()
    thread.join()


def test_gives_up_at_the_deadline_when_nothing_listens() -> None:
    port = free_port()
    deadline = time.monotonic() + 0.2
    assert not wait_until_listening(HOST, port, deadline)
    assert time.monotonic() >= deadline - 0.01


def test_a_rank_that_starts_before_rank_0s_store_connects_to_it(monkeypatch) -> None:
    """The probe's bare connection leaves the store serving: the real client then works."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(port))
    env = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr=HOST, master_port=port,
                    run_id="unit", restart_count=0, group_rank=0, under_launcher=True)
    servers: list[dist.TCPStore] = []

    def host_store() -> None:
        time.sleep(0.1)
        servers.append(dist.TCPStore(HOST, port, 2, True, timeout=timedelta(seconds=10)))

    thread = threading.Thread(target=host_store)
    thread.start()
    store = _open_store(env, timedelta(seconds=10))
    thread.join()
    store.set("from-rank-1", b"hello")
    assert servers[0].get("from-rank-1") == b"hello"


def test_abandoning_a_group_that_torch_does_not_let_go_of_returns_at_the_timeout(monkeypatch) -> None:
    from elastic_ddp import distributed

    release = threading.Event()
    monkeypatch.setattr(distributed, "group_abort", lambda group: release.wait)  # an abort that hangs
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        started = time.monotonic()
        assert distributed.abandon_group(timeout_s=0.2) == "stuck"
        assert time.monotonic() - started < 2
    finally:
        release.set()
        deadline = time.monotonic() + 10
        while dist.is_initialized() and time.monotonic() < deadline:  # the abandoning thread destroys it
            time.sleep(0.01)
    assert not dist.is_initialized()


def test_abandoning_without_a_group_does_nothing() -> None:
    from elastic_ddp.distributed import abandon_group

    assert not dist.is_initialized()
    assert abandon_group() == "none"


def test_an_nccl_group_of_the_in_process_mode_keeps_its_process_unless_the_user_chose_otherwise(
        monkeypatch, caplog) -> None:
    """torch's default NCCL error handling ends the process, which would turn every lost peer into a restart."""
    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    assert keep_the_process_on_nccl_errors() == {NCCL_ERROR_HANDLING: KEEP_THE_PROCESS}
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "3")
    with caplog.at_level(logging.WARNING, logger="elastic_ddp.distributed"):
        assert keep_the_process_on_nccl_errors() == {NCCL_ERROR_HANDLING: "3"}
        keep_the_process_on_nccl_errors()
    assert [record.getMessage().split(" ends ")[0] for record in caplog.records] == [f"{NCCL_ERROR_HANDLING}=3"]


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL (the 2.14.1 set runs it)")
def test_an_nccl_group_of_the_in_process_mode_asks_for_non_blocking_communicators() -> None:
    assert nccl_options().config.blocking == 0
