"""Train a small GPT on bytes of Python's own standard library with elastic_ddp.

The corpus is the running interpreter's stdlib sources (examples/lm/corpus.py): no download, the
same bytes on every machine with the same Python; its SHA-256 is part of the resume fingerprint,
so a checkpoint made with another Python version is refused rather than resumed on other data.

How to run:
  one process (CPU or one GPU):   python examples/lm/train.py --max-steps 300
  one node, 2 processes:          torchrun --standalone --nproc-per-node=2 examples/lm/train.py --max-steps 300 \
                                    --checkpoint-dir /tmp/lm-ckpt --checkpoint-every 50
  elastic, etcd v3 rendezvous:    torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=etcd-v3 \
                                    --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=lm1 examples/lm/train.py \
                                    --checkpoint-dir /tmp/lm-ckpt --checkpoint-every 50
  from token shards (any fsspec URI): python examples/lm/shards.py s3://bucket/lm, then add
                                    --data-shards-uri s3://bucket/lm --loader-num-workers 2
  all flags:                      python examples/lm/train.py --help

Defaults: 4 layers, d_model 256, 4 heads, context 128 bytes (3.3 M parameters), 3 MB of corpus,
global batch 32 sequences, AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on the 2-D weights),
warmup then cosine decay, autocast in bfloat16 on the CPU and float16 (with a gradient scaler) on CUDA.
On 2 CPU cores (about 0.42 s and 9,700 tokens/s a step) the validation loss falls from the unigram
baseline (3.10 nats on CPython 3.11's stdlib) to about 2.0 in 300 steps.

Resume is bitwise at the same world size, with or without autocast. After a world-size change the
weights agree with an uninterrupted run within the runtime's tolerance (rtol 1e-4, atol 1e-6) in
float32 (--no-use-amp) only: under autocast each rank's weight gradients are rounded to bf16/fp16
before the all-reduce, so other partial sums give differences that AdamW grows to ~1e-4 and more.
The data position is exact either way.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from corpus import make_splits, unigram_entropy
from gpt import GPT, parameter_count, parameter_groups
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import Dataset, default_collate

from elastic_ddp.config import OptimConfig, Problems, TrainConfig, config_from_args, not_fingerprinted
from elastic_ddp.entry import Built, run_training
from elastic_ddp.shards import ShardReader, TokenWindows

sys.path.append(str(Path(__file__).resolve().parent.parent))  # examples/, for the shared fault hook
from faults import faulty_loss

logger = logging.getLogger(__name__)

VOCAB = 256
"""Byte-level: every byte value is a token."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """GPT shape; part of the resume fingerprint."""

    n_layer: int = 4
    """Transformer blocks."""
    d_model: int = 256
    """Width of the residual stream (embedding size)."""
    n_head: int = 4
    """Attention heads per block; must divide --model-d-model."""
    context: int = 128
    """Bytes per training sequence (the attention window and the position-embedding length)."""
    dropout: float = not_fingerprinted(0.0)
    """Dropout probability on embeddings, attention and residual branches (may change on resume)."""

    def problems(self) -> Problems:
        found: Problems = []
        for name in ("n_layer", "d_model", "n_head", "context"):
            if getattr(self, name) < 1:
                found.append((name, "must be >= 1"))
        if self.n_head >= 1 and self.d_model >= 1 and self.d_model % self.n_head:
            found.append(("n_head", f"{self.n_head} does not divide --model-d-model {self.d_model}"))
        if not 0.0 <= self.dropout < 1.0:
            found.append(("dropout", "must be in [0, 1)"))
        return found


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """The byte corpus (this Python's stdlib sources) and the held-out evaluation."""

    budget_bytes: int = 3_000_000
    """Bytes of stdlib source to train and validate on (the first ones, in sorted path order)."""
    val_fraction: float = 0.05
    """Fraction of the corpus, at its end, held out for validation."""
    eval_batches: int = not_fingerprinted(8)
    """Validation batches per evaluation (windows evenly spaced over the held-out bytes); 0: all of them."""
    eval_batch_size: int = not_fingerprinted(32)
    """Sequences per validation batch."""
    shards_uri: str = ""
    """Train from token shards at this fsspec URI (written by examples/lm/shards.py: train/ and val/, each with its
    index.json) instead of the local corpus; --data-budget-bytes and --data-val-fraction are then the writer's."""
    shards_options: str = not_fingerprinted("")
    """fsspec options for --data-shards-uri as a JSON object (an S3 endpoint_url, ...); credentials are better left to
    the environment (AWS_ACCESS_KEY_ID, ...), since flags show in process lists."""
    shards_cache_dir: str = not_fingerprinted("")
    """The node's shard cache; empty: $ELASTIC_DDP_SHARD_CACHE_DIR, else <temp dir>/elastic_ddp-shards-<uid>."""
    shards_cache_bytes: int = not_fingerprinted(1 << 30)
    """Byte budget of the node's shard cache (pieces are evicted least recently used first)."""
    shards_prefetch_steps: int = not_fingerprinted(8)
    """With --data-shards-uri: steps ahead whose pieces each rank fetches in the background."""

    def problems(self) -> Problems:
        found: Problems = []
        if self.budget_bytes < 1024:
            found.append(("budget_bytes", "must be >= 1024"))
        if not 0.0 < self.val_fraction < 0.5:
            found.append(("val_fraction", "must be in (0, 0.5)"))
        if self.eval_batches < 0:
            found.append(("eval_batches", "must be >= 0 (0: all)"))
        if self.eval_batch_size < 1:
            found.append(("eval_batch_size", "must be >= 1"))
        if self.shards_options:
            try:
                if not isinstance(json.loads(self.shards_options), dict):
                    raise ValueError("not an object")
            except ValueError:
                found.append(("shards_options", "must be a JSON object"))
        if self.shards_cache_bytes < 1:
            found.append(("shards_cache_bytes", "must be >= 1"))
        if self.shards_prefetch_steps < 0:
            found.append(("shards_prefetch_steps", "must be >= 0 (0: no prefetch)"))
        return found


def _default_amp_dtype() -> str:
    return "float16" if torch.cuda.is_available() else "bfloat16"


@dataclass(frozen=True, kw_only=True)
class LMConfig(TrainConfig):
    """A GPT on bytes of the stdlib: the runtime's sections plus the model's shape and the corpus."""

    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; unchanged when the world size changes."""
    use_amp: bool = True
    """Run forward and loss under torch.autocast."""
    amp_dtype: Literal["bfloat16", "float16"] = _default_amp_dtype()
    """Autocast dtype; float16 also enables a gradient scaler. Default: float16 when CUDA is available,
    else bfloat16."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: CorpusConfig = field(default_factory=CorpusConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.1, beta2=0.95, warmup_steps=30)
    )

    def problems(self) -> Problems:
        found = super().problems()
        budget, context = self.data.budget_bytes, self.model.context
        if budget >= 1 and 0.0 < self.data.val_fraction < 0.5 and context >= 1 and not self.data.shards_uri:
            held_out = math.ceil(budget * self.data.val_fraction)
            train_windows = (budget - held_out - 1) // context
            if held_out <= context:
                found.append(("data_val_fraction", f"holds out {held_out} bytes, not one window of --model-context "
                                                   f"{context} + 1 bytes"))
            if self.loader.drop_last and self.global_batch_size > train_windows:
                found.append(("global_batch_size", f"{self.global_batch_size} is more than the {train_windows} "
                                                   "training windows with --loader-drop-last: an epoch would have "
                                                   "no step"))
        return found


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sequence loss ``[n]``: cross-entropy averaged over each sequence's tokens (equal weight per sample)."""
    tokens = F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten(), reduction="none")
    return tokens.view(targets.shape).mean(dim=1)


def make_optimizer(config: LMConfig) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """AdamW from --optim-*, weight decay on the 2-D weights of Linear layers only."""
    optim = config.optim

    def factory(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                 betas=(optim.beta1, optim.beta2), eps=optim.eps)

    return factory


def make_evaluate(config: LMConfig, val: Dataset,
                  unigram_nats: Callable[[], float]) -> Callable[[torch.nn.Module, torch.device], dict[str, float]]:
    """Mean token loss and perplexity over evenly spaced held-out windows, the same ones every time
    (``--data-eval-batches`` batches of ``--data-eval-batch-size``; 0 batches: the whole held-out split), beside
    the unigram baseline (``unigram_nats()``, asked at each evaluation: rank 0's alone)."""
    batch_size = config.data.eval_batch_size
    wanted = config.data.eval_batches * batch_size
    count = len(val) if wanted == 0 else min(wanted, len(val))
    indices = [i * len(val) // count for i in range(count)]

    def evaluate(model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        # the runtime calls this on rank 0, in eval mode, without gradients
        total = 0.0
        for start in range(0, count, batch_size):
            inputs, targets, _ = default_collate([val[i] for i in indices[start : start + batch_size]])
            with autocast(config, device):
                logits = model(inputs.to(device))
            total += float(lm_loss(logits, targets.to(device)).double().sum())
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "unigram_loss": unigram_nats()}

    return evaluate


def autocast(config: LMConfig, device: torch.device) -> torch.autocast:
    """The training step's autocast, for the evaluation (the runtime does not wrap ``evaluate`` in it)."""
    return torch.autocast(device.type, dtype=getattr(torch, config.amp_dtype), enabled=config.use_amp)


def build(config: LMConfig) -> Built:
    model = GPT(vocab_size=VOCAB, context=config.model.context, n_layer=config.model.n_layer,
                d_model=config.model.d_model, n_head=config.model.n_head, dropout=config.model.dropout)
    if config.data.shards_uri:
        train, val, unigram, fingerprint, source = shard_splits(config)
    else:
        splits = make_splits(config.data.budget_bytes, config.model.context, config.data.val_fraction)
        train, val, corpus = splits.train, splits.val, splits.corpus
        unigram = lambda: splits.unigram_nats  # noqa: E731 - the shards path computes it at first use
        fingerprint = {"corpus_sha256": corpus.sha256}
        source = (f"corpus {len(corpus.data):,} bytes from {corpus.files} files under {corpus.root} "
                  f"(sha256 {corpus.sha256[:16]})")
    if os.environ.get("RANK", "0") == "0":
        logger.info("%s parameters; %s; %d training and %d validation windows of %d bytes",
                    f"{parameter_count(model):,}", source, len(train), len(val), config.model.context)
    return Built(
        model=model,
        train_data=train,
        eval_data=None,
        loss_fn=faulty_loss(model, base=lm_loss),
        optimizer=make_optimizer(config),
        evaluate=make_evaluate(config, val, unigram),
        fingerprint=fingerprint,
        tokens_per_sample=config.model.context,
    )


def shard_splits(config: LMConfig) -> tuple[TokenWindows, TokenWindows, Callable[[], float], dict[str, str], str]:
    """Training and validation windows of the token shards at --data-shards-uri, read through the node's cache; the
    training index's digest is the fingerprint (a resume on other shards is refused). The unigram baseline reads
    every validation window: it is computed at the first evaluation, on rank 0 alone, not at every rank's start."""
    data = config.data
    options = json.loads(data.shards_options) if data.shards_options else {}
    readers = [ShardReader(f"{data.shards_uri.rstrip('/')}/{name}", cache_dir=data.shards_cache_dir,
                           cache_bytes=data.shards_cache_bytes, storage_options=options,
                           prefetch_steps=data.shards_prefetch_steps) for name in ("train", "val")]
    train, val = (TokenWindows(reader, config.model.context) for reader in readers)
    @functools.cache
    def unigram() -> float:
        held_out = torch.cat([val[i][0] for i in range(len(val))]).to(torch.uint8) if len(val) else torch.zeros(0)
        return unigram_entropy(held_out)

    digest = readers[0].index.digest
    source = f"token shards at {data.shards_uri} ({len(readers[0].index.shards)} training shards, index {digest[:16]})"
    return train, val, unigram, {"shards_index_sha256": digest}, source


@record
def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv, prog="lm/train.py", config_class=LMConfig)
    return run_training(config, build)


if __name__ == "__main__":
    sys.exit(main())
