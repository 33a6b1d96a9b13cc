"""What a script hands the trainer is checked as the parts are made (elastic_ddp.parts): one line naming the fix.
The end-to-end exits (status 2, one line, no checkpoint) are tests/integration/test_mistakes.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from elastic_ddp.build import Built, WeightedLoss
from elastic_ddp.config import TrainConfig
from elastic_ddp.errors import ConfigError
from elastic_ddp.parts import check_losses, make_parts


class NoLoad:
    def state_dict(self) -> dict[str, int]:
        return {}


def built(**changes: object) -> Built:
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    parts = Built(torch.nn.Linear(4, 2), data)
    for name, value in changes.items():
        setattr(parts, name, value)
    return parts


def make(parts: Built) -> None:
    make_parts(TrainConfig(max_steps=10, global_batch_size=8), parts, torch.device("cpu"), rank=0, world_size=1)


@pytest.mark.parametrize(("changes", "named"), [
    ({"optimizer": lambda model: None}, "Built.optimizer returned a NoneType, not a torch.optim.Optimizer"),
    ({"scheduler": lambda optimizer: 42}, "Built.scheduler returned a int when called with the optimizer"),
    ({"state": {"counter": NoLoad()}}, "state['counter'] (a NoLoad) has no load_state_dict()"),
    ({"train_data": TensorDataset(torch.randn(64, 4))}, "items must be (inputs, targets) or (inputs, targets, sample_id)"),
    ({"fingerprint": {"corpus": Path("/data")}}, "fingerprint['build.corpus'] = PosixPath('/data') is not JSON"),
    ({"model": torch.compile(torch.nn.Linear(4, 2))}, "Built.model is compiled (torch.compile): return the module itself "
                                                      "and pass --compile"),
    ({"model": lambda x: x}, "Built.model must be a torch.nn.Module; build returned a function"),
    ({"train_data": [{"x": torch.ones(4), "label": 0}] * 64}, "item 0 is a dict: return the model's inputs and the targets"),
])
def test_a_part_of_the_wrong_kind_is_refused_naming_it(changes: dict, named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        make(built(**changes))
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_every_documented_scheduler_form_is_accepted() -> None:
    for scheduler in (lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 5),
                      lambda optimizer: (lambda step: 0.5 ** (step // 5)),
                      lambda step: 0.5 ** (step // 5)):
        make(built(scheduler=scheduler))


@pytest.mark.parametrize(("losses", "named"), [
    (torch.tensor(1.0), 'returned a scalar for a micro-batch of 4 samples: return per-sample losses (reduction="none")'),
    (torch.ones(4, 3), "returned shape [4, 3] for a micro-batch of 4 samples; expected [4]"),
    (torch.ones(3), "returned shape [3] for a micro-batch of 4 samples; expected [4]"),
    (1.5, "Built.loss_fn returned a float"),
])
def test_a_loss_that_is_not_one_value_per_sample_is_refused(losses: object, named: str) -> None:
    with pytest.raises(ConfigError, match=None) as refused:
        check_losses(losses, 4)
    assert named in str(refused.value)


def test_per_sample_losses_and_a_weighted_loss_pass() -> None:
    check_losses(F.cross_entropy(torch.randn(4, 2), torch.zeros(4, dtype=torch.long), reduction="none"), 4)
    check_losses(WeightedLoss(torch.tensor(0.5), 12.0), 4)
