"""A learnable classification task that needs no download: labels from a fixed random teacher.

Inputs are standard normal vectors; the label of each is the argmax of a randomly initialised
two-layer "teacher" network. Everything is generated from one seed, so every rank (and every
launch) builds the identical dataset in a few milliseconds. Each sample is returned as
``(input, label, sample_id)``; the id lets the trainer check that it got the planned samples.
"""

from __future__ import annotations

import torch
from config import DataConfig, ModelConfig
from torch.utils.data import Dataset


class TeacherDataset(Dataset):
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs = inputs
        self.labels = labels

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.inputs[index], self.labels[index], index


def make_datasets(data: DataConfig, model: ModelConfig) -> tuple[TeacherDataset, TeacherDataset]:
    """The training and held-out sets of the task fixed by ``data.generator_seed``."""
    generator = torch.Generator().manual_seed(data.generator_seed)
    total = data.num_samples + data.eval_samples
    inputs = torch.randn(total, model.input_dim, generator=generator)
    hidden = 4 * model.num_classes
    w1 = torch.randn(model.input_dim, hidden, generator=generator) / model.input_dim**0.5
    w2 = torch.randn(hidden, model.num_classes, generator=generator) / hidden**0.5
    labels = (torch.tanh(inputs @ w1) @ w2).argmax(dim=1)
    train = TeacherDataset(inputs[: data.num_samples], labels[: data.num_samples])
    held_out = TeacherDataset(inputs[data.num_samples :], labels[data.num_samples :])
    return train, held_out
