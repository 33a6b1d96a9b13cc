"""The global data cursor (docs/design.md, "Data cursor").

An epoch's order is a permutation drawn from ``(seed, epoch)`` alone. The data
position is ``{epoch, cursor}``: how many samples of that epoch's permutation the
committed steps consumed, counted globally. Step k consumes the next
``global_batch_size`` samples; only *how* they are split among the current ranks
and micro-batches depends on the world size, never *which* samples form step k.

Everything that decides positions is a pure function (:func:`plan_step`,
:func:`split_evenly`); :class:`ElasticSampler` wraps them as a batch sampler for a
standard ``DataLoader`` on any map-style dataset.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elastic_ddp.errors import ConfigError, DataError

_EPOCH_SEED_STRIDE = 1_000_003  # a prime: (seed, epoch) pairs map to distinct generator seeds


@dataclass(frozen=True)
class DataPosition:
    """Where the next step starts: sample ``cursor`` of epoch ``epoch``'s permutation."""

    epoch: int = 0
    cursor: int = 0


@dataclass(frozen=True)
class StepPlan:
    """Which slice of which epoch's permutation one step consumes, and where the next begins."""

    epoch: int
    start: int
    stop: int
    next_position: DataPosition

    @property
    def size(self) -> int:
        return self.stop - self.start


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into ``parts`` contiguous ``(start, stop)`` ranges whose sizes differ by at most one.

    The first ``count % parts`` ranges get the extra sample; ranges may be empty when ``count < parts``.
    """
    base, extra = divmod(count, parts)
    bounds: list[tuple[int, int]] = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def normalize(position: DataPosition, dataset_len: int, global_batch_size: int, drop_last: bool) -> DataPosition:
    """Move a position that has no full step left in its epoch to the start of the next epoch."""
    remaining = dataset_len - position.cursor
    if remaining <= 0 or (drop_last and remaining < global_batch_size):
        return DataPosition(epoch=position.epoch + 1, cursor=0)
    return position


def plan_step(position: DataPosition, dataset_len: int, global_batch_size: int, drop_last: bool) -> StepPlan:
    """The samples the step starting at ``position`` consumes.

    With ``drop_last`` every step has exactly ``global_batch_size`` samples and an epoch's tail is
    skipped; without it the last step of an epoch takes the remainder (smaller), so every sample
    of every epoch is used exactly once.
    """
    position = normalize(position, dataset_len, global_batch_size, drop_last)
    stop = min(position.cursor + global_batch_size, dataset_len)
    after = normalize(DataPosition(position.epoch, stop), dataset_len, global_batch_size, drop_last)
    return StepPlan(epoch=position.epoch, start=position.cursor, stop=stop, next_position=after)


def epoch_permutation(seed: int, epoch: int, dataset_len: int, shuffle: bool) -> torch.Tensor:
    """The order of epoch ``epoch``: a permutation drawn from ``(seed, epoch)`` alone (int64 tensor)."""
    if not shuffle:
        return torch.arange(dataset_len, dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed * _EPOCH_SEED_STRIDE + epoch)
    return torch.randperm(dataset_len, generator=generator, dtype=torch.int64)


def update_data_digest(previous: str, step_ids: torch.Tensor) -> str:
    """Chain one committed step's sample ids (sorted, so the split among ranks does not matter) into the digest."""
    ids = np.sort(step_ids.to(torch.int64).numpy())
    hasher = hashlib.sha256(bytes.fromhex(previous))
    hasher.update(ids.tobytes())
    return hasher.hexdigest()


EMPTY_DATA_DIGEST = hashlib.sha256(b"").hexdigest()
"""The data digest of a run that has committed no step yet."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ElasticSampler:
    """Batch sampler implementing the global cursor; yields this rank's micro-batches of each step.

    Use it as ``DataLoader(dataset, batch_sampler=sampler, ...)``. Iteration starts at the committed
    position (:attr:`position`) and runs on across epochs; the trainer asks :meth:`plan` for the
    next step, draws ``len(local_micro_batches(plan))`` micro-batches from the loader, and calls
    :meth:`commit` once the step is done. Prefetching workers may run ahead; only :meth:`commit`
    moves the position that checkpoints record.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if global_batch_size < 1 or grad_accum_steps < 1:
            raise DataError("global_batch_size and grad_accum_steps must be >= 1")
        _check_membership(rank, world_size, global_batch_size)
        if dataset_len < 1:
            raise DataError("the dataset is empty")
        if drop_last and dataset_len < global_batch_size:
            raise DataError(
                f"the dataset has {dataset_len} samples, fewer than one global batch ({global_batch_size}); "
                "with drop_last no step could be formed: lower --global-batch-size or use --no-loader-drop-last"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.grad_accum_steps = grad_accum_steps
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.position = DataPosition()
        self.samples_seen = 0
        """Samples the committed steps consumed, over all epochs and launches."""
        self.data_digest = EMPTY_DATA_DIGEST
        """SHA-256 chain of every committed step's sample ids: equal for two runs that saw the same data."""
        # The loader's iterator may run an epoch ahead of the trainer: keep the two newest epochs.
        self._permutations: dict[int, torch.Tensor] = {}
        self._micro_batches: tuple[StepPlan, list[list[int]]] | None = None
        self.dispatched: DataPosition | None = None
        """The step the newest iterator is handing to the loader (every micro-batch of this rank before it has
        gone), which may load steps ahead of the committed position (its workers' prefetch). None: no iterator
        yet."""
        self.on_plan: Callable[[], None] | None = None
        """Called by :meth:`plan` of the committed position, where both doors start a step (the runtime keys the
        RNG streams there); never by the iterator or a prefetcher, which plan steps ahead."""
        self.last_commit: StepPlan | None = None
        """The plan of the newest :meth:`commit` of this process (None before the first): the runtime's sample
        ledger records it at the step boundary."""

    def join(self, rank: int, world_size: int) -> None:
        """Take this process's place in a membership: the steps from the committed position on are split over
        ``world_size`` ranks, this one's share being ``rank``'s. Which samples form each step does not change.
        An iterator made before plans with the old split: make a new one after this."""
        _check_membership(rank, world_size, self.global_batch_size)
        if (rank, world_size) != (self.rank, self.world_size):
            self.rank, self.world_size = rank, world_size
            self._micro_batches = None
            self.dispatched = None

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, int | str]:
        """The committed position, the samples consumed so far and the data digest (JSON-safe)."""
        return {
            "epoch": self.position.epoch,
            "cursor": self.position.cursor,
            "samples_seen": self.samples_seen,
            "data_digest": self.data_digest,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; values come from storage, so each is checked."""
        try:
            epoch, cursor = int(state["epoch"]), int(state["cursor"])
            samples_seen = int(state.get("samples_seen", 0))
            digest = str(state.get("data_digest", EMPTY_DATA_DIGEST))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"invalid sampler state {dict(state)!r}: {exc}") from exc
        if epoch < 0 or not 0 <= cursor <= self.dataset_len or samples_seen < 0:
            raise DataError(f"invalid sampler state epoch={epoch} cursor={cursor} samples_seen={samples_seen} "
                            f"for {self.dataset_len} samples")
        if not _HEX64.match(digest):
            raise DataError(f"invalid sampler state: data_digest {digest!r} is not a sha256 hex digest")
        self.position = DataPosition(epoch, cursor)
        self.samples_seen = samples_seen
        self.data_digest = digest

    # -- planning --------------------------------------------------------------

    def plan(self, position: DataPosition | None = None) -> StepPlan:
        """The step that starts at ``position`` (default: the committed position: the next step to train, whose
        start this marks; see :attr:`on_plan`)."""
        if position is None and self.on_plan is not None:
            self.on_plan()
        return plan_step(position or self.position, self.dataset_len, self.global_batch_size, self.drop_last)

    def commit(self, plan: StepPlan) -> None:
        """Record that the step ``plan`` describes has been applied to the model: move the position,
        count its samples and chain its sample ids into the data digest."""
        self.data_digest = update_data_digest(self.data_digest, self.global_ids(plan))
        self.samples_seen += plan.size
        self.position = plan.next_position
        self.last_commit = plan

    def loss_scale(self, plan: StepPlan) -> float:
        """Multiply this rank's *summed* per-sample losses of the step by this before ``backward()``:
        DDP averages gradients over ranks, so the result is the gradient of the mean loss over the
        step's whole global batch, exactly, even when ranks hold unequal shares."""
        return self.world_size / plan.size

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                del self._permutations[min(self._permutations)]
            self._permutations[epoch] = epoch_permutation(self.seed, epoch, self.dataset_len, self.shuffle)
        return self._permutations[epoch]

    def global_ids(self, plan: StepPlan) -> torch.Tensor:
        """The sample ids every rank together consumes in the step."""
        return self.permutation(plan.epoch)[plan.start : plan.stop]

    def local_share(self, plan: StepPlan) -> tuple[int, int]:
        """This rank's ``(start, stop)`` slice of the step's global batch."""
        return split_evenly(plan.size, self.world_size)[self.rank]

    def local_micro_batches(self, plan: StepPlan) -> list[list[int]]:
        """This rank's micro-batches of the step (none when its share is empty).

        The loader's iteration and the trainer both ask for each step's: the newest answer is kept.
        """
        if self._micro_batches is not None and self._micro_batches[0] == plan:
            return self._micro_batches[1]
        start, stop = self.local_share(plan)
        ids = self.global_ids(plan)[start:stop].tolist()
        parts = min(self.grad_accum_steps, len(ids))
        micro_batches = [ids[a:b] for a, b in split_evenly(len(ids), parts)] if parts else []
        self._micro_batches = (plan, micro_batches)
        return micro_batches

    # -- batch sampler protocol --------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        position = self.dispatched = self.position
        while True:
            plan = self.plan(position)
            yield from self.local_micro_batches(plan)
            position = self.dispatched = plan.next_position


def _check_membership(rank: int, world_size: int, global_batch_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in a world of size {world_size}")
    if global_batch_size < world_size:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is smaller than the world size {world_size}: every rank needs "
            "at least one sample per step; raise the global batch size or run fewer ranks"
        )


def check_delivered(batch: Any, expected: list[int], rank: int, step: int, plan: StepPlan) -> None:
    """When the dataset returns sample ids (items ``(inputs, targets, sample_id)``), check the loader delivered
    exactly the samples the global cursor planned for this rank's micro-batch."""
    if len(batch) < 3:
        return
    got = batch[2].tolist()
    if got != expected:
        raise DataError(f"rank {rank}: step {step} (epoch {plan.epoch}) expected samples {expected[:8]}… but the loader "
                        f"delivered {got[:8]}…: the DataLoader must use the ElasticSampler as its batch_sampler")
