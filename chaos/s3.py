"""An S3 endpoint on 127.0.0.1 for chaos scenarios, and a proxy in front of it that fails or slows it.

:class:`MotoServer` is moto's S3 server in a subprocess of its own session (the tests use it
too, through ``tests/fixtures/s3_proc.py``), serving one request at a time so that conditional
writes (``If-None-Match: *``, the manifest's commit) are atomic as on S3 (see :func:`serve`).
``pause()``/``resume()`` (SIGSTOP/SIGCONT) keep the objects while requests hang. moto keeps objects in memory
only: stopping it loses every checkpoint, which no real outage
does. So the job never talks to moto directly but through a :class:`StorageProxy`, a TCP proxy
on 127.0.0.1 that a fault can switch

- *down* (``storage-outage``): every connection, open or new, is reset, as when an endpoint is
  unreachable; the objects behind it are kept;
- *slow* (``slow-storage``): every chunk a client sends waits ``delay_s`` before it is forwarded.

The runner and the verifier read the bucket directly (:attr:`MotoServer.endpoint`), so their
view is never the fault's.

Run the server alone: ``python -m chaos.s3 127.0.0.1 PORT``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

from chaos.etcd import HOST, free_ports
from chaos.netns import Host, call_in
from chaos.scenario import ChaosError

logger = logging.getLogger(__name__)

BUCKET = "elastic-ddp"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
_POLL_INTERVAL_S = 0.05
_CHUNK = 64 * 1024
_PORT_RETRIES = 3
S3_PORT = 9000
"""The proxy's port in a network namespace of its own."""


class S3ProcessError(ChaosError):
    """The moto server could not be started, or the proxy could not reach it."""


class MotoServer:
    """One moto server process on a fixed port with one bucket."""

    def __init__(self, port: int, log_path: Path, bucket: str = BUCKET) -> None:
        self.port = port
        self.log_path = log_path
        self.bucket = bucket
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    @classmethod
    def create(cls, log_path: Path, bucket: str = BUCKET) -> MotoServer:
        """A server on a port that was free a moment ago (see :func:`start_on_free_port`)."""
        return cls(free_ports(1)[0], log_path, bucket)

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: the ``endpoint_url`` for s3fs/botocore."""
        return "http://%s:%d" % (HOST, self.port)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a client (or a child process) at this server."""
        return client_env(self.endpoint)

    @property
    def pid(self) -> int | None:
        """The process id while the server runs, else ``None``."""
        return self._proc.pid if self._proc is not None and self.running else None

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited (a paused server counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused and self.running

    def start(self, timeout: float = 30.0) -> None:
        """Start the process, wait until it answers, create the bucket."""
        if self.running:
            raise S3ProcessError("moto server on port %d is already running (pid %s)" % (self.port, self.pid))
        self._launch()
        self._wait_ready(time.monotonic() + timeout)
        self._create_bucket()

    def _launch(self) -> None:
        command = [sys.executable, "-m", "chaos.s3", HOST, str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          cwd=Path(__file__).resolve().parents[1])
        self._paused = False
        logger.info("started moto server pid=%d endpoint=%s", self._proc.pid, self.endpoint)

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.running:
                raise S3ProcessError(
                    "moto server exited with %s during startup; log tail:\n%s"
                    % (self._proc.returncode if self._proc else None, self.log_tail())
                )
            if self.answers():
                return
            time.sleep(_POLL_INTERVAL_S)
        raise S3ProcessError(
            "moto server at %s did not answer before the deadline; log tail:\n%s" % (self.endpoint, self.log_tail())
        )

    def answers(self) -> bool:
        """One ``GET /moto-api/`` probe."""
        try:
            with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1.0) as response:
                return response.status == 200
        except OSError:
            return False

    def _create_bucket(self) -> None:
        request = urllib.request.Request("%s/%s" % (self.endpoint, self.bucket), method="PUT")
        with urllib.request.urlopen(request, timeout=5.0) as response:
            if response.status != 200:
                raise S3ProcessError("creating bucket %s answered HTTP %d" % (self.bucket, response.status))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process (SIGKILL at the deadline) and reap it; its objects are gone."""
        if not self.running:
            return
        assert self._proc is not None
        self.resume()
        self._signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self._proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the port stays open, requests hang, objects are kept."""
        if self.running and not self._paused:
            self._signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.paused:
            self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, signum: int) -> None:
        assert self._proc is not None
        logger.info("sending %s to moto server pid=%d", signal.Signals(signum).name, self._proc.pid)
        os.kill(self._proc.pid, signum)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log file."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def start_on_free_port(log_path: Path, retries: int = _PORT_RETRIES, stack: ExitStack | None = None) -> MotoServer:
    """A started server; picks a fresh port and tries again when another process took the first one.

    With ``stack``, each attempt is registered on it for shutdown before it starts, so an
    interrupt during the start leaves no process behind.
    """
    last_error: S3ProcessError | None = None
    for _ in range(retries):
        server = MotoServer.create(log_path)
        if stack is not None:
            stack.callback(server.stop)
        try:
            server.start()
            return server
        except S3ProcessError as exc:
            server.stop()
            last_error = exc
    raise S3ProcessError("moto server did not start in %d attempts: %s" % (retries, last_error))


def client_env(endpoint: str) -> dict[str, str]:
    """The AWS environment of a process that reaches ``endpoint`` with the test credentials and
    never reads the host's own AWS configuration."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


def storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec options for ``s3://`` URIs at ``endpoint`` (``--checkpoint-storage-options``)."""
    return {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}


class StorageProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``: passes, resets (down) or delays bytes.

    One thread accepts; each connection gets two pump threads. :meth:`close` stops them all.
    """

    def __init__(self, upstream_port: int, host: Host | None = None) -> None:
        self.upstream_port = upstream_port
        self.host = HOST if host is None else host.address
        """Where clients reach it: 127.0.0.1, or the address of a fabric host (``s3``): its listening socket
        is made inside that host's network namespace; its connections to moto stay on 127.0.0.1."""
        if host is None:
            self._listener = socket.create_server((HOST, 0))
        else:
            self._listener = call_in(host.namespace, lambda: socket.create_server((host.address, S3_PORT)))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._down = False
        self._delay_s = 0.0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="storage-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        """``http://HOST:PORT`` of the proxy: what the job's nodes use."""
        return "http://%s:%d" % (self.host, self.port)

    def start(self) -> StorageProxy:
        self._thread.start()
        return self

    def set_down(self, down: bool) -> None:
        """Down: reset every open connection and every new one until set up again."""
        with self._lock:
            self._down = down
            doomed = list(self._connections) if down else []
        for sock in doomed:
            _reset(sock)
        logger.info("storage proxy %s is %s", self.endpoint, "down" if down else "up")

    def set_delay(self, seconds: float) -> None:
        """Delay every chunk a client sends by ``seconds`` (0: no delay)."""
        self._delay_s = seconds
        logger.info("storage proxy %s adds %.2f s per chunk", self.endpoint, seconds)

    def close(self) -> None:
        """Stop accepting, reset every connection, join the accept thread."""
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            doomed = list(self._connections)
        for sock in doomed:
            _reset(sock)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener was closed by close()
                return
            if self._down:
                _reset(client)
                continue
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection((HOST, self.upstream_port), timeout=5)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self._connections.update((client, upstream))
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delayed: bool) -> None:
        """Copy bytes until either side closes; then close both."""
        try:
            while chunk := source.recv(_CHUNK):
                if delayed and self._delay_s:
                    time.sleep(self._delay_s)
                sink.sendall(chunk)
        except OSError:  # a reset by set_down/close, or a peer that went away: the connection ends
            pass
        finally:
            with self._lock:
                self._connections.discard(source)
                self._connections.discard(sink)
            for sock in (source, sink):
                _close_quietly(sock)


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as an unreachable endpoint's connection ends."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    _close_quietly(sock)


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _exit(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def serve(host: str, port: int) -> None:
    """moto's server, one request at a time.

    ``moto_server`` serves each request in its own thread, and moto checks ``If-None-Match: *``
    and stores the object as two separate steps: two conditional PUTs racing for one key can
    both succeed (about 1 race in 300 here), which real S3 never allows. The commit protocol's
    tests race exactly such PUTs, so this endpoint serves requests one after the other, which
    makes its conditional writes atomic like S3's. Everything else is moto's own server.
    """
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    signal.signal(signal.SIGTERM, _exit)
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, app, threaded=False, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
