"""cluster/row_arena.py: a steady step's buffers as views of one byte buffer, refilled with one copy: the views keep
their values, shapes and dtypes, are aligned, and after fill(pack(rows)[j]) each holds step j's row of its array."""

from __future__ import annotations

import random

import pytest
import torch

from cpattn.cluster.row_arena import RowArena

DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.int16]


def _random_array(rng: random.Random, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-1000, 1000, shape, dtype=dtype)


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(5)])
def test_views_keep_values_and_a_step_is_one_fill(seed):
    rng = random.Random(seed)
    shapes = [(rng.choice(DTYPES), (rng.randrange(1, 9),)) for _ in range(rng.randrange(1, 8))]
    buffers = [_random_array(rng, d, s) for d, s in shapes]
    before = [b.clone() for b in buffers]
    arena = RowArena(buffers)
    assert arena.bytes.numel() == sum(b.numel() * b.element_size() for b in buffers)
    for b, v, want in zip(buffers, arena.views, before):
        assert v.dtype == b.dtype and v.shape == b.shape and torch.equal(v, want)
        assert v.data_ptr() % v.element_size() == 0
        assert arena.bytes.data_ptr() <= v.data_ptr() < arena.bytes.data_ptr() + arena.bytes.numel()
    steps = rng.randrange(1, 6)
    rows = [_random_array(rng, d, (steps, *s)) for d, s in shapes]
    packed = arena.pack(rows)
    assert packed.shape == (steps, arena.bytes.numel()) and packed.dtype == torch.uint8
    for j in rng.sample(range(steps), steps):
        arena.fill(packed[j])
        for v, r in zip(arena.views, rows):
            assert torch.equal(v, r[j]), (seed, j)


def test_rows_that_do_not_fit_the_arena_are_refused():
    arena = RowArena([torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)])
    with pytest.raises(ValueError, match="2 buffers"):
        arena.pack([torch.zeros(3, 4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="rows 1"):
        arena.pack([torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="rows 0"):
        arena.pack([torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int32)])
