"""Real ``etcd`` processes for scenarios, tests and benchmarks: :mod:`elastic_ddp.launcher.etcd`, plus members in
network namespaces.

Chaos scenarios stop and restart members on purpose; the tests and benchmarks use the same
processes (``tests/fixtures/etcd_proc.py`` re-exports this module)::

    from chaos.etcd import EtcdServer, find_etcd_binary
    server = EtcdServer.create(find_etcd_binary(), Path("/tmp/etcd-data"))
    server.start()
    try:
        print(server.endpoint)      # "127.0.0.1:PORT"
    finally:
        server.stop()

Every server binds only 127.0.0.1, or, given a :class:`~chaos.netns.Fabric`, its own address inside a
network namespace of its own (host ``e<i>``). Ports are picked by the kernel (bind to port 0)
and handed to etcd; if another process grabs one in between, the start is retried
with fresh ports. A server is always stopped by its own pid: SIGTERM, then SIGKILL
when it has not exited within the deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

from chaos.netns import Fabric, call_in, exec_prefix
from elastic_ddp.launcher import etcd as _etcd
from elastic_ddp.launcher.etcd import (  # noqa: F401 - the names tests and benchmarks import from here
    _PORT_RETRIES,
    CLUSTER_TOKEN,
    ETCD_BIN_ENV,
    HOST,
    EtcdProcessError,
    MemberSpec,
    TlsFiles,
    find_etcd_binary,
    free_ports,
    start_with_port_retries,
)

_T = TypeVar("_T")

ETCD_PORTS = (2379, 2380)
"""Client and peer port of a member in a network namespace of its own."""


class EtcdServer(_etcd.EtcdServer):
    """One etcd member process with fixed ports and data directory, in this network namespace or its own.

    ``stop()`` and ``start()`` may alternate: a restarted member keeps its ports and
    its data, so clients holding its endpoint reconnect to the same server.
    """

    @classmethod
    def create(  # type: ignore[override]
        cls, binary: str, data_dir: Path, extra_args: Sequence[str] = (), tls: TlsFiles | None = None,
        fabric: Fabric | None = None,
    ) -> EtcdServer:
        """A single-member server on fresh ports with its data in ``data_dir`` (with a fabric: in host ``e0``,
        on etcd's usual ports, which are free in a namespace of its own)."""
        if fabric is None:
            return super().create(binary, data_dir, extra_args, tls)
        host = fabric.add_host("e0")
        spec = MemberSpec("default", ETCD_PORTS[0], ETCD_PORTS[1], data_dir, tls, host.address, host.namespace)
        return cls.for_spec(binary, spec, extra_args)

    def command_prefix(self) -> list[str]:
        return exec_prefix(self.spec.netns) if self.spec.netns else []

    def in_namespace(self, call: Callable[[], _T]) -> _T:
        return call_in(self.spec.netns, call) if self.spec.netns else call()


class EtcdCluster(_etcd.EtcdCluster):
    """A local multi-member etcd cluster; every member is an :class:`EtcdServer`."""

    member_class = EtcdServer

    @classmethod
    def create(cls, binary: str, base_dir: Path, size: int = 3, extra_args: Sequence[str] = (),
               fabric: Fabric | None = None) -> EtcdCluster:
        """Members ``m0..m{size-1}`` on fresh ports, data under ``base_dir`` (with a fabric: member i in
        host ``e<i>``, on etcd's usual ports)."""
        if fabric is None:
            cluster = super().create(binary, base_dir, size, extra_args)
            assert isinstance(cluster, EtcdCluster)
            return cluster
        hosts = [fabric.add_host("e%d" % i) for i in range(size)]
        specs = [MemberSpec("m%d" % i, *ETCD_PORTS, base_dir / ("m%d" % i), None, host.address, host.namespace)
                 for i, host in enumerate(hosts)]
        token = "%s-%d" % (CLUSTER_TOKEN, ETCD_PORTS[0] + len(fabric.created))  # a token of its own per attempt
        cluster = cls.for_specs(binary, specs, token, extra_args)
        assert isinstance(cluster, EtcdCluster)
        return cluster


def start_etcd(kind: str, base_dir: Path, stack: ExitStack, attempts: int = _PORT_RETRIES,
               fabric: Fabric | None = None) -> EtcdServer | EtcdCluster:
    """Start one member (``kind`` ``embedded``) or a 3-member cluster (``cluster``) on fresh ports under
    ``base_dir``, with :func:`start_with_port_retries`.

    Each attempt is registered on ``stack`` for shutdown before it starts, so an interrupt during the
    start leaves no process behind.
    """
    binary = find_etcd_binary()

    def build(attempt: int) -> EtcdServer | EtcdCluster:
        base = base_dir / ("etcd-%d" % attempt)
        server = (EtcdCluster.create(binary, base, 3, fabric=fabric) if kind == "cluster"
                  else EtcdServer.create(binary, base / "data", fabric=fabric))
        stack.callback(server.stop)
        return server

    started = start_with_port_retries(build, attempts)
    assert isinstance(started, (EtcdServer, EtcdCluster))
    return started
