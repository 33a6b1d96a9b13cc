"""The elastic-ddp ckpt commands on checkpoints written by the manager."""

from __future__ import annotations

import json
import re
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


@pytest.fixture
def out(tmp_path_factory) -> Path:
    """Where exports go: not the checkpoint root."""
    return tmp_path_factory.mktemp("out")


def _export(root: Path, to: Path, *more: str) -> int:
    return main(["ckpt", "export", str(root), "--to", str(to), *more])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_writes_a_model_state_dict_with_the_digest_inspect_shows(root: Path, out: Path, suffix: str, capsys) -> None:
    import torch
    from safetensors.torch import load_file

    from elastic_ddp.state import model_digest

    assert main(["ckpt", "inspect", str(root / "step-00000004"), "--json"]) == 0
    digest = json.loads(capsys.readouterr().out)["model_digest"]
    target = out / f"model{suffix}"
    assert _export(root, target, "--step", "4") == 0
    assert "step 4" in capsys.readouterr().out
    model = make_state(seed=9).model
    loaded = load_file(str(target)) if suffix == ".safetensors" else torch.load(target, weights_only=True)
    model.load_state_dict(loaded)  # strict: exactly the model's keys
    assert model_digest(model.state_dict()) == digest
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []


def test_export_of_the_optimizer_and_everything_to_pt_loads_without_pickle(root: Path, out: Path) -> None:
    import torch

    assert _export(root, out / "optim.pt", "--what", "optimizer") == 0
    optimizer = torch.load(out / "optim.pt", weights_only=True)
    make_state().optimizer.load_state_dict(optimizer)
    assert _export(root, out / "all.pt", "--what", "all") == 0
    assert set(torch.load(out / "all.pt", weights_only=True)) >= {"model", "optimizer", "scheduler"}


@pytest.mark.parametrize("args, message", [
    (["--to", "model.bin"], "must end in .safetensors or .pt"),
    (["--to", "model.pt", "--step", "5"], r"no committed checkpoint of step 5 under .* \(committed steps: 6, 4, 2\)"),
    (["--to", "optim.safetensors", "--what", "optimizer"], "not a flat map of named tensors.*--to optim.pt"),
])
def test_export_refuses_in_one_line_saying_what_to_do(root: Path, out: Path, monkeypatch, args, message, capsys) -> None:
    monkeypatch.chdir(out)
    assert main(["ckpt", "export", str(root), *args]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("elastic-ddp: error:")
    assert re.search(message, err), err
    assert not [p for p in out.iterdir() if p.suffix in (".pt", ".safetensors", ".bin")]


def test_export_of_a_corrupted_checkpoint_refuses_naming_the_file(root: Path, out: Path, capsys) -> None:
    target = next((root / "step-00000006").glob("replicated-*.eddp"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    assert _export(root, out / "model.safetensors") == 1
    err = capsys.readouterr().err
    assert f"{target}: sha256" in err and len(err.strip().splitlines()) == 1
    assert not (out / "model.safetensors").exists()


def test_export_progress_is_shown_in_steps_for_large_files_only() -> None:
    import io

    from elastic_ddp.checkpoint.export import PROGRESS_MIN_BYTES, Progress

    stream = io.StringIO()
    progress = Progress("writing x.pt", 2 * PROGRESS_MIN_BYTES, stream)
    for _ in range(64):
        progress.advance(PROGRESS_MIN_BYTES // 32)
    lines = stream.getvalue().splitlines()
    assert [int(line.split()[2].rstrip("%")) // 10 for line in lines] == list(range(11))  # one line per tenth
    assert lines[-1].startswith("writing x.pt: 100%")
    progress.advance(12345)  # torch.save writes a little more than the tensors' bytes: no second 100% line
    assert stream.getvalue().splitlines() == lines
    edge = io.StringIO()
    at_half = Progress("writing z.pt", 2 * PROGRESS_MIN_BYTES, edge)
    for count in (PROGRESS_MIN_BYTES - 1, 1, 1):  # just under, at and past one half: one line for that tenth
        at_half.advance(count)
    assert [line.split()[2] for line in edge.getvalue().splitlines()] == ["49%", "50%"]
    small = io.StringIO()
    Progress("writing y.pt", PROGRESS_MIN_BYTES - 1, small).advance(PROGRESS_MIN_BYTES - 1)
    assert small.getvalue() == ""


def test_export_of_a_sharded_optimizer_says_what_the_replicated_file_holds() -> None:
    from elastic_ddp.checkpoint.export import ExportError, select

    with pytest.raises(ExportError, match=r"sharded over the rank files.*--what model.*--what all"):
        select({"model": {}, "optimizer_groups": [{"lr": 0.1}]}, "optimizer", "ckpt/step-00000010")
    assert select({"model": {}, "optimizer_groups": []}, "all", "w") == {"model": {}, "optimizer_groups": []}


def test_export_keeps_an_existing_file_unless_forced(root: Path, out: Path, capsys) -> None:
    target = out / "model.pt"
    target.write_bytes(b"mine")
    assert _export(root, target) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"elastic-ddp: error: --to {target}: the file exists; pass --force to replace it"]
    assert target.read_bytes() == b"mine"
    assert _export(root, target, "--force") == 0
    assert target.read_bytes() != b"mine"


def test_export_to_a_directory_that_does_not_exist_is_one_line(root: Path, out: Path, capsys) -> None:
    target = out / "missing" / "model.pt"
    assert _export(root, target) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"elastic-ddp: error: --to {target}: the directory {target.parent} does not exist"]


def test_ls_into_a_reader_that_stopped_ends_quietly(root: Path) -> None:
    """``elastic-ddp ckpt ls | head``: a reader that stopped reading is no traceback; the status is a piped Unix
    tool's (128 + SIGPIPE)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        result = subprocess.run([sys.executable, "-m", "elastic_ddp.cli", "ckpt", "ls", str(root)], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 141, result.stderr[-2000:]
