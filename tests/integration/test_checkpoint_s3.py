"""The example pipeline under torchrun with ``s3://`` checkpoints on a real S3 endpoint (moto).

The resume suite of test_training.py, with every checkpoint going through s3fs: a run resumed
from S3 ends bitwise identical to an uninterrupted one, with or without gradient
accumulation, keeps the data exact on a different world size, and its checkpoints hold the
same model and data as the same run on local disk.

The jobs find the endpoint through ``AWS_ENDPOINT_URL`` and the ``AWS_*`` keys that the
``s3_server_module`` fixture puts in the environment; one run names it explicitly with
``--checkpoint-storage-options``. ``elastic-ddp ckpt inspect`` (tests.jobs.inspect) has no
storage-options flag, so it relies on the environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fsspec.core import strip_protocol

from elastic_ddp.checkpoint.manifest import step_dir_name
from tests.fixtures.s3 import S3Endpoint
from tests.jobs import (
    WORLD_CHANGE_ATOL,
    WORLD_CHANGE_RTOL,
    events,
    export_model,
    import_example,
    inspect,
    load_model_state,
    resumed_steps,
    train_ok,
)

pytestmark = pytest.mark.integration


def checkpoint_args(uri: str, *extra: str) -> list[str]:
    return ["--checkpoint-dir", uri, "--checkpoint-every", "10", *extra]


@pytest.fixture(scope="module")
def reference(s3_server_module: S3Endpoint) -> dict:
    """40 uninterrupted steps at world size 2, checkpoints on S3 every 10 steps."""
    uri = s3_server_module.child_uri("ref")
    train_ok(["--max-steps", "40", *checkpoint_args(uri)], nproc=2)
    return {"uri": uri, "facts": inspect(uri)}


@pytest.fixture(scope="module")
def first_half(s3_server_module: S3Endpoint) -> str:
    """The first 20 steps on S3 (kept pristine; tests copy it), with the endpoint given as a storage option."""
    uri = s3_server_module.child_uri("half")
    options = json.dumps({"endpoint_url": s3_server_module.endpoint})
    train_ok(["--max-steps", "20", *checkpoint_args(uri, "--checkpoint-storage-options", options)], nproc=2)
    return uri


def copy_prefix(s3: S3Endpoint, source: str, target: str) -> None:
    """Copy every object under ``source`` to the same name under ``target``."""
    fs = s3.filesystem()
    source_key, target_key = strip_protocol(source), strip_protocol(target)
    for key in fs.find(source):
        fs.copy(key, target_key + key[len(source_key):])


def resume_copy(s3: S3Endpoint, first_half: str, name: str, extra: list[str], nproc: int, logs: Path) -> dict:
    uri = s3.child_uri(name)
    copy_prefix(s3, first_half, uri)
    train_ok(["--max-steps", "40", *checkpoint_args(uri), "--log-dir", str(logs), *extra], nproc=nproc)
    assert resumed_steps(logs) == dict.fromkeys(range(nproc), 20)
    return {"uri": uri, "facts": inspect(uri)}


def test_s3_run_keeps_the_newest_checkpoints_and_points_latest_at_the_last(
    reference: dict, s3_server_module: S3Endpoint
) -> None:
    fs = s3_server_module.filesystem()
    names = sorted(key.rsplit("/", 1)[-1] for key in fs.ls(reference["uri"], detail=False))
    assert names == ["latest", step_dir_name(20), step_dir_name(30), step_dir_name(40)]
    assert fs.cat_file(reference["uri"] + "/latest") == step_dir_name(40).encode()
    assert reference["facts"]["step"] == 40 and reference["facts"]["world_size"] == 2


def test_export_from_s3_loads_into_a_fresh_model_with_the_inspected_digest(
    reference: dict, s3_server_module: S3Endpoint, tmp_path: Path
) -> None:
    model = import_example("model").build_model(import_example("config").ModelConfig())
    options = json.dumps({"endpoint_url": s3_server_module.endpoint})
    exported = export_model(reference["uri"], model, tmp_path / "model.safetensors", "--storage-options", options)
    assert exported == reference["facts"]["model_digest"]


@pytest.mark.slow  # CI time: the S3 resume above runs the same store end to end
def test_s3_checkpoints_hold_the_same_model_and_data_as_local_disk(
    reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    local = str(tmp_path_factory.mktemp("local") / "ckpt")
    train_ok(["--max-steps", "40", *checkpoint_args(local)], nproc=2)
    on_disk, on_s3 = inspect(local), reference["facts"]
    for key in ("step", "epoch", "cursor", "samples_seen", "model_digest", "data_digest", "fingerprint"):
        assert on_s3[key] == on_disk[key], key


def test_resume_from_s3_at_same_world_size_is_bitwise_identical(
    reference: dict, first_half: str, s3_server_module: S3Endpoint, tmp_path: Path
) -> None:
    resumed = resume_copy(s3_server_module, first_half, "resume-plain", [], nproc=2, logs=tmp_path / "logs")["facts"]
    assert resumed["model_digest"] == reference["facts"]["model_digest"]
    assert resumed["data_digest"] == reference["facts"]["data_digest"]


@pytest.mark.slow
def test_resume_from_s3_with_gradient_accumulation_is_bitwise_identical(s3_server_module: S3Endpoint) -> None:
    accum = ["--grad-accum-steps", "2"]
    straight, split = s3_server_module.child_uri("accum-straight"), s3_server_module.child_uri("accum-split")
    train_ok(["--max-steps", "40", *checkpoint_args(straight), *accum], nproc=2)
    train_ok(["--max-steps", "20", *checkpoint_args(split), *accum], nproc=2)
    train_ok(["--max-steps", "40", *checkpoint_args(split), *accum], nproc=2)
    a, b = inspect(straight), inspect(split)
    assert (a["model_digest"], a["data_digest"]) == (b["model_digest"], b["data_digest"])


@pytest.mark.slow  # CI time; world-size changes are covered on local disk, S3 resume at the same size
def test_resume_from_s3_on_three_ranks_keeps_data_exact_and_weights_close(
    reference: dict, first_half: str, s3_server_module: S3Endpoint, tmp_path: Path
) -> None:
    resumed = resume_copy(s3_server_module, first_half, "to-3", [], nproc=3, logs=tmp_path / "logs")
    facts = resumed["facts"]
    assert facts["world_size"] == 3
    assert facts["data_digest"] == reference["facts"]["data_digest"]
    assert (facts["epoch"], facts["cursor"]) == (reference["facts"]["epoch"], reference["facts"]["cursor"])
    ours, theirs = load_model_state(resumed["uri"]), load_model_state(reference["uri"])
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=WORLD_CHANGE_RTOL, atol=WORLD_CHANGE_ATOL), name


def test_a_bucket_that_does_not_exist_fails_before_the_first_step_naming_the_uri(
    s3_server_module: S3Endpoint, tmp_path: Path
) -> None:
    from tests.jobs import train

    uri = "s3://no-such-bucket-elastic-ddp/run"
    result = train(["--max-steps", "5", "--checkpoint-dir", uri, "--log-dir", str(tmp_path)], timeout=60)
    assert result.returncode != 0
    assert f"checkpoint location {uri} is not usable" in result.output
    assert [e["event"] for e in events(tmp_path)] == ["process_group_formed", "exit"]  # no start, no step
    assert f"checkpoint location {uri} is not usable" in events(tmp_path, "exit")[0]["error"]
