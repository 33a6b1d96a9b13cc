"""Batches of any shape (elastic_ddp.batch): collated, moved and sliced with every container kept."""

from __future__ import annotations

from collections import OrderedDict, UserDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch

from elastic_ddp.batch import collate, leading_size, map_tensors, tensors, to_device


class Encoding(UserDict):  # the shape of transformers' BatchEncoding: a UserDict built from a dict
    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data)


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclass
class Sample:
    pixels: torch.Tensor
    caption: dict[str, torch.Tensor]
    derived: int = field(default=0, init=False)


def items(count: int) -> list[Any]:
    return [Sample(pixels=torch.full((3,), float(i)), caption={"ids": torch.arange(4) + i}) for i in range(count)]


def test_a_dict_of_tensors_collates_to_a_dict_of_batches() -> None:
    batch = collate([{"x": torch.full((2,), float(i)), "n": i} for i in range(3)])
    assert type(batch) is dict and batch["x"].shape == (3, 2) and batch["n"].tolist() == [0, 1, 2]


def test_a_mapping_type_such_as_a_batch_encoding_is_kept() -> None:
    batch = collate([Encoding({"input_ids": torch.arange(5), "attention_mask": torch.ones(5)}) for _ in range(2)])
    assert isinstance(batch, Encoding) and batch["input_ids"].shape == (2, 5)
    ordered = collate([OrderedDict(b=torch.ones(1), a=torch.zeros(1))] * 2)
    assert isinstance(ordered, OrderedDict) and list(ordered) == ["b", "a"]


def test_named_tuples_and_dataclasses_collate_field_by_field() -> None:
    pairs = collate([Pair(torch.ones(2), torch.zeros(2))] * 4)
    assert isinstance(pairs, Pair) and pairs.left.shape == (4, 2)
    samples = collate(items(3))
    assert isinstance(samples, Sample)
    assert samples.pixels[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert samples.caption["ids"].shape == (3, 4) and samples.derived == 0


def test_map_tensors_keeps_every_container_and_leaves_other_leaves() -> None:
    tree = {"a": [torch.ones(2, 3), (torch.zeros(2), "tag")], "b": Pair(torch.ones(2), torch.ones(2))}
    sliced = map_tensors(lambda t: t[:0], tree)
    assert sliced["a"][0].shape == (0, 3) and isinstance(sliced["a"][1], tuple) and sliced["a"][1][1] == "tag"
    assert isinstance(sliced["b"], Pair) and sliced["b"].left.shape == (0,)
    assert len(list(tensors(tree))) == 4


def test_to_device_moves_every_tensor() -> None:
    moved = to_device(collate(items(2)), torch.device("meta"))
    assert moved.pixels.device.type == "meta" and moved.caption["ids"].device.type == "meta"


def test_leading_size_is_the_common_first_dimension() -> None:
    assert leading_size(collate(items(5))) == 5
    assert leading_size({"a": torch.ones(2), "b": torch.ones(3)}) is None
    assert leading_size({"text": "no tensors"}) is None


def test_items_of_unequal_length_are_refused() -> None:
    with pytest.raises(RuntimeError, match="equal size"):
        collate([[torch.ones(1)], [torch.ones(1), torch.ones(1)]])
