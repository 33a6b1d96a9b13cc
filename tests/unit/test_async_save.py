"""Asynchronous saves: bounded staging, errors surfaced, previous checkpoint intact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.async_save import AsyncCheckpointer
from elastic_ddp.checkpoint.storage import LocalStorage
from elastic_ddp.errors import CheckpointError
from elastic_ddp.state import model_digest
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
    manager, _ = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state)
    saver.save(state)
    saver.wait()
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
    manager, storage = make(tmp_path)
    saver = AsyncCheckpointer(manager)
    state = make_state()
    advance(state)
    saver.save(state)
    saver.wait()
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
