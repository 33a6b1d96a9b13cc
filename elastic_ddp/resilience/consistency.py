"""Cross-rank consistency: all ranks compare a digest of their parameters.

Under DDP every rank must hold bit-identical parameters after every step. A mismatch means
silent divergence (a bad GPU, a non-deterministic kernel, memory corruption) and is an error
naming the ranks that disagree with the majority.

The digest reinterprets each parameter's bits as integers and sums them with weights in int64
(wrapping): any single changed bit changes it, it costs one pass over the parameters, and
only one int64 per rank crosses the network.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from elastic_ddp.errors import ElasticDDPError

_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DivergenceError(ElasticDDPError):
    """Ranks hold different parameters."""


@torch.no_grad()
def parameter_digest(module: torch.nn.Module) -> int:
    total = torch.zeros((), dtype=torch.int64)
    for index, param in enumerate(module.parameters()):
        bits = param.detach().reshape(-1).view(_INT_VIEWS[param.element_size()]).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        total += ((bits * weights).sum() * (2 * index + 1)).cpu()
    return int(total)


def disagreeing_ranks(digests: list[int]) -> list[int]:
    """Ranks whose digest differs from the most common one (rank 0's wins a tie)."""
    counts = Counter(digests)
    majority = max(counts, key=lambda d: (counts[d], d == digests[0]))
    return [rank for rank, digest in enumerate(digests) if digest != majority]


def check_consistency(module: torch.nn.Module, step: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise DivergenceError naming the ranks whose parameters differ from the majority's."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([parameter_digest(module)], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    bad = disagreeing_ranks([int(t) for t in gathered])
    if bad:
        raise DivergenceError(
            f"step {step}: parameters of rank(s) {', '.join(map(str, bad))} differ from the other ranks' "
            "(silent divergence: faulty device, non-deterministic kernel, or memory corruption)"
        )
