"""Node-memory replicas in one process: saved in the checkpoint layout, preferred over older commits,
skipped (never partly loaded) when damaged, kept two deep, removed when the run is done."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def test_a_write_cut_short_leaves_the_previous_replica_whole(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node, 2)
    at_two = model_digest(state.model.state_dict())
    # the worker dies after copying step 3 into its slot and before the manifest: the write never happens
    node._write = lambda *args: None  # type: ignore[method-assign]
    advance(state, 1)
    node.save(state)
    node.wait()
    assert [held.manifest.step for held in node.held()] == [2]
    fresh = make_state(seed=1)
    restored = storage.restore(fresh, replicas=replicas(tmp_path / "shm", storage))
    assert restored is not None and (restored.step, restored.source) == (2, "replica")
    assert model_digest(fresh.model.state_dict()) == at_two


def test_replicas_are_written_in_place_in_two_slots(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage)
    replicate(state, node, 2)
    files = {held.path: next(Path(held.path).glob("replicated-*")).stat().st_ino for held in node.held()}
    replicate(state, node, 4)
    assert [held.manifest.step for held in node.held()] == [6, 5]
    assert {held.path: next(Path(held.path).glob("replicated-*")).stat().st_ino for held in node.held()} == files
    assert all(held.manifest.hash == "xxh3-128" for held in node.held())


def test_the_interval_grows_so_that_replicas_stay_within_their_budget(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = Replicas(str(tmp_path / "shm"), run_id="unit", checkpoint_uri=storage.uri, rank=0, world_size=1,
                    local_rank=0, node_rank=0, token=storage.token, every=2, budget=0.03)
    assert [step for step in range(1, 7) if node.due(step)] == [2, 4, 6]
    # measured: a replica takes 1 ms of CPU, a training step 10 ms: 3% allows one every 3.3 steps, so every 4
    node._cost, node._step_time = 0.001, 0.010
    assert node._proposal() == 4
    node._measure = lambda step, now: None  # type: ignore[method-assign]
    advance(state, 2)
    node.save(state)
    node.wait()
    assert node.interval == 4 and [step for step in range(3, 11) if node.due(step)] == [6, 7, 8, 9, 10]
    unlimited = Replicas(str(tmp_path / "shm2"), run_id="unit", checkpoint_uri=storage.uri, rank=0, world_size=1,
                         local_rank=0, node_rank=0, token=storage.token, every=2, budget=0.0)
    unlimited._cost, unlimited._step_time = 0.001, 0.010
    assert unlimited._proposal() == 2


def test_a_stored_checkpoint_must_be_checksummed_with_sha256(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    advance(state, 2)
    storage.save(state)
    manifest_path = tmp_path / "ckpt" / "step-00000002" / MANIFEST_NAME
    body = json.loads(manifest_path.read_bytes())
    body["hash"] = "xxh3-128"
    body["files"] = {name: {"size": record["size"], "xxh3-128": "0" * 32} for name, record in body["files"].items()}
    manifest_path.write_text(json.dumps(body))
    (info,) = storage.list()
    assert info.manifest is None and "a stored checkpoint needs sha256" in str(info.problem)


class _Small:
    """A CheckpointState whose rank state can grow (for the exchange buffer's size)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step, self.extra = rank, 0, 0

    def meta(self) -> dict[str, Any]:
        return {"step": self.step}

    def replicated_state_dict(self) -> dict[str, Any]:
        return {"weights": torch.full((4,), float(self.step))}

    def rank_state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "extra": "x" * self.extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - not restored here
        raise AssertionError


def _two_ranks(rank: int, root: str, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    node = Replicas(root, run_id="unit", checkpoint_uri="file:///unit", rank=rank, world_size=2, local_rank=0,
                    node_rank=rank, token="abcdef12", every=1, budget=0.03)
    state = _Small(rank)
    seen = []
    for step in range(1, 17):
        state.step = step
        if rank == 1:
            node._cost, node._step_time = 0.002, 0.010  # this rank measured a dear replica: it asks for 7 steps
        node._measure = lambda step, now: None  # type: ignore[method-assign]
        state.extra = 100_000 if step == 8 else 0  # outgrows the exchange buffer once
        if node.due(step):
            node.save(state)
            node.wait()
            seen.append((step, node.interval, node.stats.written))
    node.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_ranks_agree_on_the_largest_interval_and_skip_a_replica_whose_state_outgrew_the_exchange(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_two_ranks, args=(str(tmp_path / "shm"), init, str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # rank 0 asks for every step, rank 1 for every 7: both take 7 (first replica at step 1, next at 8, then 15)
    assert seen[0] == seen[1]
    steps = [step for step, _, _ in seen[0]]
    assert steps == [1, 8, 15] and all(interval == 7 for _, interval, _ in seen[0])
    # step 8's rank state did not fit the buffer agreed at step 1: no node wrote that replica; step 15's did
    assert [written for _, _, written in seen[0]] == [1, 1, 2]


def test_a_node_that_cannot_write_replicas_warns_once_and_trains_on(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the replica directory should be")
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(blocked, storage)
    with caplog.at_level("WARNING"):
        replicate(state, node, 3)
    assert node.stats.saves == 3 and node.stats.written == 0
    assert len([r for r in caplog.records if "writing a replica" in r.getMessage()]) == 1
    assert node.held() == []
