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
from contextlib import ExitStack
from typing import Any

from elastic_ddp.build import Built
from elastic_ddp.config import TrainConfig
from elastic_ddp.distributed import LaunchEnv, distributed
from elastic_ddp.events import EventLog
from elastic_ddp.logs import setup_logging
from elastic_ddp.membership import in_process_launch
from elastic_ddp.runtime import Runtime, announce_process_group, exit_in_one_line, exit_unhandled, failure_reason
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
    runtime: Runtime | None = None
    try:
        with ExitStack() as group:
            launched, built = None, None
            if in_process_launch():  # the etcd-v3 handler's in-process mode: the workers form their membership
                from elastic_ddp.inprocess import in_process_distributed, joining_launch  # the etcd client, if asked

                if joining_launch():  # built before it joins, as the members train on (no group to use yet)
                    seed_rng_streams(config.seed)
                    built = build(config)
                context, launched = group.enter_context(in_process_distributed(config.dist, env))
                events.rank = context.rank
            else:
                context = group.enter_context(distributed(config.dist, env))
            announce_process_group(events, context.world_size, context.backend, env)
            if built is None:
                seed_rng_streams(config.seed)  # identical initial weights on every rank
                built = build(config)
            trainer = Trainer(config, context, built, log_context=log, events=events, launched=launched)
            with trainer.make_runtime() as runtime:
                trainer.run(runtime)
        assert runtime.exit_status is not None
        return runtime.exit_status
    except Exception as exc:
        reason = failure_reason(exc)
        if reason is None:
            if runtime is None:  # the runtime writes the exit event of an error that crossed it
                exit_unhandled(events, exc)
            raise
        return exit_in_one_line(reason, str(exc), events)
    finally:
        events.close()
        log.close()
