"""torch's private names that the ``etcd-v3`` rendezvous still relies on: torchrun's exit barrier.

The handler (:mod:`elastic_ddp.rendezvous.etcd`) implements torch's public ``RendezvousHandler``
contract and uses no private name of torch's rendezvous. What is left is the exit barrier that
torchrun's agent runs in the agents' store once its workers finish
(``torch.distributed.elastic.utils.store.barrier``): every agent ``add`` s 1 to
``<prefix>/num_members`` and waits for ``<prefix>/last_member``, which the last one to arrive sets.
:class:`~elastic_ddp.rendezvous.store.EtcdStore` recognises those keys, and a node that leaves as the
job ends checks in on its way out. torch names the keys only in private constants, and has no public
call that checks an agent in: so they come from here, checked on import, and raise
:class:`~elastic_ddp._compat.IncompatibleLibraryError` in one line when one changed.

The barrier's prefix is ``torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID``; that
module imports torch's rendezvous package (which loads this package's entry point) before it defines
the name, so it cannot be read here: :data:`elastic_ddp.rendezvous.store.EXIT_BARRIER_PREFIX` restates
it, and ``tests/unit/test_compat.py`` compares the two. Only the rendezvous package imports this module:
see :mod:`elastic_ddp._compat`.
"""

from __future__ import annotations

import torch
from torch.distributed.elastic.utils import store as store_util

from elastic_ddp._compat import Private, check
from elastic_ddp._torch_compat import SUPPORTED

REQUIRED_IN_STORE_UTIL = (
    Private(
        name="_NUM_MEMBERS",
        used_in="store.EXIT_BARRIER_COUNT: the exit barrier's counter, which EtcdStore recognises and a leaving node adds to",
    ),
    Private(
        name="_LAST_MEMBER_CHECKIN",
        used_in="store.EXIT_BARRIER_DONE: the key the last agent at the exit barrier sets",
    ),
)

check({store_util: REQUIRED_IN_STORE_UTIL}, version=torch.__version__, supported=SUPPORTED)

_NUM_MEMBERS = store_util._NUM_MEMBERS
_LAST_MEMBER_CHECKIN = store_util._LAST_MEMBER_CHECKIN
