"""The example job with a resume bug, as a negative control for the chaos verifier.

It restores everything from a checkpoint except the data position: the sampler starts its
epoch over after every resume (like a DataLoader whose state is not checkpointed). Steps
after a resume consume samples the interrupted run had already used, so its data digest
departs from an uninterrupted run's; ``python -m chaos`` must catch that.

How to run: as ``examples/train.py`` (same flags), e.g. under a chaos scenario's nodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from elastic_ddp.data import ElasticSampler

_load_state_dict = ElasticSampler.load_state_dict


def _forget_position(self: ElasticSampler, state: dict[str, int]) -> None:
    _load_state_dict(self, {**state, "cursor": 0})


ElasticSampler.load_state_dict = _forget_position  # type: ignore[method-assign]

import train  # noqa: E402 - the example, with the bug above in place

if __name__ == "__main__":
    sys.exit(train.main())
