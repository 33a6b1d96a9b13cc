"""A local multi-node cluster for fault scenarios: :mod:`elastic_ddp.launcher.nodes`, plus nodes in network namespaces.

The nodes, their process groups and how they are stopped are the launcher's (``elastic-ddp launch``
starts the same nodes): each node's agent runs in its own session, and torchrun starts each worker
in a session of its own too, so :meth:`Node.signal_node` kills, stops or preempts a node as a whole —
agent, workers and their DataLoader processes together — the way a machine goes away.
:meth:`LocalCluster.close` stops every process it started, by process group and pid, on every exit
path (use it as a context manager; Ctrl-C included). Scenario nodes do not take the launcher's
parent-death signal: faults add nodes from threads of their own.

With a :class:`~chaos.netns.Fabric` every node runs in a network namespace of its own (host ``n<i>``, its
own address on the harness's bridge, gloo bound to its ``eth0``) and rendezvous through etcd-v3 only, so
network faults can cut, slow or thin its links; the agent's ``--local-addr`` (hence the workers'
``MASTER_ADDR``) is that address.

chaos imports the runtime's launcher; the runtime never imports this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from chaos.netns import IFNAME, Fabric, exec_prefix
from elastic_ddp.launcher import nodes as _nodes
from elastic_ddp.launcher.nodes import (  # noqa: F401 - the names scenarios, tests and benchmarks import from here
    HOST,
    REPLICA_DIR_ENV,
    SHARD_CACHE_DIR_ENV,
    JobSpec,
    Node,
    fork_servers,
    free_port,
    kill_fork_servers,
    parent_pid,
    process_alive,
    wait_for,
)


def host_name(node_name: str) -> str:
    """The fabric host of a node: ``node3`` runs in host ``n3`` (namespace ``edp-R-n3``)."""
    return "n" + node_name.removeprefix("node")


class LocalCluster(_nodes.LocalCluster):
    """Start, grow, shrink and stop a job of simulated nodes on this machine, optionally in network namespaces."""

    def __init__(self, spec: JobSpec, workdir: Path, fabric: Fabric | None = None) -> None:
        if fabric is not None and spec.rdzv_backend != "etcd-v3":
            raise ValueError("nodes in network namespaces rendezvous through etcd-v3 (c10d's store lives in node0's agent)")
        super().__init__(spec, workdir)
        self.fabric = fabric
        """With a fabric, every node runs in a network namespace of its own (host ``n<i>``, see :mod:`chaos.netns`)."""

    def node_command(self, name: str, extra_args: Sequence[str]) -> tuple[list[str], dict[str, str], bool]:
        if self.fabric is None:
            return super().node_command(name, extra_args)
        where = self.fabric.add_host(host_name(name))
        command = exec_prefix(where.namespace) + self.spec.torchrun_command(extra_args, local_addr=where.address)
        # the fork server's abstract unix socket belongs to the namespace it binds in: the node's agent starts it
        return command, {"GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}, False
