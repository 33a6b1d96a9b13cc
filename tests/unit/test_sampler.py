"""The global data cursor: exactly-once per epoch whatever the world size and its changes."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from elastic_ddp.data import (
    EMPTY_DATA_DIGEST,
    DataPosition,
    ElasticSampler,
    epoch_permutation,
    plan_step,
    split_evenly,
    update_data_digest,
)
from elastic_ddp.errors import ConfigError, DataError


def _samplers(world_size: int, state: dict[str, int] | None = None, **kwargs) -> list[ElasticSampler]:
    samplers = [ElasticSampler(rank=rank, world_size=world_size, **kwargs) for rank in range(world_size)]
    for sampler in samplers:
        if state:
            sampler.load_state_dict(state)
    return samplers


def _run_step(samplers: list[ElasticSampler]) -> tuple[int, list[int]]:
    """One step on every rank: the epoch and the ids all ranks consumed (micro-batches flattened)."""
    plan = samplers[0].plan()
    consumed: list[int] = []
    for sampler in samplers:
        assert sampler.plan() == plan
        for micro in sampler.local_micro_batches(plan):
            consumed += micro
        sampler.commit(plan)
    return plan.epoch, consumed


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_sample_is_used_exactly_once_per_epoch_while_world_size_changes(drop_last: bool, seed: int) -> None:
    n, batch = 1000, 48
    rng = random.Random(seed)
    settings = dict(dataset_len=n, global_batch_size=batch, seed=seed, drop_last=drop_last, grad_accum_steps=rng.randint(1, 3))
    world = rng.randint(1, 7)
    samplers = _samplers(world, **settings)
    per_epoch: dict[int, Counter] = {}
    for _ in range(3 * (n // batch + 1)):
        if rng.random() < 0.3:  # a failure or join mid-epoch: rebuild all ranks from the saved state
            world = rng.randint(1, 7)
            samplers = _samplers(world, samplers[0].state_dict(), **settings)
        epoch, ids = _run_step(samplers)
        per_epoch.setdefault(epoch, Counter()).update(ids)
    for epoch, counts in per_epoch.items():
        if epoch == max(per_epoch):
            continue  # the last epoch is unfinished
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample was used twice"
        expected = n - (n % batch if drop_last else 0)
        assert sum(counts.values()) == expected
        order = epoch_permutation(seed, epoch, n, shuffle=True)[:expected].tolist()
        assert set(counts) == set(order)


@pytest.mark.parametrize("world_size", range(1, 8))
def test_which_samples_form_a_step_does_not_depend_on_world_size(world_size: int) -> None:
    settings = dict(dataset_len=500, global_batch_size=40, seed=3, grad_accum_steps=2)
    reference = [sorted(_run_step(_samplers(1, **settings))[1])]
    samplers = _samplers(world_size, **settings)
    single = _samplers(1, **settings)
    for _ in range(30):
        assert sorted(_run_step(samplers)[1]) == sorted(_run_step(single)[1])
    assert reference[0] == sorted(epoch_permutation(3, 0, 500, True)[:40].tolist())


def test_shares_differ_by_at_most_one_and_cover_the_batch() -> None:
    for count in range(0, 30):
        for parts in range(1, 8):
            bounds = split_evenly(count, parts)
            sizes = [b - a for a, b in bounds]
            assert sum(sizes) == count and max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))


def test_drop_last_skips_the_epoch_tail_and_starts_the_next_epoch() -> None:
    plan = plan_step(DataPosition(0, 96), dataset_len=100, global_batch_size=8, drop_last=True)
    assert (plan.epoch, plan.start, plan.stop) == (1, 0, 8)


def test_without_drop_last_the_last_step_of_an_epoch_is_smaller() -> None:
    plan = plan_step(DataPosition(0, 96), dataset_len=100, global_batch_size=8, drop_last=False)
    assert (plan.epoch, plan.start, plan.stop) == (0, 96, 100)
    assert plan.next_position == DataPosition(1, 0)


def test_a_rank_with_an_empty_share_gets_no_micro_batch() -> None:
    samplers = _samplers(7, dataset_len=103, global_batch_size=100, seed=0, drop_last=False)
    for sampler in samplers:
        sampler.load_state_dict({"epoch": 0, "cursor": 100})
    plan = samplers[0].plan()
    assert plan.size == 3
    assert [len(s.local_micro_batches(plan)) for s in samplers] == [1, 1, 1, 0, 0, 0, 0]


def test_dataset_smaller_than_a_global_batch_is_a_clear_error() -> None:
    with pytest.raises(DataError, match="fewer than one global batch"):
        ElasticSampler(10, global_batch_size=16, seed=0, rank=0, world_size=1, drop_last=True)


def test_iteration_yields_the_planned_micro_batches_from_the_committed_position() -> None:
    sampler = ElasticSampler(64, global_batch_size=8, seed=5, rank=1, world_size=3, grad_accum_steps=2)
    sampler.load_state_dict({"epoch": 2, "cursor": 16})
    expected: list[list[int]] = []
    position = sampler.position
    for _ in range(10):
        plan = sampler.plan(position)
        expected += sampler.local_micro_batches(plan)
        position = plan.next_position
    iterator = iter(sampler)
    assert [next(iterator) for _ in range(len(expected))] == expected


def test_epoch_order_depends_only_on_seed_and_epoch() -> None:
    assert torch.equal(epoch_permutation(1, 4, 50, True), epoch_permutation(1, 4, 50, True))
    assert not torch.equal(epoch_permutation(1, 4, 50, True), epoch_permutation(1, 5, 50, True))
    assert epoch_permutation(1, 4, 50, False).tolist() == list(range(50))


def test_data_digest_ignores_the_order_within_a_step_but_not_across_steps() -> None:
    a = update_data_digest(EMPTY_DATA_DIGEST, torch.tensor([3, 1, 2]))
    assert a == update_data_digest(EMPTY_DATA_DIGEST, torch.tensor([1, 2, 3]))
    ab = update_data_digest(a, torch.tensor([7, 8]))
    ba = update_data_digest(update_data_digest(EMPTY_DATA_DIGEST, torch.tensor([7, 8])), torch.tensor([1, 2, 3]))
    assert ab != ba


def test_invalid_saved_state_is_refused() -> None:
    sampler = ElasticSampler(64, global_batch_size=8, seed=0, rank=0, world_size=1)
    with pytest.raises(DataError, match="invalid sampler state"):
        sampler.load_state_dict({"epoch": 0, "cursor": 65})


def test_a_sampler_that_joins_another_membership_splits_the_same_steps_over_its_ranks() -> None:
    samplers = [ElasticSampler(100, global_batch_size=12, seed=1, rank=rank, world_size=4) for rank in range(4)]
    for sampler in samplers:
        for _ in range(3):
            sampler.commit(sampler.plan())
    survivors = samplers[:3]
    for rank, sampler in enumerate(survivors):
        sampler.join(rank, 3)
    plan = survivors[0].plan()
    assert all(sampler.position == samplers[3].position for sampler in survivors)  # the position is the job's
    shares = [sampler.global_ids(plan)[slice(*sampler.local_share(plan))].tolist() for sampler in survivors]
    assert [len(share) for share in shares] == [4, 4, 4]
    assert sorted(sum(shares, [])) == sorted(samplers[3].global_ids(plan).tolist())  # every sample, once
    assert next(iter(survivors[1])) == shares[1]  # a new iterator hands out the new split


def test_joining_a_membership_the_global_batch_cannot_cover_is_refused() -> None:
    sampler = ElasticSampler(100, global_batch_size=4, seed=1, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="smaller than the world size 5"):
        sampler.join(0, 5)
    with pytest.raises(DataError, match="rank 3 is not in a world of size 3"):
        sampler.join(3, 3)
    assert (sampler.rank, sampler.world_size) == (0, 2)
