"""Your model on the trainer path: hand over the parts, elastic_ddp runs the loop.

  torchrun --standalone --nproc-per-node=2 examples/readme/trainer_path.py \
      --max-steps 200 --checkpoint-dir /tmp/trainer-ckpt --checkpoint-every 50 --log-dir /tmp/trainer-logs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import Dataset

from elastic_ddp import Built, TrainConfig, config_from_args, run_training


class Blobs(Dataset):
    """Points around fixed centres, one class per centre: generated, the same on every rank and launch."""

    def __init__(self, count: int, classes: int, seed: int) -> None:
        centres = torch.randn(classes, 16, generator=torch.Generator().manual_seed(0)) * 0.5
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (count,), generator=generator)
        self.points = centres[self.labels] + torch.randn(count, 16, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.points[index], self.labels[index], index  # with the id, every batch is checked against the plan


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    width: int = 64
    """Hidden width."""
    classes: int = 4
    """Number of classes."""
    samples: int = 4096
    """Training samples."""

    def problems(self) -> list[tuple[str, str]]:
        return [("width", "must be >= 1")] if self.width < 1 else []


@dataclass(frozen=True, kw_only=True)
class MyConfig(TrainConfig):
    model: ModelConfig = field(default_factory=ModelConfig)  # --model-width, --model-classes, --model-samples


def build(config: MyConfig) -> Built:
    m = config.model
    return Built(
        model=nn.Sequential(nn.Linear(16, m.width), nn.ReLU(), nn.Linear(m.width, m.classes)),
        train_data=Blobs(m.samples, m.classes, seed=1),
        eval_data=Blobs(512, m.classes, seed=2),  # the default evaluation: accuracy
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        scheduler=lambda step: 0.5 ** (step // 100),  # a multiplier of the learning rate per step
    )


@record
def main(argv: list[str] | None = None) -> int:
    return run_training(config_from_args(argv, config_class=MyConfig), build)


if __name__ == "__main__":
    sys.exit(main())
