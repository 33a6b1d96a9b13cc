"""elastic_ddp: a fault-tolerant elastic training runtime for PyTorch DDP.

The public API, one import for both paths::

    # the trainer path: your model, data and loss; the runtime's loop
    from elastic_ddp import Built, TrainConfig, WeightedLoss, config_from_args, run_training

    # the library path: your loop; the runtime around it
    from elastic_ddp import CheckpointConfig, ElasticSampler, Runtime, entrypoint, open_events

Names are imported when first used, so ``import elastic_ddp`` stays cheap (torchrun's agent imports the
package for the ``etcd-v3`` rendezvous backend and needs none of the training runtime).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    # trainer path
    "Built": "elastic_ddp.build",
    "WeightedLoss": "elastic_ddp.build",
    "TrainConfig": "elastic_ddp.config",
    "config_from_args": "elastic_ddp.config",
    "not_fingerprinted": "elastic_ddp.config",
    "run_training": "elastic_ddp.entry",
    # library path
    "Runtime": "elastic_ddp.runtime",
    "entrypoint": "elastic_ddp.runtime",
    "ElasticSampler": "elastic_ddp.data",
    "CheckpointConfig": "elastic_ddp.config",
    "ResilienceConfig": "elastic_ddp.config",
    "open_events": "elastic_ddp.loop",
    "init_process_group": "elastic_ddp.loop",
    "shutdown_process_group": "elastic_ddp.loop",
    "DistConfig": "elastic_ddp.config",
    "MetricsWriter": "elastic_ddp.metrics",
    "Decision": "elastic_ddp.resilience.agreement",
    # both
    "ExitReason": "elastic_ddp.resilience.exits",
    "ElasticDDPError": "elastic_ddp.errors",
    "ConfigError": "elastic_ddp.errors",
    "CheckpointError": "elastic_ddp.errors",
}

__all__ = [  # the names _WHERE maps (tests/unit/test_layers.py checks the two agree)
    "__version__", "Built", "CheckpointConfig", "CheckpointError", "ConfigError", "Decision", "DistConfig",
    "ElasticDDPError", "ElasticSampler", "ExitReason", "MetricsWriter", "ResilienceConfig", "Runtime", "TrainConfig",
    "WeightedLoss", "config_from_args", "entrypoint", "init_process_group", "not_fingerprinted", "open_events",
    "run_training", "shutdown_process_group",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_ddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:
    from elastic_ddp.build import Built, WeightedLoss
    from elastic_ddp.config import (
        CheckpointConfig,
        DistConfig,
        ResilienceConfig,
        TrainConfig,
        config_from_args,
        not_fingerprinted,
    )
    from elastic_ddp.data import ElasticSampler
    from elastic_ddp.entry import run_training
    from elastic_ddp.errors import CheckpointError, ConfigError, ElasticDDPError
    from elastic_ddp.loop import init_process_group, open_events, shutdown_process_group
    from elastic_ddp.metrics import MetricsWriter
    from elastic_ddp.resilience.agreement import Decision
    from elastic_ddp.resilience.exits import ExitReason
    from elastic_ddp.runtime import Runtime, entrypoint
