"""A small GPT-style decoder-only language model over bytes.

Pre-LayerNorm blocks (causal self-attention through ``scaled_dot_product_attention(is_causal=True)``
with bias-free q/k/v projections, then a 4x GELU MLP), learned absolute position embeddings, untied
input embedding and output head, GPT-2 initialisation (normal(0, 0.02), residual projections
scaled by 1/sqrt(2 * n_layer)). Everything is drawn from torch's global RNG, which the runtime
seeds identically on every rank before ``build`` runs, so every rank starts with the same weights.

``forward`` takes int64 tokens ``[B, T]`` (``T <= context``) and returns logits ``[B, T, vocab]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        # No bias on q, k, v: the key bias gets an exactly zero gradient (softmax ignores a shift shared by
        # all keys), and AdamW would turn the rounding noise left in it into full-size updates that
        # differ from run to run whenever the summation order does (another world size).
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int = 256,
        context: int = 128,
        n_layer: int = 4,
        d_model: int = 256,
        n_head: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for block in self.blocks:
            for projection in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, time = tokens.shape
        if time > self.context:
            raise ValueError(f"sequence of {time} tokens is longer than the context ({self.context})")
        positions = torch.arange(time, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on the 2-D weights of Linear layers; none on biases, LayerNorms, embeddings.

    Works on the bare model or a wrapper (DDP) around it; every trainable parameter is in exactly one group.
    """
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.LayerNorm)):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in no_decay_ids else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@torch.no_grad()
def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
