"""The runtime's two rooms: the process's guards and one membership's world, each built in one place when the
runtime is entered and closed at its end, and the lifecycle they pass through (one process, no group)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from elastic_ddp.config import CheckpointConfig
from elastic_ddp.data import ElasticSampler
from elastic_ddp.errors import UsageError
from elastic_ddp.events import EventLog
from elastic_ddp.runtime import Lifecycle, Runtime
from elastic_ddp.world import World

DATASET, BATCH = 64, 16


def _runtime(tmp_path: Path) -> Runtime:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    sampler = ElasticSampler(DATASET, global_batch_size=BATCH, seed=0, rank=0, world_size=1)
    return Runtime.for_loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler,
                            events=EventLog(str(tmp_path / "logs"), run_id="t", rank=0),
                            checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2, replica_every=0))


def _step(runtime: Runtime, step: int) -> bool:
    sampler = runtime.state.sampler
    plan = sampler.plan()
    runtime.state.model(torch.ones(plan.size, 2)).sum().backward()
    runtime.state.optimizer.step()
    sampler.commit(plan)
    return runtime.after_step(step).stop is not None


def test_a_runtime_passes_from_built_through_training_to_closed(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    assert runtime.lifecycle is Lifecycle.BUILT and runtime.world is None and runtime.guards is None
    with runtime:
        assert runtime.lifecycle is Lifecycle.OPEN
        assert isinstance(runtime.world, World) and (runtime.rank, runtime.world_size) == (0, 1)
        assert runtime.restore() == 0
        assert runtime.lifecycle is Lifecycle.TRAINING
        assert not any(_step(runtime, step) for step in (1, 2, 3))
    assert runtime.lifecycle is Lifecycle.CLOSED and runtime.exit_status == 0
    assert runtime.world is None and runtime.guards is None


def test_each_membership_starts_from_the_last_commit_of_the_one_before(tmp_path: Path) -> None:
    with _runtime(tmp_path) as runtime:
        runtime.restore()
        _step(runtime, 1)
        _step(runtime, 2)  # committed: every 2
        _step(runtime, 3)
    with _runtime(tmp_path) as again:
        assert again.restore() == 3  # the final checkpoint of the first
        assert again.world is not None and again.world.last_commit_step == 3


def test_finishing_commits_once_and_leaves_the_world_open_until_the_block_ends(tmp_path: Path) -> None:
    with _runtime(tmp_path) as runtime:
        runtime.restore()
        _step(runtime, 1)
        runtime.finish()
        assert runtime.lifecycle is Lifecycle.FINISHED and runtime.world is not None
        runtime.finish()  # once: the block's end does nothing more
    assert runtime.exit_status == 0


def test_a_world_that_fails_to_start_closes_the_guards_started_before_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    before = signal.getsignal(signal.SIGTERM)

    def refuse(self: World, **kwargs: object) -> None:
        raise OSError("no storage")

    monkeypatch.setattr(World, "__init__", refuse)
    runtime = _runtime(tmp_path)
    with pytest.raises(OSError, match="no storage"), runtime:
        pass
    assert runtime.lifecycle is Lifecycle.CLOSED and runtime.guards is None
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_runtime_is_entered_once_and_refuses_calls_outside_it(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    with pytest.raises(UsageError, match="outside the runtime"):
        runtime.after_step(1)
    with runtime:
        with pytest.raises(UsageError, match="before runtime.restore"):
            runtime.save()
        runtime.restore()
    with pytest.raises(UsageError, match="entered once"), runtime:
        pass
