"""Errors of the etcd v3 rendezvous, rooted in :class:`EtcdRendezvousError`.

:class:`EtcdRendezvousError` derives from the runtime's :class:`ElasticDDPError`.

Each class also derives from the torch (or builtin) error that its caller expects,
so torch's ``DynamicRendezvousHandler`` and the elastic agent handle them as their
own: a broken connection is a ``RendezvousConnectionError``, a corrupt state a
``RendezvousStateError``, a bad ``--rdzv-conf`` value a ``ValueError``, a store
wait that ran out of time a ``torch.distributed.DistStoreError``.
"""

from __future__ import annotations

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)

from elastic_ddp.errors import ConfigError, ElasticDDPError


class EtcdRendezvousError(ElasticDDPError, RendezvousError):
    """Base class of every error raised by ``elastic_ddp.rendezvous``."""


class EtcdConfigError(EtcdRendezvousError, ConfigError):
    """A rendezvous option (``--rdzv-endpoint``, ``--rdzv-conf``) is invalid; the message names it."""


class EtcdConnectionError(EtcdRendezvousError, RendezvousConnectionError):
    """No etcd endpoint answered the request in time; the message names every endpoint tried."""


class EtcdAuthError(EtcdConnectionError):
    """etcd refused the credentials or TLS settings, or the user lacks permission on the keys."""


class EtcdLeaseNotFoundError(EtcdRendezvousError):
    """A write named a lease that etcd no longer has (it expired or was revoked)."""


class EtcdStateError(EtcdRendezvousError, RendezvousStateError):
    """The rendezvous state stored in etcd is not one this backend wrote, or is damaged."""


class EtcdStoreTimeoutError(EtcdRendezvousError, DistStoreError):
    """A store ``get``/``wait`` did not see its keys before the store timeout."""


class JobEnded(SystemExit):
    """A worker ended the job as a configuration mistake (:mod:`elastic_ddp.job_end`): this agent ends with that
    worker's status instead of restarting its workers. A ``SystemExit``, not an error of the agent: torch's agent
    and ``launch_agent`` record and re-raise an ``Exception`` as the agent's own failure (traceback and all),
    while a ``SystemExit`` passes through their ``finally`` blocks (workers stopped, rendezvous shut down) and
    ends torchrun with ``code``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(status)
        self.message = message
