"""torch's private names that elastic_ddp uses outside the rendezvous, and the torch versions it supports.

torch's dynamic-rendezvous internals have their own module, ``elastic_ddp/rendezvous/_torch_compat.py``
(see :mod:`elastic_ddp._compat` for why). Importing this module checks the names below and raises
:class:`~elastic_ddp._compat.IncompatibleLibraryError` when one is gone.
"""

from __future__ import annotations

import torch

from elastic_ddp._compat import Private, check

SUPPORTED = "torch>=2.13,<2.14"
"""The torch versions elastic_ddp supports: those CI runs (``scripts/setup.sh`` installs 2.13.0).
The etcd-v3 handler relies on torch internals that change between minor releases (2.13's
timezone-aware rendezvous deadlines among them); ``pyproject.toml`` declares the same range."""

REQUIRED = (
    Private(
        name="_foreach_div_",
        used_in="Trainer._divide_gradients_by_global_weight: every gradient divided by the global weight in one call",
    ),
)

check({torch: REQUIRED}, version=torch.__version__, supported=SUPPORTED)

foreach_div_ = torch._foreach_div_
