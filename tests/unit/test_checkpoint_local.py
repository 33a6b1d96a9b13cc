"""Checkpoint manager in one process on local disk: commit protocol, verification, fallback, retention."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint.files import HASH_NAME, file_record
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME, Manifest
from elastic_ddp.config import TrainConfig, fingerprint
from elastic_ddp.data import ElasticSampler
from elastic_ddp.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointError,
    IncompatibleCheckpointError,
    NoValidCheckpointError,
)
from elastic_ddp.state import TrainState, model_digest


def make_state(hidden: int = 8, seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sampler = ElasticSampler(64, global_batch_size=8, seed=0, rank=0, world_size=1)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=None, sampler=sampler,
                      fingerprint={**fingerprint(TrainConfig()), "model.hidden_dim": hidden}, seed=0)


def advance(state: TrainState, steps: int = 1) -> None:
    for _ in range(steps):
        loss = state.model(torch.randn(3, 4)).sum()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        plan = state.sampler.plan()
        state.sampler.commit(plan)
        state.counters.step += 1


def manager(root: Path, keep: int = 3) -> CheckpointManager:
    return CheckpointManager(str(root), rank=0, world_size=1, run_id="unit", keep=keep)


def test_save_then_restore_round_trips_every_part(tmp_path: Path) -> None:
    state = make_state()
    advance(state, 3)
    manager(tmp_path).save(state)
    expected = model_digest(state.model.state_dict())
    fresh = make_state(seed=1)
    restored = manager(tmp_path).restore(fresh)
    assert restored is not None and restored.step == 3 and restored.rank_state_reused
    assert model_digest(fresh.model.state_dict()) == expected
    assert fresh.sampler.state_dict() == state.sampler.state_dict()
    assert fresh.optimizer.state_dict()["state"][0]["step"] == state.optimizer.state_dict()["state"][0]["step"]
    assert fresh.counters == state.counters


def test_a_restore_moves_the_counters_that_the_training_loop_already_holds(tmp_path: Path) -> None:
    """A loop holds ``state.counters`` across a restore in its process (an in-process re-formation loads the
    newest replica): the step it reads must be the restored one."""
    state = make_state()
    advance(state, 3)
    manager(tmp_path).save(state)
    fresh = make_state(seed=1)
    held = fresh.counters
    manager(tmp_path).restore(fresh)
    assert held.step == 3 and fresh.counters is held


def test_manifest_is_written_last_and_lists_sizes_and_checksums(tmp_path: Path) -> None:
    state = make_state()
    advance(state)
    manifest = manager(tmp_path).save(state)
    step_dir = tmp_path / "step-00000001"
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    for name, record in body["files"].items():
        assert os.path.getsize(step_dir / name) == record["size"]
    newest_data = max(os.stat(step_dir / name).st_mtime_ns for name in body["files"])
    assert os.stat(step_dir / MANIFEST_NAME).st_mtime_ns >= newest_data
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert manifest.step == 1 and manifest.world_size == 1


def test_a_second_commit_of_the_same_step_loses(tmp_path: Path) -> None:
    state = make_state()
    advance(state)
    manager(tmp_path).save(state)
    with pytest.raises(CheckpointConflictError, match="already exists"):
        manager(tmp_path).save(state)
    assert manager(tmp_path).restore(make_state()).step == 1


def test_create_only_raises_conflict(tmp_path: Path) -> None:
    storage = manager(tmp_path).storage
    storage.create(str(tmp_path / "x" / "m.json"), b"1")
    with pytest.raises(CheckpointConflictError):
        storage.create(str(tmp_path / "x" / "m.json"), b"2")
    assert (tmp_path / "x" / "m.json").read_bytes() == b"1"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest-garbage"])
def test_damage_to_the_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    state = make_state()
    advance(state, 2)
    manager(tmp_path).save(state)
    older = model_digest(state.model.state_dict())
    advance(state, 2)
    manager(tmp_path).save(state)
    newest = tmp_path / "step-00000004"
    target = next(newest.glob("replicated-*.eddp"))
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "delete":
        target.unlink()
    else:
        (newest / MANIFEST_NAME).write_text("{not json")
    m = manager(tmp_path)
    with pytest.raises(CheckpointCorruptError):
        m.verify(m.describe(4))
    fresh = make_state(seed=5)
    restored = m.restore(fresh)
    assert restored is not None and restored.step == 2
    assert model_digest(fresh.model.state_dict()) == older
    assert not (newest / MANIFEST_NAME).exists()  # un-committed, so step 4 can be saved again
    advance(fresh, 2)
    m.save(fresh)


def test_no_valid_checkpoint_is_an_error_unless_fresh_start_is_allowed(tmp_path: Path) -> None:
    state = make_state()
    advance(state)
    manager(tmp_path).save(state)
    next((tmp_path / "step-00000001").glob("replicated-*.eddp")).write_bytes(b"junk")
    with pytest.raises(NoValidCheckpointError, match="allow-fresh-start"):
        manager(tmp_path).restore(make_state())
    assert manager(tmp_path).restore(make_state(), allow_fresh_start=True) is None


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    state = make_state()
    advance(state)
    m = manager(tmp_path)
    saved = m.save(state)
    evil = tmp_path / "step-00000001" / saved.replicated_file

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"model": Payload()}, evil)
    # Re-list the file with its real checksum: the checksum is fine, the content is still refused.
    body = json.loads((tmp_path / "step-00000001" / MANIFEST_NAME).read_text())
    body["files"][saved.replicated_file] = {"size": evil.stat().st_size, HASH_NAME: file_record(evil.read_bytes()).digest}
    (tmp_path / "step-00000001" / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(NoValidCheckpointError, match="not a valid elastic_ddp tensor file"):
        m.restore(make_state())


def test_incompatible_model_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    state = make_state(hidden=8)
    advance(state)
    manager(tmp_path).save(state)
    other = make_state(hidden=16)
    before = model_digest(other.model.state_dict())
    with pytest.raises(IncompatibleCheckpointError, match="--model-hidden-dim"):
        manager(tmp_path).restore(other)
    assert model_digest(other.model.state_dict()) == before


def test_failed_retention_after_the_commit_is_only_a_warning(tmp_path: Path, caplog) -> None:
    state = make_state()
    m = manager(tmp_path, keep=2)
    m.apply_retention = lambda *args, **kwargs: (_ for _ in ()).throw(CheckpointError("storage hiccup"))
    advance(state)
    assert m.save(state).step == 1  # committed, and reported as committed on every rank
    m.wait_for_retention()
    assert "retention failed" in caplog.text and "storage hiccup" in caplog.text


def test_retention_keeps_the_newest_k_and_stale_leftovers_go(tmp_path: Path) -> None:
    state = make_state()
    m = manager(tmp_path, keep=2)
    leftover = tmp_path / "step-00000000"
    leftover.mkdir()
    (leftover / "replicated-deadbeef0000.eddp").write_bytes(b"partial")
    os.utime(leftover, (0, 0))
    fresh_leftover = tmp_path / "step-00000099"
    fresh_leftover.mkdir()
    for _ in range(4):
        advance(state)
        m.save(state)
    m.wait_for_retention()  # it runs behind the save
    steps = sorted(p.name for p in tmp_path.glob("step-*"))
    assert steps == ["step-00000003", "step-00000004", "step-00000099"]


def test_retention_counts_only_checkpoints_that_verify(tmp_path: Path) -> None:
    """Damaged checkpoints of higher steps (left by another run) must not push out what this run
    commits: they do not count, and are un-committed; the new ones stay and verify."""
    old = make_state()
    advance(old, 100)
    earlier = manager(tmp_path, keep=2)
    earlier.save(old)
    advance(old, 100)
    earlier.save(old)
    earlier.wait_for_retention()
    for path in tmp_path.glob("step-*/replicated-*.eddp"):
        os.truncate(path, 100)
    state, m = make_state(), manager(tmp_path, keep=2)
    for _ in range(3):
        advance(state)
        m.save(state)
        m.wait_for_retention()
    committed = [info.step for info in m.list() if info.committed]
    assert committed == [3, 2]
    for info in m.list():
        if info.committed:
            m.verify(info)
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/manifest.rejected.json")) == [
        "step-00000100", "step-00000200"]


def test_a_checkpoint_that_cannot_be_read_now_is_neither_counted_nor_removed(tmp_path: Path) -> None:
    state, m = make_state(), manager(tmp_path, keep=2)
    for _ in range(3):
        advance(state)
        m.save(state)
        m.wait_for_retention()
    reader = manager(tmp_path, keep=2)  # a new process: has verified nothing yet

    def hiccup(path: str, hash_name: str) -> tuple[bytes, object]:
        raise CheckpointError(f"{path}: storage hiccup")

    reader.storage.read_hashed = hiccup  # type: ignore[method-assign]
    assert reader.retention_plan(keep=1) == []
    assert reader.apply_retention(keep=1) == []
    assert [info.step for info in reader.list() if info.committed] == [3, 2]


def test_manifest_validation_rejects_path_traversal() -> None:
    body = {
        "format_version": 1, "step": 1, "epoch": 0, "cursor": 8, "samples_seen": 8, "world_size": 1, "generation": 0,
        "run_id": "r", "data_digest": "0" * 64, "fingerprint": {}, "token": "abcdef012345", "torch_version": "x",
        "created_at": 0.0, "files": {"../evil": {"size": 1, "sha256": "0" * 64}},
    }
    with pytest.raises(CheckpointCorruptError, match="not allowed"):
        Manifest.from_json(json.dumps(body).encode(), "test")


def test_a_manifest_lists_every_ranks_file_unless_it_says_it_holds_no_rank_state() -> None:
    token = "abcdef012345"
    body = {
        "format_version": 2, "step": 1, "world_size": 2, "generation": 0, "run_id": "r", "meta": {"step": 1},
        "token": token, "torch_version": "x", "created_at": 0.0,
        "files": {f"replicated-{token}.eddp": {"size": 1, "sha256": "0" * 64}},
    }
    with pytest.raises(CheckpointCorruptError, match=f"rank-00000-{token}.eddp, rank-00001-{token}.eddp not listed"):
        Manifest.from_json(json.dumps(body).encode(), "test")
    partial = Manifest.from_json(json.dumps({**body, "rank_state": False}).encode(), "test")
    assert not partial.resumes_rank_state_at(2) and not partial.resumes_rank_state_at(1)
    assert Manifest.from_json(partial.to_json(), "again") == partial
    with pytest.raises(CheckpointCorruptError, match="rank_state is not a boolean"):
        Manifest.from_json(json.dumps({**body, "rank_state": "no"}).encode(), "test")
    whole = {**body, "files": {**body["files"], **{f"rank-0000{r}-{token}.eddp": {"size": 1, "sha256": "0" * 64}
                                                   for r in range(2)}}}
    complete = Manifest.from_json(json.dumps(whole).encode(), "test")
    assert complete.resumes_rank_state_at(2) and not complete.resumes_rank_state_at(3)


def test_sharded_optimizer_resume_continues_bitwise(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def zero_state(seed: int) -> TrainState:
            state = make_state(seed=seed)
            state.optimizer = ZeroRedundancyOptimizer(state.model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
            state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0 / (step + 1))
            return state

        torch.manual_seed(1)
        straight = zero_state(0)
        advance(straight, 2)
        manager(tmp_path).save(straight)
        resumed = zero_state(5)
        manager(tmp_path).restore(resumed)
        torch.manual_seed(2)
        advance(straight, 2)
        torch.manual_seed(2)
        advance(resumed, 2)
        assert model_digest(resumed.model.state_dict()) == model_digest(straight.model.state_dict())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.01),
    lambda params: torch.optim.SGD([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:]}], lr=0.1, momentum=0.9),
])
def test_any_optimizer_is_sharded_with_its_class_defaults_and_param_groups(make) -> None:
    import torch.distributed as dist

    from elastic_ddp.parts import shard_optimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = make_state()
        plain = make(list(state.model.parameters()))
        sharded = shard_optimizer(make(list(state.model.parameters())))
        assert type(sharded.optim) is type(plain)
        assert [{k: v for k, v in g.items() if k != "params"} for g in sharded.param_groups] == \
               [{k: v for k, v in g.items() if k != "params"} for g in plain.param_groups]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("content", [[1, 2, 3], {"model": [1, 2]}, {"model": {}, "optimizer": {"state": 3}}])
def test_a_file_with_a_valid_hash_but_the_wrong_structure_is_one_error_naming_the_checkpoint(tmp_path: Path, content) -> None:
    from elastic_ddp.checkpoint.format import encode_chunks, flatten

    state = make_state()
    advance(state)
    saved = manager(tmp_path).save(state)
    path = tmp_path / "step-00000001" / saved.replicated_file
    path.write_bytes(b"".join(bytes(chunk) for chunk in encode_chunks(flatten(content))))
    body = json.loads((tmp_path / "step-00000001" / MANIFEST_NAME).read_text())
    body["files"][saved.replicated_file] = {"size": path.stat().st_size, HASH_NAME: file_record(path.read_bytes()).digest}
    (tmp_path / "step-00000001" / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"step(-0000000| )1"):  # one error naming the step, not a KeyError
        manager(tmp_path).restore(make_state())


def test_an_unexpected_error_in_the_commit_keeps_its_traceback(tmp_path: Path, caplog) -> None:
    m = manager(tmp_path)

    def broken_create(path: str, data: bytes) -> None:
        raise RuntimeError("a bug in the storage layer")

    m.storage.create = broken_create  # type: ignore[method-assign]
    state = make_state()
    advance(state)
    with pytest.raises(CheckpointError, match="RuntimeError: a bug in the storage layer") as raised:
        m.save(state)
    assert isinstance(raised.value.__cause__, RuntimeError)
    logged = [record for record in caplog.records if record.exc_info and "failed unexpectedly" in record.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info[0] is RuntimeError


def test_another_ranks_damaged_file_rejects_the_checkpoint_while_rank_0_reads_its_own(tmp_path: Path, caplog) -> None:
    """Rank 0 verifies the other ranks' files (on threads) beside its own: one that does not match rejects the step."""
    import shutil

    state = make_state()
    saver = manager(tmp_path)
    advance(state, 2)
    saver.save(state)
    advance(state, 2)
    saved = saver.save(state)
    saver.wait_for_retention()  # it verifies in the background: not while this test rewrites the files
    step_dir = tmp_path / "step-00000004"
    other = step_dir / saved.rank_file(0).replace("rank-00000", "rank-00001")
    shutil.copy(step_dir / saved.rank_file(0), other)
    body = json.loads((step_dir / MANIFEST_NAME).read_text())
    body["files"][other.name] = {"size": other.stat().st_size, HASH_NAME: file_record(other.read_bytes()).digest}
    body["world_size"] = 2
    (step_dir / MANIFEST_NAME).write_text(json.dumps(body))
    m = manager(tmp_path)
    m.verify(m.describe(4))  # listed correctly: it verifies
    data = bytearray(other.read_bytes())
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    restored = m.restore(make_state(seed=3))
    assert restored is not None and restored.step == 2
    assert (step_dir / "manifest.rejected.json").exists()
    assert f"{other}: sha256" in caplog.text
