"""A tensor-only file format: safe to read from untrusted storage, fast to write and load.

A checkpoint file holds a tree of dicts, lists, tuples, strings, numbers, ``None`` and
tensors — what model, optimizer, scheduler, scaler and RNG state dicts are made of — and
nothing else. There is no pickle: reading a file can never run code, whatever its bytes.

Layout::

    b"EDDPTNS1" | header length (u64, little endian) | header (UTF-8 JSON) | pad | tensor bytes

The header is ``{"tree": ..., "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...]}``; every
tensor starts on a 64-byte boundary. The tree encodes containers with tags so that tuples,
non-string dict keys and non-finite floats survive the round trip exactly:
``["d", [[key, value], ...]]``, ``["l", [...]]``, ``["t", [...]]``, ``["T", index]`` (a tensor),
``["f", "nan" | "inf" | "-inf"]``; ``None``, booleans, ints, finite floats and strings stand as
themselves. Loading builds tensors directly over the read buffer (no copy).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.errors import CheckpointCorruptError

MAGIC = b"EDDPTNS1"
ALIGN = 64
CHUNK_BYTES = 64 * 2**20
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 256 * 2**20

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


@dataclass
class Flat:
    """A state tree split into its JSON-able skeleton and its tensors (in visiting order)."""

    tree: Any
    tensors: list[torch.Tensor]


def flatten(obj: Any) -> Flat:
    """Split ``obj`` into skeleton and tensors; anything but the supported types is a TypeError naming its path."""
    tensors: list[torch.Tensor] = []
    return Flat(_encode(obj, tensors, "state"), tensors)


def _encode(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ["T", len(tensors) - 1]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ["f", repr(obj)]
    if isinstance(obj, dict):
        return ["d", [[_encode(k, tensors, path), _encode(v, tensors, f"{path}.{k}")] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
        return ["t" if isinstance(obj, tuple) else "l", items]
    raise TypeError(
        f"cannot store {type(obj).__name__} at {path}: checkpoints hold only tensors, numbers, strings, "
        "None, and dicts/lists/tuples of them"
    )


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the object that :func:`flatten` split (the inverse, for trees read back from a file)."""
    if not isinstance(tree, list):
        return tree
    tag, body = tree
    if tag == "T":
        return tensors[body]
    if tag == "f":
        return float(body)
    if tag == "d":
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in body}
    items = [unflatten(v, tensors) for v in body]
    return tuple(items) if tag == "t" else items


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")


def encode_chunks(flat: Flat) -> Iterator[bytes | memoryview]:
    """The file's bytes as a stream of chunks (tensor data is not copied). Tensors must be contiguous CPU tensors."""
    table: list[dict[str, Any]] = []
    offset = 0
    for tensor in flat.tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("encode_chunks needs contiguous CPU tensors (stage them first)")
        offset = _aligned(offset)
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        table.append({"dtype": dtype, "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"tree": flat.tree, "tensors": table}, separators=(",", ":")).encode()
    start = _aligned(len(MAGIC) + _LENGTH.size + len(header))
    yield MAGIC + _LENGTH.pack(len(header)) + header + bytes(start - len(MAGIC) - _LENGTH.size - len(header))
    position = 0
    for tensor, entry in zip(flat.tensors, table):
        if entry["offset"] > position:
            yield bytes(entry["offset"] - position)
        view = _byte_view(tensor)
        for begin in range(0, len(view), CHUNK_BYTES):
            yield view[begin : begin + CHUNK_BYTES]
        position = entry["offset"] + entry["nbytes"]


def decode(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Parse a file's bytes into its tree; tensors share ``data``'s memory (copied once if read-only)."""
    buffer = memoryview(data)
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    try:
        return _decode(buffer)
    except (ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{where}: not a valid elastic_ddp tensor file ({exc})") from exc


def _decode(buffer: memoryview) -> Any:
    if bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise ValueError("bad magic bytes")
    (header_len,) = _LENGTH.unpack_from(buffer, len(MAGIC))
    if header_len > min(_MAX_HEADER, len(buffer)):
        raise ValueError(f"header length {header_len} is impossible")
    header_end = len(MAGIC) + _LENGTH.size + header_len
    header = json.loads(bytes(buffer[len(MAGIC) + _LENGTH.size : header_end]).decode())
    data_start = _aligned(header_end)
    tensors = [_tensor(entry, buffer, data_start) for entry in header["tensors"]]
    return unflatten(_checked_tree(header["tree"], len(tensors)), tensors)


def _tensor(entry: dict[str, Any], buffer: memoryview, data_start: int) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = [int(n) for n in entry["shape"]]
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in {shape}")
    count = math.prod(shape)
    nbytes, offset = int(entry["nbytes"]), int(entry["offset"])
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes != count * item or offset < 0 or data_start + offset + nbytes > len(buffer):
        raise ValueError(f"tensor entry {entry} does not fit the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + offset).view(shape)


def _checked_tree(tree: Any, tensor_count: int) -> Any:
    """Validate the tags of a tree read from storage (the inverse of _encode's output, nothing else)."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if not (isinstance(tree, list) and len(tree) == 2):
        raise ValueError("malformed tree node")
    tag, body = tree
    if tag == "T":
        if not (isinstance(body, int) and 0 <= body < tensor_count):
            raise ValueError("tensor reference out of range")
    elif tag == "f":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError("malformed float")
    elif tag == "d":
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("malformed dict entry")
            _checked_tree(pair[0], tensor_count)
            _checked_tree(pair[1], tensor_count)
    elif tag in ("l", "t"):
        for item in body:
            _checked_tree(item, tensor_count)
    else:
        raise ValueError(f"unknown tag {tag!r}")
    return tree


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
