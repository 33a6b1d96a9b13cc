"""What a training script hands the runtime: :class:`Built`.

Only the model and the training data are required; everything else has a default that is the
runtime's own (AdamW from ``--optim-*``, warmup + cosine/linear decay, per-sample cross-entropy,
held-out accuracy). A script replaces any of them without touching the training loop::

    def build(config: MyConfig) -> Built:
        model = GPT(config.model)
        return Built(
            model, train_data, eval_data,
            optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=100),
            loss_fn=my_per_sample_loss,
            evaluate=my_validation,                 # -> {"loss": ..., "perplexity": ...}
            state={"ema": ema},                     # saved and restored with the model
        )

The loss and the exact global-batch mean (docs/design.md, "Data cursor"):

* A loss that returns **per-sample losses** (shape ``[n]``, no reduction) is summed on each
  rank and scaled by ``world_size / global_batch``; DDP averages gradients over ranks, so the
  gradient is exactly that of the mean over the step's global batch, however unequally the
  samples are split among ranks and micro-batches. No extra collective.
* A loss that returns :class:`WeightedLoss` ``(mean, weight)`` — a mean over ``weight`` units,
  e.g. the non-padding tokens of the micro-batch — is turned into its sum ``mean * weight``
  and scaled by ``world_size``; after the step's backward passes, one all-reduce of the
  weights gives the global total ``W``, and the gradients are divided by ``W``. The gradient is
  exactly that of the mean over every unit of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from elastic_ddp.batch import collate, to_device
from elastic_ddp.errors import ConfigError
from elastic_ddp.state import Stateful


@dataclass(frozen=True)
class WeightedLoss:
    """A loss averaged over ``weight`` units (tokens, pixels, ...) of one micro-batch."""

    mean: torch.Tensor
    """Scalar mean over the micro-batch's units."""
    weight: torch.Tensor | float
    """How many units the mean is over (0 for an empty micro-batch)."""


LossFn = Callable[[Any, Any], torch.Tensor | WeightedLoss]
"""(outputs, targets) -> per-sample losses of shape [n] (no reduction), or a :class:`WeightedLoss`."""

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
"""Builds the optimizer over the (unwrapped) model; param groups allowed."""

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""Builds an LR scheduler for the optimizer: a ``torch.optim.lr_scheduler`` object (anything with
``step()``, ``state_dict()`` and ``load_state_dict()``), or a plain ``step -> multiplier`` callable,
which the runtime wraps in ``LambdaLR``. Stepped once per optimizer step."""

EvalFn = Callable[[torch.nn.Module, torch.device], Mapping[str, float]]
"""(model, device) -> named metrics. Runs on rank 0 with the model in eval mode and without gradients,
outside the training step's autocast (apply your own if the model should evaluate under it)."""


def per_sample_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy per sample (classification logits ``[n, classes]``, class indices ``[n]``).
    Other outputs or targets (a dict, a model output object) are refused in one line: give ``Built(loss_fn=...)``."""
    for what, value in (("model returned", outputs), ("targets are", targets)):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"the default loss takes logits [n, classes] and class indices [n], but the {what} a "
                              f"{type(value).__name__}: give Built(loss_fn=...) a function of (outputs, targets) that "
                              "returns per-sample losses")
    return F.cross_entropy(outputs.float(), targets, reduction="none")


def accuracy_on(eval_data: Dataset, batch_size: int = 1024) -> EvalFn:
    """The default evaluation: argmax accuracy on ``eval_data`` (items ``(input, label, ...)``)."""

    def evaluate(model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        correct = total = 0
        for batch in DataLoader(eval_data, batch_size=batch_size, collate_fn=collate):
            inputs, targets = to_device(batch[0], device), to_device(batch[1], device)
            outputs = model(inputs)
            if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
                raise ConfigError(f"the default evaluation compares the argmax of logits [n, classes] with class indices "
                                  f"[n], but the model returned a {type(outputs).__name__} and the targets are a "
                                  f"{type(targets).__name__}: give Built(evaluate=...) a function of (model, device) "
                                  "that returns named metrics")
            correct += int((outputs.argmax(dim=-1) == targets).sum())
            total += targets.numel()
        return {"accuracy": correct / total} if total else {}

    return evaluate


@dataclass
class Built:
    """What a training script's ``build(config)`` returns."""

    model: torch.nn.Module
    train_data: Dataset
    """A map-style dataset; items are ``(inputs, targets)`` or ``(inputs, targets, sample_id)``, where inputs
    and targets are tensors or any nesting of dicts, lists, tuples and dataclasses of them (:mod:`elastic_ddp.batch`;
    the model's ``forward`` gets the inputs as one argument, collated). With the id, every rank checks it received
    exactly the samples the global cursor planned."""
    eval_data: Dataset | None = None
    """Held-out data for the default evaluation (accuracy); ignored when ``evaluate`` is given."""
    loss_fn: LossFn = per_sample_cross_entropy
    optimizer: OptimizerFactory | None = None
    """None: AdamW from ``--optim-*`` (sharded with ``--optim-zero``; a factory's optimizer is
    sharded too: its class, defaults and param groups are handed to ZeroRedundancyOptimizer)."""
    scheduler: SchedulerFactory | None = None
    """None: linear warmup then constant, cosine or linear decay, from ``--optim-*``."""
    evaluate: EvalFn | None = None
    """None: accuracy on ``eval_data`` when there is any."""
    state: Mapping[str, Stateful] = field(default_factory=dict)
    """Extra objects saved with the model (rank 0 writes them) and restored on every rank."""
    rank_state: Mapping[str, Stateful] = field(default_factory=dict)
    """Extra per-rank objects: each rank saves its own; restored only at the same world size."""
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    """Values a checkpoint must match to be resumed, beyond the config (e.g. a corpus's hash); JSON."""
    tokens_per_sample: int = 0
    """When > 0, metrics also report tokens/s (samples/s times this)."""
