"""A steady run's rows laid out on the host by numpy (cluster/steady_run.local_run_rows, row_arena.pack) hold what the
torch forms they replaced gave: written pages of random slot rows (rows that write nothing, whole steps without a
write, page starts), each shard's local key counts, and the arena's packed bytes (random dtypes, bfloat16 among
them, strided rows) equal to the old torch.cat layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cpattn.cluster.row_arena import RowArena
from cpattn.kvstore import dcp_local_seq_lens
from cpattn.kvstore.fp8_graphed import written_pages_of_steps, written_pages_of_steps_host
from cpattn.kvstore.sharding import dcp_local_seq_lens_host

SEEDS = [random.randrange(10**6) for _ in range(6)]


@pytest.mark.parametrize("seed", SEEDS)
def test_written_pages_on_the_host_equal_the_torch_form(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    steps, rows, page = rng.randrange(1, 40), rng.randrange(1, 150), rng.choice([1, 4, 16])
    slots = torch.randint(0, 5000, (steps, rows), generator=gen)
    slots[torch.rand(steps, rows, generator=gen) < rng.random()] = -1   # tokens this shard does not store
    slots[rng.randrange(steps)] = -1                                     # a step without a write
    slots[:, 0] = (slots[:, 0] // page) * page                           # page starts (fresh pages)
    want = written_pages_of_steps(slots, page)
    got = written_pages_of_steps_host(slots.numpy(), page)
    for name, w, g in zip(want._fields, want, got):
        assert g.dtype == w.dtype and g.is_contiguous() and torch.equal(g, w), (seed, name)


@pytest.mark.parametrize("seed", SEEDS)
def test_local_seq_lens_on_the_host_equal_the_torch_form(seed):
    rng = random.Random(seed)
    world, interleave = rng.randrange(1, 6), rng.choice([1, 3, 16])
    lens = np.array([[rng.randrange(0, 5000) for _ in range(rng.randrange(1, 70))]] * rng.randrange(1, 5))
    for rank in range(world):
        got = dcp_local_seq_lens_host(lens, world, rank, interleave)
        assert got.dtype == np.int64
        assert got.tolist() == dcp_local_seq_lens(torch.from_numpy(lens), world, rank, interleave).tolist()


def _old_pack(arena: RowArena, rows: list[torch.Tensor]) -> torch.Tensor:
    """RowArena.pack as torch.cat laid it out before numpy did."""
    steps = rows[0].shape[0]
    return torch.cat([rows[i].reshape(steps, -1).contiguous().view(torch.uint8) for i in arena.order], dim=1)


@pytest.mark.parametrize("seed", SEEDS)
def test_pack_lays_out_the_bytes_torch_cat_did(seed):
    rng = random.Random(seed)
    dtypes = [torch.int64, torch.int32, torch.bool, torch.bfloat16, torch.float32, torch.int16, torch.uint8]
    shapes = [(rng.choice(dtypes), tuple(rng.randrange(1, 70) for _ in range(rng.randrange(1, 3))))
              for _ in range(rng.randrange(1, 9))]
    arena = RowArena([torch.zeros(s, dtype=d) for d, s in shapes])
    steps = rng.randrange(1, 130)
    rows = []
    for d, s in shapes:
        r = torch.randint(-100, 100, (steps, *s)).to(d)
        if rng.random() < 0.3:   # a strided array (a transposed copy's view): laid out as its values, not its memory
            r = r.transpose(0, -1).contiguous().transpose(0, -1) if len(s) == 1 else r
        rows.append(r)
    got = arena.pack(rows)
    assert got.dtype == torch.uint8 and got.shape == (steps, arena.bytes.numel()) and got.device.type == "cpu"
    assert torch.equal(got, _old_pack(arena, rows)), seed
