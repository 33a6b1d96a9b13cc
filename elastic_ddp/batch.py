"""Batches of any shape: inputs and targets as tensors or nestings of them, collated, moved and sliced alike.

A training item is ``(inputs, targets)`` or ``(inputs, targets, sample_id)``; ``inputs`` and ``targets``
may each be a tensor, a number, or any nesting of mappings (``dict``, ``OrderedDict``, a ``transformers``
``BatchEncoding``), lists, tuples, named tuples and dataclasses. Each container keeps its type through
:func:`collate`, :func:`to_device` and :func:`map_tensors`, so a model's ``forward`` gets back the shape its
dataset gave, with a leading batch dimension on every tensor.

Why not torch's own utilities alone: ``default_collate`` has no case for a dataclass, and
``torch.utils._pytree`` knows a dataclass or a ``Mapping`` other than the built-in ones only once it is
registered in torch's process-wide registry, which would change how ``torch.compile`` and ``torch.export``
see the user's types. The walk here is that of ``default_collate`` (mappings, named tuples, sequences)
with dataclasses added; the leaves are stacked by ``default_collate`` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate


def collate(items: Sequence[Any]) -> Any:
    """The DataLoader's ``collate_fn``: ``default_collate``, with dataclasses collated field by field."""
    first = items[0]
    if isinstance(first, torch.Tensor) or not _is_container(first):
        return default_collate(list(items))
    if _is_dataclass_instance(first):
        return _rebuild_dataclass(first, {name: collate([getattr(item, name) for item in items])
                                          for name in _init_fields(first)})
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {key: collate([item[key] for item in items]) for key in first})
    if _is_namedtuple(first):
        return type(first)(*(collate(column) for column in zip(*items, strict=True)))
    lengths = {len(item) for item in items}
    if len(lengths) != 1:
        raise RuntimeError("each element in list of batch should be of equal size")
    return [collate(column) for column in zip(*items, strict=True)]


def map_tensors(function: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor replaced by ``function(tensor)``; containers keep their types, other leaves stay."""
    if isinstance(tree, torch.Tensor):
        return function(tree)
    if not _is_container(tree):
        return tree
    if _is_dataclass_instance(tree):
        return _rebuild_dataclass(tree, {name: map_tensors(function, getattr(tree, name)) for name in _init_fields(tree)})
    if isinstance(tree, Mapping):
        return _rebuild_mapping(tree, {key: map_tensors(function, value) for key, value in tree.items()})
    if _is_namedtuple(tree):
        return type(tree)(*(map_tensors(function, value) for value in tree))
    mapped = [map_tensors(function, value) for value in tree]
    return tuple(mapped) if isinstance(tree, tuple) else mapped


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` on ``device`` (asynchronously from pinned memory)."""
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), tree)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``tree``, depth first."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif _is_container(tree):
        if _is_dataclass_instance(tree):
            values: Any = [getattr(tree, name) for name in _init_fields(tree)]
        else:
            values = tree.values() if isinstance(tree, Mapping) else tree
        for value in values:
            yield from tensors(value)


def leading_size(tree: Any) -> int | None:
    """The batch size of ``tree``: its tensors' common leading dimension; None without tensors, or when
    they disagree (e.g. a tensor with no dimensions)."""
    sizes = {tensor.shape[0] if tensor.dim() else None for tensor in tensors(tree)}
    return sizes.pop() if len(sizes) == 1 else None


def describe(tree: Any) -> str:
    """A short name for what ``tree`` is, for error messages: ``Tensor``, ``dict``, ``BatchEncoding``, ..."""
    return type(tree).__name__


def _is_container(value: Any) -> bool:
    return _is_dataclass_instance(value) or isinstance(value, Mapping) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)))


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _init_fields(instance: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(instance) if f.init]


def _rebuild_dataclass(template: Any, values: dict[str, Any]) -> Any:
    return dataclasses.replace(template, **values)


def _rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of the template's type holding ``values`` (a plain dict when the type cannot be built
    from one, as ``default_collate`` does)."""
    if type(template) is dict:
        return values
    try:
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values
