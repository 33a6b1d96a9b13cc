"""Node-memory replicas in one process: saved in the checkpoint layout, preferred over older commits,
skipped (never partly loaded) when damaged, kept two deep, removed when the run is done."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME
from elastic_ddp.checkpoint.replica import Replicas
from elastic_ddp.events import EventLog, read_events
from elastic_ddp.state import TrainState, model_digest
from tests.unit.test_checkpoint_local import advance, make_state


def replicas(root: Path, manager: CheckpointManager, events: EventLog | None = None, generation: int = 1) -> Replicas:
    return Replicas(str(root), run_id="unit", checkpoint_uri=manager.uri, rank=0, world_size=1, local_rank=0, node_rank=0,
                    token=manager.token, every=1, events=events, generation=generation)


def replicate(state: TrainState, node: Replicas, steps: int = 1) -> None:
    """Train ``steps`` more steps, keeping a replica of each (each write finished before the next step)."""
    for _ in range(steps):
        advance(state, 1)
        node.save(state)
        node.wait()


def test_a_replica_newer_than_the_newest_commit_is_resumed(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    advance(state, 2)
    storage.save(state)
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node)
    expected = model_digest(state.model.state_dict()), state.sampler.state_dict(), torch.get_rng_state()
    events = EventLog(str(tmp_path / "logs"), run_id="unit", rank=0)
    fresh = make_state(seed=1)
    restored = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit", events=events).restore(
        fresh, replicas=replicas(tmp_path / "shm", storage))
    assert restored is not None and (restored.step, restored.source, restored.rank_state_reused) == (3, "replica", True)
    assert model_digest(fresh.model.state_dict()) == expected[0]
    assert fresh.sampler.state_dict() == expected[1]
    assert torch.equal(torch.get_rng_state(), expected[2])
    resumed = [e for e in read_events(tmp_path / "logs")[0] if e["event"] == "resumed"]
    assert [(e["step"], e["source"]) for e in resumed] == [(3, "replica")]


def test_a_replica_older_than_the_newest_commit_is_not_used(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    advance(state, 1)
    replicate(state, node)
    advance(state, 1)
    storage.save(state)
    restored = storage.restore(make_state(seed=1), replicas=replicas(tmp_path / "shm", storage))
    assert restored is not None and (restored.step, restored.source) == (3, "storage")


def test_a_damaged_replica_falls_back_to_storage_without_loading_any_of_it(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    advance(state, 2)
    storage.save(state)
    committed = model_digest(state.model.state_dict())
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node)
    (held,) = node.held()
    data = next(Path(held.path).glob("replicated-*"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    events = EventLog(str(tmp_path / "logs"), run_id="unit", rank=0)
    fresh = make_state(seed=1)
    restored = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit", events=events).restore(
        fresh, replicas=replicas(tmp_path / "shm", storage, events))
    assert restored is not None and (restored.step, restored.source) == (2, "storage")
    assert model_digest(fresh.model.state_dict()) == committed
    skipped = [e for e in read_events(tmp_path / "logs")[0] if e["event"] == "checkpoint_skipped"]
    assert skipped and "does not match the replica's manifest" in skipped[0]["reason"]


def test_a_replica_without_its_manifest_is_not_a_replica(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node)
    (held,) = node.held()
    (Path(held.path) / MANIFEST_NAME).unlink()
    assert node.held() == []
    assert storage.restore(make_state(seed=1), allow_fresh_start=True, replicas=node) is None


def test_each_node_keeps_its_two_newest_replicas_and_drops_them_when_done(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node, 4)
    assert [held.manifest.step for held in node.held()] == [4, 3]
    manifest = json.loads((Path(node.held()[0].path) / MANIFEST_NAME).read_bytes())
    assert manifest["meta"]["step"] == 4 and manifest["world_size"] == 1
    node.discard()
    assert not list((tmp_path / "shm").iterdir())


def test_a_new_launch_over_an_empty_checkpoint_location_ignores_replicas_of_an_earlier_one(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    advance(state, 2)
    replicate(state, node)
    assert storage.restore(make_state(seed=1), allow_fresh_start=True,
                           replicas=replicas(tmp_path / "shm", storage, generation=0)) is None
    restored = storage.restore(make_state(seed=1), replicas=replicas(tmp_path / "shm", storage, generation=1))
    assert restored is not None and (restored.step, restored.source) == (3, "replica")


def test_replicas_of_another_checkpoint_location_are_not_candidates(tmp_path: Path) -> None:
    state = make_state()
    node = replicas(tmp_path / "shm", CheckpointManager(str(tmp_path / "a"), rank=0, world_size=1, run_id="unit"))
    advance(state, 2)
    replicate(state, node)
    other = CheckpointManager(str(tmp_path / "b"), rank=0, world_size=1, run_id="unit")
    assert other.restore(make_state(seed=1), allow_fresh_start=True, replicas=replicas(tmp_path / "shm", other)) is None
