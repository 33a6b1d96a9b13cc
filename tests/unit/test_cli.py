"""The elastic-ddp ckpt commands on checkpoints written by the manager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_ddp.cli import main
from tests.unit.test_checkpoint_local import advance, make_state, manager


@pytest.fixture
def root(tmp_path: Path) -> Path:
    state = make_state()
    m = manager(tmp_path, keep=5)
    for _ in range(3):
        advance(state, 2)
        m.save(state)
    return tmp_path


def test_ls_lists_every_step_newest_first_with_validity(root: Path, capsys) -> None:
    assert main(["ckpt", "ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["6", "4", "2"]
    assert all(line.rstrip().endswith("yes") for line in lines[1:])


def test_inspect_json_has_position_and_digests(root: Path, capsys) -> None:
    assert main(["ckpt", "inspect", str(root), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["step"] == 6 and facts["world_size"] == 1
    for key in ("epoch", "cursor", "model_digest", "data_digest"):
        assert key in facts
    assert len(facts["model_digest"]) == 64


def test_inspect_a_step_directory(root: Path, capsys) -> None:
    assert main(["ckpt", "inspect", str(root / "step-00000004"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4


def test_verify_fails_naming_the_damaged_file(root: Path, capsys) -> None:
    target = next((root / "step-00000004").glob("rank-*.eddp"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {target}" in out and "sha256" in out
    assert main(["ckpt", "verify", str(root), "--step", "6"]) == 0


def test_gc_and_rm_dry_run_change_nothing(root: Path, capsys) -> None:
    before = sorted(p.name for p in root.glob("step-*"))
    assert main(["ckpt", "gc", str(root), "--keep", "1", "--dry-run"]) == 0
    assert main(["ckpt", "rm", str(root), "--step", "2", "--dry-run"]) == 0
    assert sorted(p.name for p in root.glob("step-*")) == before
    assert "would remove" in capsys.readouterr().out


def test_gc_keeps_the_newest_and_rm_deletes_one(root: Path) -> None:
    assert main(["ckpt", "gc", str(root), "--keep", "2"]) == 0
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    assert main(["ckpt", "rm", str(root / "step-00000004")]) == 0
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006"]


def test_errors_are_one_line_without_traceback(tmp_path: Path, capsys) -> None:
    assert main(["ckpt", "inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("elastic-ddp: error: no valid checkpoint") and "Traceback" not in err


def test_ls_and_verify_of_a_root_that_does_not_exist_fail_naming_it(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nowhere")
    assert main(["ckpt", "ls", missing]) == 1
    assert main(["ckpt", "verify", missing]) == 1
    assert capsys.readouterr().err.count(f"elastic-ddp: error: {missing} does not exist") == 2


def test_verify_fails_naming_a_step_whose_manifest_is_garbage(root: Path, capsys) -> None:
    (root / "step-00000004" / "manifest.json").write_text("{not json")
    assert main(["ckpt", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "step-00000004" in out and "ok    " in out


def test_verify_fails_a_manifest_that_lists_no_file_for_one_rank(root: Path, capsys) -> None:
    path = root / "step-00000006" / "manifest.json"
    body = json.loads(path.read_text())
    body["world_size"] = 2  # as if rank 1's entry were lost: resuming at world size 2 would fail on rank 1
    path.write_text(json.dumps(body))
    assert main(["ckpt", "verify", str(root), "--step", "6"]) == 1
    assert "rank-00001-" in capsys.readouterr().out


def test_rm_dry_run_of_a_step_that_does_not_exist_fails(root: Path, capsys) -> None:
    assert main(["ckpt", "rm", str(root), "--step", "999", "--dry-run"]) == 1
    assert "step-00000999 does not exist" in capsys.readouterr().err


def test_inspect_a_step_directory_named_relative_to_the_working_directory(root: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(root)
    assert main(["ckpt", "inspect", "step-00000004", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4


def test_storage_options_are_accepted_after_the_subcommand(root: Path, capsys) -> None:
    assert main(["ckpt", "ls", str(root), "--storage-options", "{}"]) == 0
    assert main(["ckpt", "ls", str(root), "--storage-options", "[1]"]) == 1
    assert "must be a JSON object" in capsys.readouterr().err
