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

import sys

from config import MLPConfig
from dataset import make_datasets
from faults import faulty_loss
from model import build_model
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_ddp.config import config_from_args
from elastic_ddp.entry import Built, run_training


def build(config: MLPConfig) -> Built:
    train_data, eval_data = make_datasets(config.data, config.model)
    model = build_model(config.model)
    return Built(model, train_data, eval_data, loss_fn=faulty_loss(model))


@record
def main(argv: list[str] | None = None) -> int:
    return run_training(config_from_args(argv, prog="train.py", config_class=MLPConfig), build)


if __name__ == "__main__":
    sys.exit(main())
