"""The checkpoint file format: safetensors layout, exact round trips, validation of every field read, the earlier layout."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elastic_ddp.checkpoint.format import _DTYPES, decode, encode_chunks, flatten, unflatten
from elastic_ddp.errors import CheckpointCorruptError

LEGACY_CHECKPOINT = Path(__file__).parent.parent / "fixtures" / "legacy_checkpoint"


def encoded(obj: object) -> bytes:
    return b"".join(bytes(chunk) for chunk in encode_chunks(flatten(obj)))


def write(tmp_path: Path, obj: object) -> Path:
    path = tmp_path / "file.eddp"
    path.write_bytes(encoded(obj))
    return path


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bytes(a), _bytes(b))  # bitwise: NaNs and float8 included
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def every_dtype() -> dict[str, torch.Tensor]:
    return {name: torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype) for name, dtype in _DTYPES.items()}


def test_a_tree_of_every_supported_kind_round_trips_exactly() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tree = {
        "dtypes": every_dtype(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "complex_empty": torch.empty(0, dtype=torch.complex128),
        3: ("tuple", None, True, -7, 1.5, float("nan"), float("inf"), float("-inf")),
        (1, 2): [[], {}, ()],
        "nested": {"list": [torch.ones(2), {"x": torch.zeros((), dtype=torch.bool)}]},
    }
    assert_same(decode(encoded(tree), "mem"), tree)


def test_every_tensor_opens_with_safetensors_under_its_path_name(tmp_path: Path) -> None:
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(3, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "dtypes": every_dtype()}
    path = write(tmp_path, state)
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        assert {"model.fc1.weight", "model.fc1.bias", "optimizer.state.0.exp_avg", "optimizer.state.0.step"} <= names
        assert torch.equal(handle.get_tensor("model.fc1.weight"), model.fc1.weight.detach())
        assert handle.metadata()["format"] == "pt"
        # safetensors has no complex128: float64 pairs, real then imaginary
        assert torch.equal(handle.get_tensor("dtypes.complex128"), torch.view_as_real(state["dtypes"]["complex128"]))
    loaded = load_file(str(path))
    assert len(loaded) == len(flatten(state).tensors)
    assert torch.equal(loaded["optimizer.state.0.exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_repeated_names_and_shared_storage_are_stored_as_separate_tensors(tmp_path: Path) -> None:
    shared = torch.arange(8, dtype=torch.float32)
    tree = {"a.b": shared, "a": {"b": shared[2:6]}, 0: torch.ones(1), "0": torch.zeros(1), "__metadata__": torch.ones(2)}
    path = write(tmp_path, tree)
    assert set(load_file(str(path))) == {"a.b", "a.b#2", "0", "0#2", "__metadata__#2"}
    assert_same(decode(path.read_bytes(), "mem"), tree)


def test_tensors_are_aligned_to_their_element_size_and_share_the_read_buffer() -> None:
    data = bytearray(encoded({"u8": torch.ones(3, dtype=torch.uint8), "f64": torch.ones(5, dtype=torch.float64),
                              "f32": torch.ones(3), "bf16": torch.ones(1, dtype=torch.bfloat16)}))
    loaded = decode(data, "mem")
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    for tensor in loaded.values():
        assert (tensor.data_ptr() - base) % tensor.element_size() == 0
        assert base <= tensor.data_ptr() < base + len(data)  # over the buffer, not a copy


def test_a_plain_safetensors_file_reads_as_a_flat_dict(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(2, 2), "n": torch.tensor(3)}
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    loaded = decode((tmp_path / "plain.safetensors").read_bytes(), "mem")
    assert_same(dict(sorted(loaded.items())), dict(sorted(tensors.items())))


def test_a_non_cpu_tensor_or_an_object_is_refused_when_written() -> None:
    with pytest.raises(TypeError, match=r"state\.model\.x"):
        flatten({"model": {"x": object()}})
    with pytest.raises(ValueError, match="CPU"):
        list(encode_chunks(flatten({"x": torch.ones(1, device="meta")})))


def _header(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _with_header(header: dict, rest: bytes) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + rest


def _edit(edit) -> bytes:
    header, rest = _header(encoded({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "n": 4}))
    original = header["__metadata__"]["elastic_ddp"]
    meta = json.loads(original)
    result = edit(header, meta, rest)
    if isinstance(result, bytes):
        return result
    if header["__metadata__"]["elastic_ddp"] == original:  # the edit was to the decoded metadata
        header["__metadata__"]["elastic_ddp"] = json.dumps(meta)
    return _with_header(header, rest)


@pytest.mark.parametrize("damage, message", [
    (lambda h, m, r: b"\x01", "too short"),
    (lambda h, m, r: struct.pack("<Q", 10**9) + b"{}", "header length"),
    (lambda h, m, r: struct.pack("<Q", 4) + b"{]}" + b" ", "Expecting"),
    (lambda h, m, r: _with_header(h, r[:-1]), "the file has"),
    (lambda h, m, r: _with_header(h, r + b"x"), "the file has"),
    (lambda h, m, r: h["model.w"].update(data_offsets=[0, 10**12]), "expected|file has"),
    (lambda h, m, r: h["model.w"].update(data_offsets=[4, 2]), "data_offsets"),
    (lambda h, m, r: h["model.w"].update(dtype="F64"), "bytes for"),
    (lambda h, m, r: h["model.w"].update(dtype="X9"), "unsupported dtype"),
    (lambda h, m, r: h["model.w"].update(shape=[2, -3]), "invalid shape"),
    (lambda h, m, r: h["model.w"].update(shape=[7]), "bytes for"),
    (lambda h, m, r: h["__metadata__"].update(elastic_ddp="{not json"), "Expecting"),
    (lambda h, m, r: h["__metadata__"].update(elastic_ddp=7), "map of strings"),
    (lambda h, m, r: m.update(version=99), "version"),
    (lambda h, m, r: m["tensors"].pop(), "tensor list"),
    (lambda h, m, r: m.update(tree=["T", 5]), "out of range"),
    (lambda h, m, r: m.update(tree=["d", [["k"]]]), "dict entry"),
    (lambda h, m, r: m.update(tree=["x", 1]), "unknown tag"),
    (lambda h, m, r: m.update(complex128=["model.w"]), "complex128"),
])
def test_a_damaged_field_is_a_corrupt_error_naming_the_file(damage, message) -> None:
    with pytest.raises(CheckpointCorruptError, match=rf"^step-7/x\.eddp: not a valid .*({message})"):
        decode(_edit(damage), "step-7/x.eddp")


def test_a_tree_nested_deeper_than_python_recurses_is_refused_as_corrupt() -> None:
    deep_json = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser recurses
    deep_tree = '["l",[' * 5_000 + '["l",[]]' + "]]" * 5_000  # parses, deeper than the tree check recurses
    for tree in (deep_json, deep_tree):
        metadata = '{"version": 1, "tensors": [], "tree": %s}' % tree
        with pytest.raises(CheckpointCorruptError, match="^deep: not a valid"):
            decode(_with_header({"__metadata__": {"elastic_ddp": metadata}}, b""), "deep")


def test_any_flipped_header_byte_is_either_read_or_refused_as_corrupt() -> None:
    data = encoded({"model": {"w": torch.ones(2, 3)}, "rng": (1, 2.5, None)})
    header_end = 8 + struct.unpack_from("<Q", data)[0]
    refused = 0
    for position in range(header_end):
        damaged = bytearray(data)
        damaged[position] ^= 0x55
        try:
            decode(damaged, "f")
        except CheckpointCorruptError:  # anything else escaping fails the test
            refused += 1
    assert refused > header_end // 2


def test_a_checkpoint_of_the_earlier_layout_still_restores(tmp_path: Path) -> None:
    """tests/fixtures/legacy_checkpoint was saved by elastic_ddp's previous format.py (EDDPTNS1 files) from
    ``make_state()`` after ``advance(state, 2)``, with writer token 0123456789ab."""
    from elastic_ddp.checkpoint import CheckpointManager
    from elastic_ddp.state import model_digest
    from tests.unit.test_checkpoint_local import make_state

    root = tmp_path / "ckpt"
    shutil.copytree(LEGACY_CHECKPOINT, root)
    replicated = next(root.glob("step-*/replicated-*.eddp"))
    assert replicated.read_bytes().startswith(b"EDDPTNS1")
    manager = CheckpointManager(str(root), rank=0, world_size=1, run_id="unit")
    state = make_state()
    info = manager.describe(2)
    assert info.manifest is not None
    state.fingerprint = info.manifest.meta["fingerprint"]  # as saved, whatever today's defaults are
    restored = manager.restore(state)
    assert restored is not None and restored.step == 2 and restored.rank_state_reused
    assert model_digest(state.model.state_dict()) == "207af28318b077b9a5404fa3a2c412a4a9caab66ef91a22311dfb9d089549b1e"
    assert state.optimizer.state_dict()["state"][0]["exp_avg"].sum().item() == pytest.approx(0.36483117938041687)


def test_unflatten_inverts_flatten_in_memory() -> None:
    tree = {"a": [torch.ones(1), (2, {"b": torch.zeros(2)})]}
    flat = flatten(tree)
    assert flat.names == ["a.0", "a.1.1.b"]
    assert_same(unflatten(flat.tree, flat.tensors), tree)


def test_a_flat_built_without_names_names_its_tensors_by_index(tmp_path: Path) -> None:
    from elastic_ddp.checkpoint.format import Flat

    tree = ["l", [["T", 0], ["T", 1]]]
    path = tmp_path / "f.eddp"
    path.write_bytes(b"".join(bytes(c) for c in encode_chunks(Flat(tree, [torch.ones(2), torch.zeros(3)]))))
    assert set(load_file(str(path))) == {"0", "1"}
    assert_same(decode(path.read_bytes(), "f"), [torch.ones(2), torch.zeros(3)])


def test_a_file_written_without_elastic_ddp_metadata_is_a_plain_safetensors_file(tmp_path: Path) -> None:
    tensors = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.zeros(3)}
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"".join(bytes(c) for c in encode_chunks(flatten(tensors), metadata={})))
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert_same(dict(sorted(load_file(str(path)).items())), dict(sorted(tensors.items())))
