"""torch's private names that elastic_ddp uses outside the rendezvous, and the torch versions it supports.

torch's dynamic-rendezvous internals have their own module, ``elastic_ddp/rendezvous/_torch_compat.py``
(see :mod:`elastic_ddp._compat` for why). Importing this module checks the names below and raises
:class:`~elastic_ddp._compat.IncompatibleLibraryError` when one is gone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from elastic_ddp._compat import Private, check, warn_if_untested

SUPPORTED = "torch>=2.13,<2.15"
"""The torch releases elastic_ddp supports: those CI runs (``.ci/run``: the full suite on the 2.13.0 that
``scripts/setup.sh`` installs, a second set on 2.14.1). ``pyproject.toml`` declares the same range."""

TESTED = ((2, 13), (2, 14))
"""The minor releases inside :data:`SUPPORTED`, oldest first."""

REQUIRED = (
    Private(
        name="_foreach_div_",
        used_in="Trainer._divide_gradients_by_global_weight: every gradient divided by the global weight in one call",
    ),
)

check({torch: REQUIRED}, version=torch.__version__, supported=SUPPORTED)
warn_if_untested(torch.__version__, tested=TESTED, supported=SUPPORTED)

foreach_div_ = torch._foreach_div_


def group_abort(group: dist.ProcessGroup) -> Callable[[], None] | None:
    """``group.abort`` where this torch's ``ProcessGroup`` has it (2.13 and 2.14 do; it is public but not
    promised by every build), else None: :func:`elastic_ddp.distributed.abandon_group` then destroys the
    group as before. Aborting ends the group's communicators without the clean shutdown that
    ``destroy_process_group`` attempts, which with NCCL can wait on a peer that is gone."""
    abort = getattr(group, "abort", None)
    return abort if callable(abort) else None
