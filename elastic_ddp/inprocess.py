"""A worker's membership under torchrun with the etcd-v3 handler's in-process mode (``--rdzv-conf
in_process=true``, a preview): the workers meet on the handler's workers' store in etcd, agree on
generations there (:mod:`elastic_ddp.membership`) and form each generation's group on it, so that the
survivors of a lost peer go on in their own processes (docs/design.md, "In-process recovery").

The handler exports where to meet (``ELASTIC_DDP_MEMBERSHIP``: the endpoint, run id, ``--rdzv-conf``,
this node's address and the agents' round); each round's workers use a namespace of their own
(``round-<n>/``), and the job's current one is named by ``running``. A node whose agent starts workers while
that membership goes on (a crashed worker restarted, a node added) is told to join it (``join``, ``node_rank``):
its workers build their model, then enter at a step boundary the members agree on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ddp.config import DistConfig
from elastic_ddp.distributed import (
    DistContext,
    LaunchEnv,
    form_membership_group,
    select_backend,
    select_device,
    shutdown_distributed,
)
from elastic_ddp.membership import LAUNCH_ENV, Generations, Membership
from elastic_ddp.rendezvous.etcd import RUNNING_KEY, create_worker_store

logger = logging.getLogger(__name__)

WATCH_WAIT_S = 0.5
"""Each worker's watcher waits for the next generation on an etcd watch in slices this long (it sees the key at
once; a slice costs a few requests, where polling cost a read every 20 ms per worker)."""


@dataclass
class LaunchedMembership:
    """This worker's membership of the launch, the store it is agreed on and its agreement (watching already).
    Each generation's group meets on a TCPStore its rank 0 hosts (:meth:`group_store`)."""

    store: dist.Store
    generations: Generations
    membership: Membership
    addr: str
    timeout_s: float
    backend: str
    device: torch.device
    joined: bool = False
    """This worker joined a running membership (a restarted or added node's): restore with ``Runtime.join``."""
    node_rank: int | None = None
    """The node rank the handler gave a joiner's node (its agent's own round names every joiner node 0), which its
    replicas name its node by; None: torchrun's ``GROUP_RANK``."""
    hosted: list[dist.TCPStore] = field(default_factory=list)

    def group_store(self, membership: Membership) -> dist.Store:
        """The store ``membership``'s group forms on: rank 0 hosts a fresh TCPStore on this node's address and
        publishes it; the others connect to it."""
        key = f"elastic_ddp/group-stores/{membership.generation}"
        timeout = timedelta(seconds=self.timeout_s)
        if membership.rank == 0:
            server = dist.TCPStore(self.addr, 0, membership.world_size, True, timeout=timeout,
                                   wait_for_workers=False)
            self.hosted.append(server)
            self.store.set(key, f"{self.addr}:{server.port}")
            return server
        self.store.wait([key], timeout)
        host, _, port = self.store.get(key).decode().rpartition(":")
        return dist.TCPStore(host, int(port), membership.world_size, False, timeout=timeout)


def joining_launch() -> bool:
    """Whether this worker's node joins the launch's running membership (a restarted or added node under the
    in-process mode): such a worker builds its model before :func:`join_launch`, as the members train on."""
    spec = os.environ.get(LAUNCH_ENV)
    return bool(spec and json.loads(spec).get("join"))


def join_launch(*, backend: str, device: torch.device, timeout_s: float = 60.0,
                last_call_s: float = 0.1) -> LaunchedMembership:
    """This worker's first membership of the launch, its group formed in place of ``init_process_group``, and
    the watcher started: generation 0 of this round's workers (the launch's ranks), or, on a node that joins
    the running membership (``"join"`` in the handler's spec), the generation its members' watchers agree on
    with it; such a worker then restores through ``Runtime.join`` (``joined``), and its replicas know its node
    by the node rank the handler gave it.

    Raises:
        KeyError, ValueError: not under the in-process mode, or its environment is malformed.
        MembershipError, DistributedInitError: the workers did not meet within ``timeout_s``, or the membership
        to join ended first.
    """
    spec = json.loads(os.environ[LAUNCH_ENV])
    round_, joining = int(spec["round"]), bool(spec.get("join"))
    store = create_worker_store(spec, f"round-{round_}/")
    env = LaunchEnv.from_env()
    generations = Generations(store, f"{socket.gethostname()}-{os.getpid()}", host=spec["addr"],
                              last_call_s=last_call_s, timeout_s=timeout_s, watch_wait_s=WATCH_WAIT_S)
    node_rank = int(spec["node_rank"]) if joining else None
    if joining:
        membership = generations.join("a node's workers joined")
    else:
        membership = generations.first(env.rank, env.world_size)
        if membership.rank == 0:
            create_worker_store(spec).set(RUNNING_KEY, str(round_))
    launched = LaunchedMembership(store, generations, membership, spec["addr"], timeout_s, backend, device,
                                  joined=joining, node_rank=node_rank)
    form_membership_group(launched.group_store(membership), rank=membership.rank, world_size=membership.world_size,
                          generation=membership.generation, backend=backend, device=device, timeout_s=timeout_s,
                          abandoned="none")
    generations.start_watch()
    logger.info("in-process mode: rank %d of %d in round %d's worker membership%s", membership.rank,
                membership.world_size, round_, " (joined at generation %d)" % membership.generation if joining else "")
    return launched


def init_in_process(config: DistConfig, env: LaunchEnv | None = None) -> DistContext:
    """:func:`elastic_ddp.distributed.init_distributed` for the in-process mode: the device and backend chosen
    as there, this worker's first membership joined (:func:`join_launch`) and its group formed; the context's
    rank and world size are the membership's, and ``membership`` is it (give it to the runtime)."""
    env = env or LaunchEnv.from_env()
    device = select_device(config, env.local_rank)
    backend = select_backend(config, device)
    launched = join_launch(backend=backend, device=device, timeout_s=config.init_timeout_s)
    membership = launched.membership
    node_rank = env.group_rank if launched.node_rank is None else launched.node_rank
    return DistContext(env=replace(env, rank=membership.rank, world_size=membership.world_size, group_rank=node_rank),
                       device=device, backend=backend, membership=launched)


@contextmanager
def in_process_distributed(config: DistConfig, env: LaunchEnv) -> Iterator[tuple[DistContext, LaunchedMembership]]:
    """:func:`init_in_process` for the trainer path; at the end the watcher is stopped and the group destroyed
    (a finished run said so first: the runtime's :meth:`Generations.finish`)."""
    context = init_in_process(config, env)
    assert context.membership is not None
    try:
        yield context, context.membership
    finally:
        context.membership.generations.close()
        shutdown_distributed()
