"""The example model: a small MLP classifier whose shape comes from the example's ModelConfig."""

from __future__ import annotations

import torch
from config import ModelConfig
from torch import nn


def build_model(config: ModelConfig) -> nn.Module:
    """Linear + GELU (+ dropout) hidden layers, then a linear classifier head."""
    layers: list[nn.Module] = []
    width = config.input_dim
    for _ in range(config.num_layers):
        layers += [nn.Linear(width, config.hidden_dim), nn.GELU()]
        if config.dropout:
            layers.append(nn.Dropout(config.dropout))
        width = config.hidden_dim
    layers.append(nn.Linear(width, config.num_classes))
    return nn.Sequential(*layers)


@torch.no_grad()
def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
