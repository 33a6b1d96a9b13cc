"""The example's own config sections: the MLP's shape and the generated dataset.

They join the runtime's flags (``--model-hidden-dim``, ``--data-num-samples``), its config-file
layering and its all-at-once validation, and every field here is part of the resume fingerprint:
each one changes the model or the generated data (``eval_samples`` too: the teacher that labels
every sample is drawn after all inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_ddp.config import Problems, TrainConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the example MLP classifier."""

    input_dim: int = 32
    """Number of input features."""
    hidden_dim: int = 128
    """Width of each hidden layer."""
    num_layers: int = 2
    """Number of hidden layers (each Linear + GELU)."""
    num_classes: int = 8
    """Number of output classes."""
    dropout: float = 0.0
    """Dropout probability after each hidden layer (exercises the RNG streams)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("input_dim", "hidden_dim", "num_layers"):
            if getattr(self, name) < 1:
                found.append((name, "must be >= 1"))
        if self.num_classes < 2:
            found.append(("num_classes", "must be >= 2"))
        if not 0.0 <= self.dropout < 1.0:
            found.append(("dropout", "must be in [0, 1)"))
        return found


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The generated dataset."""

    num_samples: int = 8192
    """Training samples in the generated dataset (one epoch)."""
    eval_samples: int = 1024
    """Held-out samples used to report accuracy."""
    generator_seed: int = 1234
    """Seed of the teacher network that generates the dataset (fixes the task)."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.num_samples < 1:
            found.append(("num_samples", "must be >= 1"))
        if self.eval_samples < 0:
            found.append(("eval_samples", "must be >= 0"))
        return found


@dataclass(frozen=True, kw_only=True)
class MLPConfig(TrainConfig):
    """The runtime's sections plus the example's model and data."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def problems(self) -> Problems:
        found = super().problems()
        if self.global_batch_size > self.data.num_samples and self.loader.drop_last:
            found.append(
                (
                    "global_batch_size",
                    f"{self.global_batch_size} is larger than the dataset ({self.data.num_samples} samples)"
                    " with --loader-drop-last: an epoch would have no step",
                )
            )
        return found
