"""Node-memory replicas in one process: saved in the checkpoint layout, preferred over older commits,
skipped (never partly loaded) when damaged, kept two deep, removed when the run is done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME
from elastic_ddp.checkpoint.replica import Replicas, _node_lock
from elastic_ddp.events import EventLog, read_events
from elastic_ddp.state import TrainState, derive_rng_seed, model_digest
from tests.unit.test_checkpoint_local import advance, make_state


def replicas(root: Path, manager: CheckpointManager, events: EventLog | None = None, generation: int = 1,
             rank: int = 0, world_size: int = 1, agent: str = "") -> Replicas:
    """Rank ``rank`` of ``world_size`` on node 0 (its ``rank``-th worker: rank 0 writes the node's replicas)."""
    return Replicas(str(root), run_id="unit", checkpoint_uri=manager.uri, rank=rank, world_size=world_size,
                    local_rank=rank, node_rank=0, token=manager.token, every=1, events=events, generation=generation,
                    agent=agent)


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


def test_a_re_formation_by_the_same_agent_uses_its_replicas_before_any_checkpoint(tmp_path: Path) -> None:
    """torchrun restarts the workers of a membership change without counting a restart (generation 0): the
    agent that started the earlier group is what tells the re-formation from a new launch."""
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    node = replicas(tmp_path / "shm", storage, generation=0, agent="4242-1796280000.125")
    advance(state, 2)
    replicate(state, node)
    node.close()
    again = replicas(tmp_path / "shm", storage, generation=0, agent="4242-1796280000.125")
    restored = storage.restore(make_state(seed=1), replicas=again)
    assert restored is not None and (restored.step, restored.source) == (3, "replica")
    other = replicas(tmp_path / "shm", storage, generation=0, agent="4243-1796280999.5")  # a new launch's agent
    assert storage.restore(make_state(seed=1), allow_fresh_start=True, replicas=other) is None
    again.discard()
    other.discard()
    assert not list((tmp_path / "shm").iterdir())


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


# -- rescue: the live state a survivor keeps after a peer's loss ----------------------------------------------------


def test_a_rescue_newer_than_the_last_replica_is_resumed_with_rng_streams_re_derived(tmp_path: Path) -> None:
    """A survivor kept step 5 after its peer's loss; the periodic replica is of step 3. The restart resumes
    from step 5: model, optimizer and data position of step 5, RNG streams derived (the lost ranks' are gone)."""
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    advance(state, 2)
    storage.save(state)
    events = EventLog(str(tmp_path / "logs"), run_id="unit", rank=0)
    node = replicas(tmp_path / "shm", storage, events=events)
    replicate(state, node)
    advance(state, 2)
    path = node.rescue(state)
    assert path is not None and Path(path).name == "rescue"
    manifest = json.loads((Path(path) / MANIFEST_NAME).read_bytes())
    assert (manifest["step"], manifest["rank_state"], sorted(manifest["files"])) == (
        5, False, [f"replicated-{storage.token}.eddp"])
    expected = model_digest(state.model.state_dict()), state.optimizer.state_dict()["state"][0]["exp_avg"].clone(), \
        state.sampler.state_dict()
    fresh = make_state(seed=1)
    restored = storage.restore(fresh, replicas=replicas(tmp_path / "shm", storage))
    assert restored is not None and (restored.step, restored.source, restored.rank_state_reused) == (5, "replica", False)
    assert restored.path == path
    assert model_digest(fresh.model.state_dict()) == expected[0]
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"], expected[1])
    assert fresh.sampler.state_dict() == expected[2]
    drawn = torch.randn(3)
    torch.manual_seed(derive_rng_seed(0, 5, 0))
    assert torch.equal(drawn, torch.randn(3))
    saved = [(e["step"], e["reason"]) for e in read_events(tmp_path / "logs")[0] if e["event"] == "replica_saved"]
    assert saved == [(3, "due"), (5, "rescue")]


def test_one_survivor_per_node_keeps_the_state_and_none_when_the_step_is_already_held(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=2, run_id="unit")
    first, second = (replicas(tmp_path / "shm", storage, rank=rank, world_size=2) for rank in (0, 1))
    advance(state, 4)
    os.makedirs(first.own)
    with _node_lock(os.path.join(first.own, "rescue.lock")) as locked:  # another survivor is writing
        assert locked and first.rescue(state) is None
    assert first.held() == []
    assert first.rescue(state) is not None
    assert second.rescue(state) is None  # the node holds step 4 already
    periodic = replicas(tmp_path / "shm2", storage)
    periodic.save(state)
    periodic.wait()
    assert periodic.rescue(state) is None  # its replica of step 4 holds every rank's streams too
    assert [held.manifest.step for held in second.held()] == [4]


def test_after_resuming_from_a_rescue_it_is_removed_once_a_newer_replica_is_committed(tmp_path: Path) -> None:
    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    replicate(state, replicas(tmp_path / "shm", storage), 2)
    advance(state, 1)
    rescue = replicas(tmp_path / "shm", storage).rescue(state)
    restarted = replicas(tmp_path / "shm", storage)
    restored = storage.restore(state, replicas=restarted)
    assert restored is not None and restored.path == rescue
    assert [held.path for held in restarted.held()] == [rescue]  # the older slots are gone
    replicate(state, restarted)
    assert [(held.manifest.step, Path(held.path).name) for held in restarted.held()] == [(4, "slot-0")]


def test_two_nodes_rescues_of_one_step_are_one_replica_only_if_their_bytes_are(tmp_path: Path) -> None:
    from elastic_ddp.checkpoint.replica import _choose, _identity

    state = make_state()
    storage = CheckpointManager(str(tmp_path / "ckpt"), rank=0, world_size=1, run_id="unit")
    advance(state, 2)
    same = [_identity(held.manifest) for root in ("a", "b") for held in _rescued(tmp_path / root, storage, state)]
    assert same[0] == same[1]
    with torch.no_grad():
        state.model[0].bias[0] += 1
    other = _identity(_rescued(tmp_path / "c", storage, state)[0].manifest)
    assert other[:2] == same[0][:2] and other != same[0]
    chosen = _choose([[same[0]], [other], [same[1]]], None)
    assert chosen is not None and (chosen[1] == [0, 2] if chosen[0] == same[0] else chosen[1] == [1])


def _rescued(root: Path, storage: CheckpointManager, state: TrainState) -> list[Any]:
    node = replicas(root, storage)
    assert node.rescue(state) is not None
    return node.held()
