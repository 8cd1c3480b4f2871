"""Messages pickle their CPU tensors as numpy arrays (cpattn/array_pickle.py): what comes back is equal and
usable (writable, same dtypes and shapes), views carry only their own data, tensors numpy cannot hold pickle
as torch does, and copy/deepcopy still work."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cpattn.array_pickle import TensorsAsArrays, _Array
from cpattn.attention.metadata import make_causal_metadata


@dataclass(frozen=True)
class Message(TensorsAsArrays):
    a: torch.Tensor
    nested: dict
    items: list
    pair: tuple
    other: object = None


def _message(seed: int) -> Message:
    g = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 1000, (64, 4096), generator=g)
    return Message(
        a=torch.randint(-5, 5, (7,), generator=g),
        nested={0: big[3, 100:200], 1: None, "f": torch.rand(3, 2, generator=g, dtype=torch.float64)},
        items=[(1, 2, torch.arange(5, dtype=torch.int32)), torch.rand(4) > 0.5, torch.rand(2, dtype=torch.float16)],
        pair=(torch.zeros(0, 3, dtype=torch.int64), "text"),
        other={"bf16": torch.rand(3, dtype=torch.bfloat16), "grad": torch.rand(2, requires_grad=True)})


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                and torch.equal(x.detach(), y.detach()) and x.requires_grad == y.requires_grad)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, Message):
        return type(y) is Message and all(_equal(getattr(x, f), getattr(y, f)) for f in vars(x))
    return x == y


@pytest.mark.parametrize("seed", range(5))
def test_a_message_comes_back_equal_and_writable(seed):
    sent = _message(seed)
    got = pickle.loads(pickle.dumps(sent))
    assert _equal(sent, got)
    got.a[0] = 99   # writable, and its own memory
    assert sent.a[0] != 99   # values of the sent one are in -5..4
    assert got.other["grad"].requires_grad


def test_a_view_travels_without_its_whole_storage():
    big = torch.arange(1_000_000)
    small = Message(a=big[10:20], nested={}, items=[], pair=())
    assert len(pickle.dumps(small)) < 2_000   # torch would pickle the 8 MB storage
    assert torch.equal(pickle.loads(pickle.dumps(small)).a, torch.arange(10, 20))


def test_cpu_tensors_travel_as_arrays_and_the_rest_as_torch_does():
    reduced = _message(0).__reduce__()[1][1]
    assert isinstance(reduced["a"], _Array) and isinstance(reduced["nested"][0], _Array)
    assert isinstance(reduced["items"][0][2], _Array)
    assert isinstance(reduced["other"], dict) and isinstance(reduced["other"]["bf16"], torch.Tensor)


def test_read_only_arrays_come_back_as_writable_tensors():
    array = np.arange(4)
    array.flags.writeable = False   # Ray hands zero-copy arrays back read-only
    tensor = _Array(array).tensor()
    tensor[0] = 7
    assert tensor.tolist() == [7, 1, 2, 3] and array.tolist() == [0, 1, 2, 3]


def test_copy_and_deepcopy_of_metadata():
    md = make_causal_metadata([3, 1], [5, 0], torch.tensor([[0, 1, 2], [3, -1, -1]]), 4)
    for clone in (copy.copy(md), copy.deepcopy(md), pickle.loads(pickle.dumps(md))):
        for name, value in vars(md).items():
            assert _equal(value, getattr(clone, name)), name
    assert copy.copy(md).slot_mapping.data_ptr() == md.slot_mapping.data_ptr()      # shallow: shared
    assert copy.deepcopy(md).slot_mapping.data_ptr() != md.slot_mapping.data_ptr()  # deep: its own
