"""Train the example MLP with elastic_ddp.

How to run:
  one process (CPU or one GPU):   python examples/train.py --max-steps 100
  one node, 2 processes:          torchrun --standalone --nproc-per-node=2 examples/train.py --max-steps 100
  elastic, etcd v3 rendezvous:    torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 \
                                    --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job1 examples/train.py \
                                    --checkpoint-dir /tmp/ckpt --checkpoint-every 20
  all flags:                      python examples/train.py --help
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from dataset import make_datasets
from elastic_ddp.config import config_from_args
from elastic_ddp.distributed import LaunchEnv, distributed
from elastic_ddp.errors import ElasticDDPError
from elastic_ddp.logs import setup_logging
from elastic_ddp.resilience.consistency import DivergenceError
from elastic_ddp.resilience.exits import log_exit, write_error_file
from elastic_ddp.state import seed_rng_streams
from elastic_ddp.trainer import Trainer
from model import build_model

logger = logging.getLogger("elastic_ddp.examples.train")


@record
def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv, prog="train.py")
    env = LaunchEnv.from_env()
    log = setup_logging(config.run_id or env.run_id, env.rank, config.log.level, config.log.dir, config.log.per_rank_files)
    try:
        with distributed(config.dist, env) as context:
            seed_rng_streams(config.seed)  # identical initial weights on every rank
            train_data, eval_data = make_datasets(config.data, config.model)
            trainer = Trainer(config, context, build_model(config.model), train_data, eval_data=eval_data, log_context=log)
            try:
                result = trainer.run()
            finally:
                trainer.close()
        return log_exit(result.reason)
    except ElasticDDPError as exc:
        reason = "divergence" if isinstance(exc, DivergenceError) else "error"
        logger.error("%s", exc)
        write_error_file(reason, str(exc))
        return log_exit(reason)
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
