"""Checkpoint files in the safetensors layout: readable by other tools, safe to read from untrusted storage.

A checkpoint file holds a tree of dicts, lists, tuples, strings, numbers, ``None`` and
tensors — what model, optimizer, scheduler, scaler and RNG state dicts are made of — and
nothing else. There is no pickle: reading a file can never run code, whatever its bytes.

Layout (safetensors)::

    header length N (u64, little endian) | header (N bytes of UTF-8 JSON, space-padded) | tensor bytes

The header maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets into the tensor bytes, which follow each other without gaps), and ``__metadata__``
holds string values: ``"format": "pt"`` and ``"elastic_ddp"``, a JSON object
``{"version": 1, "tree": ..., "tensors": [name, ...], "complex128": [name, ...]}``. The data
starts on a 64-byte boundary and the tensors are ordered by element size (largest first), so
every tensor is aligned to its element size. ``safetensors.safe_open`` and
``safetensors.torch.load_file`` read every tensor; a replicated file's model tensors are named
``model.<parameter name>``.

Names are the tensors' paths in the tree (``optimizer.state.0.exp_avg``; a name taken already
gets ``#2``, ``#3``, ...). The tree encodes containers with tags so that tuples, non-string
dict keys and non-finite floats survive the round trip exactly: ``["d", [[key, value], ...]]``,
``["l", [...]]``, ``["t", [...]]``, ``["T", index]`` (the index-th name of ``tensors``),
``["f", "nan" | "inf" | "-inf"]``; ``None``, booleans, ints, finite floats and strings stand as
themselves. safetensors has no complex128: such a tensor is stored as float64 with a trailing
dimension of 2 (real, imaginary) and listed under ``complex128``. A safetensors file without
``elastic_ddp`` metadata reads as ``{name: tensor}``.

Files of the earlier layout (``b"EDDPTNS1"`` magic, see :func:`_decode_legacy`) still load.
Loading builds tensors directly over the read buffer (no copy); every field read from a file is
validated, and anything that does not fit is a :class:`CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic_ddp.errors import CheckpointCorruptError

VERSION = 1
METADATA_KEY = "elastic_ddp"
ALIGN = 64
CHUNK_BYTES = 64 * 2**20
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 100_000_000
"""safetensors' own limit on the header's size."""

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}
"""Every dtype a checkpoint file holds, by the name the earlier layout used."""

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""safetensors' dtype codes; complex128 has none (stored as float64 pairs)."""
_BY_CODE = {code: dtype for dtype, code in _CODES.items()}


@dataclass
class Flat:
    """A state tree split into its JSON-able skeleton and its tensors (in visiting order).

    ``names`` are the tensors' names in the file, in the same order; a Flat built without them
    names its tensors by their index."""

    tree: Any
    tensors: list[torch.Tensor]
    names: list[str] = field(default_factory=list)


def flatten(obj: Any) -> Flat:
    """Split ``obj`` into skeleton and tensors; anything but the supported types is a TypeError naming its path."""
    flat = Flat(None, [], [])
    flat.tree = _encode(obj, flat, "")
    return flat


_PLAIN = frozenset({int, str, bool, type(None)})
"""Types that stand as themselves in the tree (exactly these: a subclass may not survive the round trip)."""


def _encode(obj: Any, flat: Flat, path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        flat.tensors.append(obj)
        flat.names.append(path or "tensor")
        return ["T", len(flat.tensors) - 1]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ["f", repr(obj)]
    if isinstance(obj, dict):
        return ["d", [[_encode(k, flat, _child(path, k)), _encode(v, flat, _child(path, k))] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _PLAIN for v in obj):  # e.g. Python's RNG state, 625 ints: no path per element
            items = list(obj)
        else:
            items = [_encode(v, flat, _child(path, i)) for i, v in enumerate(obj)]
        return ["t" if isinstance(obj, tuple) else "l", items]
    raise TypeError(
        f"cannot store {type(obj).__name__} at {_child('state', path) if path else 'state'}: checkpoints hold only "
        "tensors, numbers, strings, None, and dicts/lists/tuples of them"
    )


def _child(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def unflatten(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
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


# -- writing ---------------------------------------------------------------------------------------


def encode_chunks(flat: Flat, metadata: Mapping[str, str] | None = None) -> Iterator[bytes | memoryview]:
    """The file's bytes as a stream of chunks (tensor data is not copied, except that of a
    non-contiguous tensor). Tensors must be CPU tensors.

    ``metadata`` replaces the ``elastic_ddp`` entry of ``__metadata__``: a file with
    ``metadata={}`` is a plain safetensors file of ``{name: tensor}`` (what ``ckpt export`` writes)."""
    for tensor in flat.tensors:
        if tensor.device.type != "cpu":
            raise ValueError("encode_chunks needs CPU tensors (stage them first)")
    planned = plan(flat)
    yield planned.header(flat.tree if metadata is None else None, metadata)
    for index in planned.order:
        view = _byte_view(flat.tensors[index])
        for begin in range(0, len(view), CHUNK_BYTES):
            yield view[begin : begin + CHUNK_BYTES]


@dataclass(frozen=True)
class Plan:
    """Where each tensor of a :class:`Flat` goes in a file: what depends on the tensors' names, dtypes and
    shapes only, so a file can be rewritten in place while they stay the same (node-memory replicas)."""

    names: tuple[str, ...]
    """Each tensor's unique name, by its index in the Flat."""
    order: tuple[int, ...]
    """Tensor indices in the order of their data in the file (largest element size first)."""
    offsets: tuple[int, ...]
    """Each tensor's byte offset in the data part, by its index in the Flat."""
    data_bytes: int
    signature: tuple[Any, ...]
    """Names, dtypes and shapes (:func:`signature`): equal signatures give equal plans."""
    _entries: dict[str, Any] = field(compare=False, repr=False)
    _complex128: tuple[str, ...] = field(compare=False, repr=False)

    def header(self, tree: Any, metadata: Mapping[str, str] | None = None, size: int | None = None) -> bytes:
        """The length field and header, padded with spaces to ``size`` bytes (a multiple of 64; None: the
        smallest that aligns the data). ``tree``: the Flat's skeleton, stored as the ``elastic_ddp`` metadata;
        ``metadata`` instead replaces that entry. ValueError when the header does not fit ``size``."""
        if metadata is None:
            body: dict[str, Any] = {"version": VERSION, "tree": tree, "tensors": list(self.names)}
            if self._complex128:
                body["complex128"] = list(self._complex128)
            metadata = {METADATA_KEY: json.dumps(body, separators=(",", ":"))}
        entries = {"__metadata__": {"format": "pt", **metadata}, **self._entries}
        header = json.dumps(entries, separators=(",", ":")).encode()
        if size is None:
            size = _aligned(_LENGTH.size + len(header))
        if size % ALIGN or _LENGTH.size + len(header) > size:
            raise ValueError(f"a header of {len(header)} bytes does not fit {size} bytes")
        padded = size - _LENGTH.size
        return _LENGTH.pack(padded) + header + b" " * (padded - len(header))


def plan(flat: Flat) -> Plan:
    """The :class:`Plan` of ``flat``'s tensors."""
    names = _unique_names(flat.names or [str(index) for index in range(len(flat.tensors))])
    order = sorted(range(len(flat.tensors)), key=lambda index: -flat.tensors[index].element_size())
    entries: dict[str, Any] = {}
    offsets = [0] * len(flat.tensors)
    offset = 0
    for index in order:
        tensor = flat.tensors[index]
        nbytes = tensor.numel() * tensor.element_size()
        entries[names[index]] = {"dtype": _code(tensor), "shape": _stored_shape(tensor),
                                 "data_offsets": [offset, offset + nbytes]}
        offsets[index] = offset
        offset += nbytes
    complex128 = tuple(name for name, tensor in zip(names, flat.tensors) if tensor.dtype == torch.complex128)
    return Plan(tuple(names), tuple(order), tuple(offsets), offset, signature(flat), entries, complex128)


def signature(flat: Flat) -> tuple[Any, ...]:
    """What a :class:`Plan` depends on: the tensors' names, dtypes and shapes."""
    return tuple(flat.names), tuple((tensor.dtype, tensor.shape) for tensor in flat.tensors)


def _unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with every repeat (and the reserved ``__metadata__``) suffixed ``#2``, ``#3``, ...: safetensors
    needs each name once."""
    taken: set[str] = {"__metadata__"}
    unique = []
    for name in names:
        candidate, number = name, 1
        while candidate in taken:
            number += 1
            candidate = f"{name}#{number}"
        taken.add(candidate)
        unique.append(candidate)
    return unique


def _code(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.complex128:
        return "F64"
    if tensor.dtype not in _CODES:
        raise TypeError(f"cannot store a tensor of dtype {tensor.dtype}: checkpoints hold {', '.join(_DTYPES)}")
    return _CODES[tensor.dtype]


def _stored_shape(tensor: torch.Tensor) -> list[int]:
    shape = list(tensor.shape)
    return [*shape, 2] if tensor.dtype == torch.complex128 else shape


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if not tensor.numel():
        return memoryview(b"")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


# -- reading ---------------------------------------------------------------------------------------

LEGACY_MAGIC = b"EDDPTNS1"


def decode(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Parse a file's bytes into its tree; tensors share ``data``'s memory (copied once if read-only).

    ``where`` names the file in the :class:`CheckpointCorruptError` raised for anything that does not fit."""
    buffer = memoryview(data).cast("B")
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    try:
        if bytes(buffer[: len(LEGACY_MAGIC)]) == LEGACY_MAGIC:
            return _decode_legacy(buffer)
        return _decode(buffer)
    except (ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError, RuntimeError) as exc:
        # RecursionError (a RuntimeError): JSON or a tree nested deeper than Python recurses
        raise CheckpointCorruptError(f"{where}: not a valid elastic_ddp tensor file ({exc})") from exc


def _decode(buffer: memoryview) -> Any:
    header, data_start = _read_header(buffer)
    raw_metadata = header.pop("__metadata__", {})
    if not (isinstance(raw_metadata, dict) and all(isinstance(v, str) for v in raw_metadata.values())):
        raise ValueError("__metadata__ is not a map of strings")
    tensors = _tensors(header, buffer, data_start)
    if METADATA_KEY not in raw_metadata:
        return tensors
    metadata = json.loads(raw_metadata[METADATA_KEY])
    if not (isinstance(metadata, dict) and metadata.get("version") == VERSION):
        raise ValueError(f"unknown elastic_ddp metadata version {metadata.get('version') if isinstance(metadata, dict) else '?'}")
    names = metadata.get("tensors")
    if not (isinstance(names, list) and sorted(names) == sorted(tensors)):
        raise ValueError("the metadata's tensor list does not match the file's tensors")
    for name in _string_list(metadata.get("complex128", [])):
        tensors[name] = _as_complex128(name, tensors[name])
    ordered = [tensors[name] for name in names]
    return unflatten(_checked_tree(metadata.get("tree"), len(ordered)), ordered)


def _read_header(buffer: memoryview) -> tuple[dict[str, Any], int]:
    if len(buffer) < _LENGTH.size:
        raise ValueError(f"{len(buffer)} bytes are too short for a header")
    (header_len,) = _LENGTH.unpack_from(buffer, 0)
    if not 2 <= header_len <= min(_MAX_HEADER, len(buffer) - _LENGTH.size):
        raise ValueError(f"header length {header_len} is impossible for a file of {len(buffer)} bytes")
    header = json.loads(bytes(buffer[_LENGTH.size : _LENGTH.size + header_len]).decode())
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, _LENGTH.size + header_len


def _tensors(entries: dict[str, Any], buffer: memoryview, data_start: int) -> dict[str, torch.Tensor]:
    """Every tensor of the header over ``buffer``; their byte ranges must tile the data exactly (as safetensors checks)."""
    spans = sorted((_span(name, entry), name) for name, entry in entries.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            raise ValueError(f"tensor {name!r} starts at byte {begin} of the data, expected {end} (gap or overlap)")
        end = stop
    if data_start + end != len(buffer):
        raise ValueError(f"the tensors end at byte {data_start + end}, the file has {len(buffer)}")
    return {name: _tensor(name, entry, buffer, data_start) for name, entry in entries.items()}


def _span(name: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets) and offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r} has no valid data_offsets")
    return offsets[0], offsets[1]


def _tensor(name: str, entry: dict[str, Any], buffer: memoryview, data_start: int) -> torch.Tensor:
    code, shape = entry.get("dtype"), entry.get("shape")
    dtype = _BY_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has an unsupported dtype {entry.get('dtype')!r}")
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise ValueError(f"tensor {name!r} has an invalid shape {shape!r}")
    begin, end = entry["data_offsets"]
    count = math.prod(shape)
    if (end - begin) != count * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes for {count} elements of {dtype}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin).view(shape)


def _as_complex128(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.float64 or tensor.dim() == 0 or tensor.shape[-1] != 2:
        raise ValueError(f"tensor {name!r} is listed as complex128 but is not float64 pairs")
    return torch.view_as_complex(tensor) if tensor.numel() else torch.empty(tensor.shape[:-1], dtype=torch.complex128)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _string_list(value: Any) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise ValueError("malformed name list in the metadata")
    return value


def _checked_tree(tree: Any, tensor_count: int) -> Any:
    """Validate the tags of a tree read from storage (the inverse of _encode's output, nothing else)."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if not (isinstance(tree, list) and len(tree) == 2):
        raise ValueError("malformed tree node")
    tag, body = tree
    if tag == "T":
        if not (_is_count(body) and body < tensor_count):
            raise ValueError("tensor reference out of range")
    elif tag == "f":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError("malformed float")
    elif tag == "d":
        if not isinstance(body, list):
            raise ValueError("malformed dict")
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("malformed dict entry")
            _checked_tree(pair[0], tensor_count)
            _checked_tree(pair[1], tensor_count)
    elif tag in ("l", "t"):
        if not isinstance(body, list):
            raise ValueError("malformed list")
        for item in body:
            _checked_tree(item, tensor_count)
    else:
        raise ValueError(f"unknown tag {tag!r}")
    return tree


def _decode_legacy(buffer: memoryview) -> Any:
    """The earlier layout: ``b"EDDPTNS1" | header length (u64) | {"tree", "tensors": [{"dtype", "shape",
    "offset", "nbytes"}]} | pad | tensor bytes``, every tensor on a 64-byte boundary after the header."""
    (header_len,) = _LENGTH.unpack_from(buffer, len(LEGACY_MAGIC))
    if header_len > min(_MAX_HEADER, len(buffer)):
        raise ValueError(f"header length {header_len} is impossible")
    header_end = len(LEGACY_MAGIC) + _LENGTH.size + header_len
    header = json.loads(bytes(buffer[len(LEGACY_MAGIC) + _LENGTH.size : header_end]).decode())
    data_start = _aligned(header_end)
    tensors = [_legacy_tensor(entry, buffer, data_start) for entry in header["tensors"]]
    return unflatten(_checked_tree(header["tree"], len(tensors)), tensors)


def _legacy_tensor(entry: dict[str, Any], buffer: memoryview, data_start: int) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = entry["shape"]
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise ValueError(f"invalid shape {shape!r}")
    count = math.prod(shape)
    nbytes, offset = entry["nbytes"], entry["offset"]
    fits = _is_count(nbytes) and _is_count(offset) and data_start + offset + nbytes <= len(buffer)
    if not fits or nbytes != count * dtype.itemsize:
        raise ValueError(f"tensor entry {entry} does not fit the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + offset).view(shape)


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
