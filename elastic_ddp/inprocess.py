"""A worker's membership under torchrun with the etcd-v3 handler's in-process mode (``--rdzv-conf
in_process=true``, a preview): the workers meet on the handler's workers' store in etcd, agree on
generations there (:mod:`elastic_ddp.membership`) and form each generation's group on it, so that the
survivors of a lost peer go on in their own processes (docs/design.md, "In-process recovery").

The handler exports where to meet (``ELASTIC_DDP_MEMBERSHIP``: the endpoint, run id, ``--rdzv-conf``,
this node's address and the agents' round); each round's workers use a namespace of their own
(``round-<n>/``), and the job's current one is named by ``running``.
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


@dataclass
class LaunchedMembership:
    """This worker's membership of the launch, the store it is agreed on and its agreement (watching already).
    Each generation's group meets on a TCPStore its rank 0 hosts (:meth:`group_store`)."""

    store: dist.Store
    generations: Generations
    membership: Membership
    addr: str
    timeout_s: float
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


def in_process_launch() -> bool:
    """Whether this worker runs under the etcd-v3 handler's in-process mode."""
    return bool(os.environ.get(LAUNCH_ENV))


def join_launch(*, backend: str, device: torch.device, timeout_s: float = 60.0,
                last_call_s: float = 0.1) -> LaunchedMembership:
    """Generation 0 of this round's workers (the launch's ranks), its group formed in place of
    ``init_process_group``, and the watcher started.

    Raises:
        KeyError, ValueError: not under the in-process mode, or its environment is malformed.
        MembershipError, DistributedInitError: the workers did not meet within ``timeout_s``.
    """
    spec = json.loads(os.environ[LAUNCH_ENV])
    round_ = int(spec["round"])
    store = create_worker_store(spec, f"round-{round_}/")
    env = LaunchEnv.from_env()
    generations = Generations(store, f"{socket.gethostname()}-{os.getpid()}", host=spec["addr"],
                              last_call_s=last_call_s, timeout_s=timeout_s, watch_poll_s=0.02)
    membership = generations.first(env.rank, env.world_size)
    if membership.rank == 0:
        create_worker_store(spec).set(RUNNING_KEY, str(round_))
    launched = LaunchedMembership(store, generations, membership, spec["addr"], timeout_s)
    form_membership_group(launched.group_store(membership), rank=membership.rank, world_size=membership.world_size,
                          generation=0, backend=backend, device=device, timeout_s=timeout_s, abandoned="none")
    generations.start_watch()
    logger.info("in-process mode: rank %d of %d in round %d's worker membership", membership.rank,
                membership.world_size, round_)
    return launched


@contextmanager
def in_process_distributed(config: DistConfig, env: LaunchEnv) -> Iterator[tuple[DistContext, LaunchedMembership]]:
    """:func:`elastic_ddp.distributed.distributed` for the in-process mode: the device and backend chosen as
    there, generation 0 joined (:func:`join_launch`) and its group formed; at the end the watcher is stopped
    and the group destroyed (a finished run says so first: :meth:`Generations.finish`)."""
    device = select_device(config, env.local_rank)
    backend = select_backend(config, device)
    launched = join_launch(backend=backend, device=device, timeout_s=config.init_timeout_s)
    membership = launched.membership
    try:
        yield DistContext(env=replace(env, rank=membership.rank, world_size=membership.world_size), device=device,
                          backend=backend), launched
    finally:
        launched.generations.close()
        shutdown_distributed()
