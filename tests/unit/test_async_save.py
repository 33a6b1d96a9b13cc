"""Asynchronous saves: bounded staging, errors surfaced, previous checkpoint intact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.checkpoint.manager import Staged
from elastic_ddp.checkpoint.storage import LocalStorage
from elastic_ddp.errors import CheckpointError
from elastic_ddp.state import TrainState, model_digest
from tests.unit.test_checkpoint_local import advance, make_state


class GatedStorage(LocalStorage):
    """Local storage whose writes wait for a gate and can be told to fail (a slow or broken store)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def write(self, path, chunks):
        if not self.gate.wait(timeout=30):
            raise AssertionError("gate never opened")
        if self.fail:
            raise OSError(5, "Input/output error (injected)")
        return super().write(path, chunks)


def make(tmp_path: Path) -> tuple[CheckpointManager, GatedStorage]:
    storage = GatedStorage(str(tmp_path))
    return CheckpointManager(str(tmp_path), rank=0, world_size=1, run_id="unit", storage=storage), storage


def committed_once(tmp_path: Path) -> tuple[CheckpointManager, GatedStorage, AsyncCheckpointer, TrainState]:
    """A saver whose first save, of step 1, is committed."""
    manager, storage = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state)
    saver.save(state)
    saver.wait()
    return manager, storage, saver, state


def test_staged_snapshot_is_unaffected_by_later_training(tmp_path: Path) -> None:
    manager, storage = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state, 2)
    expected = model_digest(state.model.state_dict())
    storage.gate.clear()  # the write cannot start until training has moved on
    saver.save(state)
    advance(state, 3)
    storage.gate.set()
    saver.wait()
    fresh = make_state(seed=3)
    assert manager.restore(fresh).step == 2
    assert model_digest(fresh.model.state_dict()) == expected
    saver.close()


def test_staging_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    manager, _, saver, state = committed_once(tmp_path)
    first = [t.data_ptr() for f in manager.stager._buffers.values() for t in f]
    advance(state)
    saver.save(state)
    saver.wait()
    assert [t.data_ptr() for f in manager.stager._buffers.values() for t in f] == first
    saver.close()


def test_a_save_due_while_one_is_in_flight_waits_for_it(tmp_path: Path) -> None:
    manager, storage = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state)
    storage.gate.clear()
    saver.save(state)
    advance(state)
    opener = threading.Timer(0.2, storage.gate.set)
    opener.start()
    blocked = saver.save(state)  # must wait for step 1 to commit before staging step 2
    assert blocked >= 0.15 and saver.last_committed is not None and saver.last_committed.step == 1
    saver.wait()
    assert [info.step for info in manager.list()] == [2, 1]
    saver.close()


def test_background_failure_is_raised_at_the_next_poll_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    manager, storage, saver, state = committed_once(tmp_path)
    storage.fail = True
    advance(state)
    saver.save(state)
    with pytest.raises(CheckpointError, match="step 2 .* not committed: rank 0 could not write .*Input/output error"):
        saver.wait()
    storage.fail = False
    assert manager.restore(make_state(seed=9)).step == 1
    saver.close()


def test_poll_does_not_block_on_a_running_save(tmp_path: Path) -> None:
    manager, storage = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state)
    storage.gate.clear()
    saver.save(state)
    saver.poll()  # returns at once: nothing finished yet
    assert saver.busy
    storage.gate.set()
    saver.close()
    assert not saver.busy


@pytest.fixture
def staging_gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds the background copy of parameters and optimizer state until the test opens it."""
    gate = threading.Event()
    copy = Staged.finish_staging

    def gated(staged: Staged) -> None:
        if not gate.wait(timeout=30):
            raise AssertionError("staging gate never opened")
        copy(staged)

    monkeypatch.setattr(Staged, "finish_staging", gated)
    return gate


def test_the_optimizer_step_after_a_save_waits_for_the_background_copy(tmp_path: Path, staging_gate: threading.Event) -> None:
    manager, _ = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state, 2)
    expected = model_digest(state.model.state_dict())
    saver.save(state)  # returns before parameters and optimizer state are copied
    stepping = threading.Thread(target=advance, args=(state, 1))
    stepping.start()
    stepping.join(timeout=0.5)
    assert stepping.is_alive(), "the optimizer stepped before the checkpoint's copy of its state was taken"
    assert model_digest(state.model.state_dict()) == expected
    staging_gate.set()
    stepping.join(timeout=30)
    assert not stepping.is_alive() and saver.last_step_wait >= 0.4
    saver.wait()
    fresh = make_state(seed=3)
    assert manager.restore(fresh).step == 2
    assert model_digest(fresh.model.state_dict()) == expected
    assert model_digest(state.model.state_dict()) != expected  # the step did run, after the copy
    saver.close()


def test_buffers_are_copied_before_save_returns(tmp_path: Path, staging_gate: threading.Event) -> None:
    """A forward pass changes batch-norm statistics: those cannot wait for the background copy."""
    manager, _ = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    norm = torch.nn.BatchNorm1d(2)
    state.model.append(norm)
    advance(state, 1)
    before = norm.running_mean.clone()
    saver.save(state)
    state.model(torch.randn(16, 4) * 5)  # training-mode forward: updates running_mean in place
    assert not torch.equal(norm.running_mean, before)
    staging_gate.set()
    saver.wait()
    fresh = make_state(seed=3)
    fresh.model.append(torch.nn.BatchNorm1d(2))
    manager.restore(fresh)
    assert torch.equal(fresh.model[2].running_mean, before)
    saver.close()


def test_a_failed_background_copy_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, _, saver, state = committed_once(tmp_path)

    def broken(staged: Staged) -> None:
        raise RuntimeError("copy failed (injected)")

    monkeypatch.setattr(Staged, "finish_staging", broken)
    advance(state)
    saver.save(state)
    advance(state)  # the step is not held forever by a copy that failed
    expected = "step 2 .* not committed: rank 0 could not stage its state: RuntimeError: copy failed"
    with pytest.raises(CheckpointError, match=expected):
        saver.wait()
    assert [info.step for info in manager.list() if info.committed] == [1]
    saver.close()
