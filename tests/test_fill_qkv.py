"""graph_capture.fill_qkv: a layer's q, k, v land in a graph's packed q|k|v buffer (heads along dim 1) exactly where
the three copies put them, in place (the buffer's address is what a CUDA graph reads), for random shapes, GQA,
non-contiguous inputs (a model's packed projection split into views) and inputs of another dtype."""

from __future__ import annotations

import random

import pytest
import torch

from cpattn.cluster.graph_capture import fill_qkv


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(4)])
@pytest.mark.parametrize("dtype, in_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_q_k_v_land_where_three_copies_put_them(seed, dtype, in_dtype):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    t, hk, d = rng.randrange(1, 9), rng.choice([1, 2, 4]), rng.choice([8, 16])
    hq = hk * rng.choice([1, 2, 4])
    buffer = torch.zeros(64 + t * (hq + 2 * hk) * d * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8)
    qkv = buffer[64:].view(dtype).view(t, hq + 2 * hk, d)   # a view into a message, as the client graphs' is
    if rng.random() < 0.5:   # a model's packed projection, split into views
        packed = torch.randn(t, hq + 2 * hk, d, generator=g).to(in_dtype)
        q, k, v = packed.split([hq, hk, hk], dim=1)
    else:
        q, k, v = (torch.randn(t, h, d, generator=g).to(in_dtype) for h in (hq, hk, hk))
    want = torch.zeros_like(qkv)
    want[:, :hq].copy_(q)
    want[:, hq:hq + hk].copy_(k)
    want[:, hq + hk:].copy_(v)
    address = qkv.data_ptr()
    fill_qkv(qkv, q, k, v)
    assert qkv.data_ptr() == address and torch.equal(qkv, want)
    assert not buffer[:64].any()   # the header before it untouched
