"""The runtime's entry point for a training script: logging, process group, trainer, exit status.

A script builds its model and data and hands over::

    @record
    def main() -> int:
        config = config_from_args(prog="train.py", config_class=MyConfig)
        return run_training(config, build)      # build(config) -> Built(model, train_data, ...)

``Built`` (:mod:`elastic_ddp.build`) may also carry the script's optimizer and LR scheduler
factories, loss, evaluation, extra ``Stateful`` objects and fingerprint entries.

The exit status follows :mod:`elastic_ddp.resilience.exits`, so torchrun's agent restarts,
re-forms or finishes the job as the reason requires; runtime errors are one log line and an
entry in the agent's failure summary, not a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from elastic_ddp.build import Built
from elastic_ddp.config import TrainConfig
from elastic_ddp.distributed import LaunchEnv, distributed
from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.logs import setup_logging
from elastic_ddp.resilience.consistency import DivergenceError
from elastic_ddp.resilience.exits import leave_job, log_exit, peer_loss, write_error_file
from elastic_ddp.state import seed_rng_streams
from elastic_ddp.trainer import Trainer

logger = logging.getLogger(__name__)

BuildFn = Callable[[Any], Built]
"""``build(config)`` for the script's own config class (a TrainConfig subclass)."""

__all__ = ["Built", "BuildFn", "run_training"]


def run_training(config: TrainConfig, build: BuildFn) -> int:
    """Train what ``build(config)`` returns; return the process exit status."""
    env = LaunchEnv.from_env()
    log = setup_logging(config.run_id or env.run_id, env.rank, config.log.level, config.log.dir, config.log.per_rank_files)
    try:
        with distributed(config.dist, env) as context:
            seed_rng_streams(config.seed)  # identical initial weights on every rank
            built = build(config)
            trainer = Trainer(config, context, built, log_context=log)
            try:
                result = trainer.run()
            finally:
                trainer.close()
        code = log_exit(result.reason, result.stop_source or "")
        leave_job(result.stop_source)
        return code
    except ElasticDDPError as exc:
        reason = "divergence" if isinstance(exc, DivergenceError) else "error"
        logger.error("%s", exc)
        write_error_file(reason, str(exc))
        return log_exit(reason)
    except RuntimeError as exc:
        message = peer_loss(exc)
        if message is None:
            raise
        logger.error("%s", message)  # the peer's own log has the cause; this rank's traceback adds nothing
        logger.debug("collective failure", exc_info=True)
        write_error_file("peer-lost", message)
        return log_exit("peer-lost", message)
    finally:
        log.close()
