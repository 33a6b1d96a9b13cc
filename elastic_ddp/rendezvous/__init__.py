"""etcd v3 rendezvous for torchrun (``--rdzv-backend=etcd-v3``); see :mod:`elastic_ddp.rendezvous.etcd`."""

# Import torch's rendezvous package before any module of this package. Its
# __init__ loads the `torchrun.handlers` entry points, i.e. imports
# elastic_ddp.rendezvous.etcd; had one of our modules triggered that import
# halfway through its own, the entry point would see it half-initialised and torch
# would skip `etcd-v3` with a warning.
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip

from elastic_ddp.rendezvous.errors import (
    EtcdAuthError,
    EtcdConfigError,
    EtcdConnectionError,
    EtcdRendezvousError,
    EtcdStateError,
    EtcdStoreTimeoutError,
)
from elastic_ddp.rendezvous.etcd import (
    BACKEND_NAME,
    EtcdRendezvousHandler,
    create_rdzv_handler,
    create_store,
    handler_factory,
)
from elastic_ddp.rendezvous.settings import EtcdRendezvousSettings
from elastic_ddp.rendezvous.store import EtcdStore

__all__ = [
    "BACKEND_NAME",
    "EtcdAuthError",
    "EtcdConfigError",
    "EtcdConnectionError",
    "EtcdRendezvousError",
    "EtcdRendezvousHandler",
    "EtcdRendezvousSettings",
    "EtcdStateError",
    "EtcdStore",
    "EtcdStoreTimeoutError",
    "create_rdzv_handler",
    "create_store",
    "handler_factory",
]
