"""Dict inputs on the trainer path: a Hugging Face-style dataset whose items are tokenizer output.

Each item is ``({"input_ids", "attention_mask"}, label, index)``, the shape a ``transformers`` tokenizer
and ``datasets`` give (a ``BatchEncoding`` works the same: any mapping keeps its type). The "tokenizer"
here is bytes, padded to a fixed length, and the texts are generated, so nothing is downloaded. The
model's ``forward`` takes the collated dict, as a Hugging Face model's does.

  torchrun --standalone --nproc-per-node=2 examples/dict_inputs/train.py \
      --max-steps 100 --checkpoint-dir /tmp/dict-ckpt --checkpoint-every 50
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_ddp import Built, TrainConfig, config_from_args, run_training

TOPICS = ("weather", "sports", "music", "cooking")
WORDS = {
    "weather": "rain sun cloud wind storm cold warm forecast snow fog",
    "sports": "goal match team score coach league player win race ball",
    "music": "song band guitar drum melody chord album concert piano tune",
    "cooking": "oven recipe salt pan bake soup flour spice knife boil",
}


def tokenize(text: str, length: int) -> dict[str, torch.Tensor]:
    """Byte ids padded (0) or cut to ``length``, with the mask a tokenizer returns."""
    ids = list(text.encode()[:length])
    mask = [1] * len(ids) + [0] * (length - len(ids))
    return {"input_ids": torch.tensor(ids + [0] * (length - len(ids))), "attention_mask": torch.tensor(mask)}


class TopicTexts(Dataset):
    """Short generated texts, each about one topic: the same on every rank and launch."""

    def __init__(self, count: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(TOPICS), (count,), generator=generator)
        self.items = []
        for label in self.labels.tolist():
            words = WORDS[TOPICS[label]].split()
            picks = torch.randint(0, len(words), (6,), generator=generator).tolist()
            self.items.append(tokenize(" ".join(words[i] for i in picks), length))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        return self.items[index], self.labels[index], index


class BagOfBytes(nn.Module):
    """Embeds the ids and averages them over the mask, then classifies: forward(batch) as HF models take it."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)  # logits [n, classes]: the default loss and evaluation apply


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    embed_dim: int = 32
    """Embedding and hidden width."""
    seq_len: int = 48
    """Tokens per text (padded or cut)."""
    texts: int = 2048
    """Training texts."""

    def problems(self) -> list[tuple[str, str]]:
        return [(name, "must be >= 1") for name in ("embed_dim", "seq_len", "texts") if getattr(self, name) < 1]


@dataclass(frozen=True, kw_only=True)
class DictConfig(TrainConfig):
    text: TextConfig = field(default_factory=TextConfig)  # --text-embed-dim, --text-seq-len, --text-texts


def build(config: DictConfig) -> Built:
    t = config.text
    return Built(
        model=BagOfBytes(t.embed_dim, len(TOPICS)),
        train_data=TopicTexts(t.texts, t.seq_len, seed=1),
        eval_data=TopicTexts(256, t.seq_len, seed=2),
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=3e-3),
    )


def main(argv: list[str] | None = None) -> int:
    return run_training(config_from_args(argv, config_class=DictConfig), build)


if __name__ == "__main__":
    sys.exit(main())
