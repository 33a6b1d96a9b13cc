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
from elastic_ddp.distributed import LaunchEnv, distributed, shares_agent_store
from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.events import Event, EventLog
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
    run_id = config.run_id or env.run_id
    log = setup_logging(run_id, env.rank, config.log.level, config.log.dir, config.log.per_rank_files)
    events = EventLog(config.log.dir, run_id=run_id, rank=env.rank)
    try:
        with distributed(config.dist, env) as context:
            events.emit(Event.PROCESS_GROUP_FORMED, world_size=context.world_size, backend=context.backend,
                        store=f"{env.master_addr}:{env.master_port}", agent_store=shares_agent_store(),
                        restart_count=env.restart_count)
            seed_rng_streams(config.seed)  # identical initial weights on every rank
            built = build(config)
            trainer = Trainer(config, context, built, log_context=log, events=events)
            try:
                result = trainer.run()
            finally:
                trainer.close()
        code = log_exit(result.reason, result.stop_source or "", events)
        leave_job(result.stop_source)
        return code
    except ElasticDDPError as exc:
        reason = "divergence" if isinstance(exc, DivergenceError) else "error"
        logger.error("%s", exc)
        write_error_file(reason, str(exc))
        return log_exit(reason, events=events, error=str(exc))
    except RuntimeError as exc:
        message = peer_loss(exc)
        if message is None:
            _emit_unexpected_exit(events, exc)
            raise
        logger.error("%s", message)  # the peer's own log has the cause; this rank's traceback adds nothing
        logger.debug("collective failure", exc_info=True)
        write_error_file("peer-lost", message)
        return log_exit("peer-lost", message, events)
    except Exception as exc:
        _emit_unexpected_exit(events, exc)
        raise
    finally:
        events.close()
        log.close()


def _emit_unexpected_exit(events: EventLog, exc: BaseException) -> None:
    """The ``exit`` event of an exception the runtime does not handle: it propagates (the script's ``@record``
    writes the error file, Python exits 1), so this process's last event still says why it ended."""
    events.emit(Event.EXIT, reason="error", status=1, detail="", error=f"{type(exc).__name__}: {exc}")
