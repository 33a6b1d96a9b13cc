"""The storage proxy in front of the S3 endpoint: passes bytes, resets connections when down, adds delay.

An in-process echo server stands in for the endpoint (threads, no processes).
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from chaos.s3 import StorageProxy


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[StorageProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    proxy = StorageProxy(server.server_address[1]).start()
    try:
        yield proxy
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()


def round_trip(proxy: StorageProxy, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(payload)
        return sock.recv(4096)


def test_bytes_pass_through_both_ways(proxy: StorageProxy) -> None:
    assert round_trip(proxy) == b"ping"
    assert proxy.endpoint == f"http://127.0.0.1:{proxy.port}"


def test_a_down_proxy_resets_new_connections_until_it_is_up(proxy: StorageProxy) -> None:
    proxy.set_down(True)
    with pytest.raises(OSError):
        answer = round_trip(proxy)
        if not answer:  # a reset may read as end of stream before the error surfaces
            raise ConnectionResetError("closed")
    proxy.set_down(False)
    assert round_trip(proxy) == b"ping"


def test_going_down_resets_open_connections(proxy: StorageProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"one")
        assert sock.recv(4096) == b"one"
        proxy.set_down(True)
        with pytest.raises(OSError):
            sock.sendall(b"two")
            if not sock.recv(4096):
                raise ConnectionResetError("closed")


def test_a_delay_slows_every_chunk_sent(proxy: StorageProxy) -> None:
    proxy.set_delay(0.3)
    started = time.monotonic()
    assert round_trip(proxy) == b"ping"
    assert time.monotonic() - started >= 0.3
    proxy.set_delay(0.0)
    started = time.monotonic()
    assert round_trip(proxy) == b"ping"
    assert time.monotonic() - started < 0.3
