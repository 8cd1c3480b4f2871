"""fp8_graphed.grow_scales_of_slots (fixed shapes, for CUDA graphs) equals PageScaleWrites' growth on decode-only
steps: random pages, fresh and partly filled, replica slots, rows that write nothing, outliers, inf and NaN."""

from __future__ import annotations

import random

import pytest
import torch

from cpattn.kvstore.fp8 import PageScaleWrites, fp8_dtype, page_scales_of, quantize
from cpattn.kvstore.fp8_graphed import grow_scales_of_slots


def _state(gen, pages, page_tokens, hk, d, fmt):
    values = torch.randn(2, pages, page_tokens, hk, d, generator=gen, dtype=torch.float64)
    scales = page_scales_of(values, fmt)
    scales[:, ::5] = 0.0                                           # pages nobody wrote yet
    cache = quantize(values, scales[:, :, None, :, None], fp8_dtype(fmt))
    return cache, scales


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", range(12))
def test_fixed_shape_growth_equals_planned_growth(fmt, case):
    seed = random.randrange(1 << 30)
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    pages, page_tokens, hk, d = 40, 4, 2, 8
    t = rnd.randint(1, 6)
    copies = rnd.choice([1, 2])
    cache, scales = _state(gen, pages, page_tokens, hk, d, fmt)
    # One slot per written page (a decode-only step); some tokens stored elsewhere (-1), sometimes all of them.
    chosen = rnd.sample(range(pages), t * copies)
    slots = torch.tensor([p * page_tokens + rnd.randrange(page_tokens) if rnd.random() < 0.7 else p * page_tokens
                          for p in chosen], dtype=torch.int64)
    drop = torch.rand(t * copies, generator=gen) < (1.0 if case == 0 else 0.3)
    slots[drop] = -1
    k = torch.randn(t, hk, d, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-3, 6, (t, hk, 1), generator=gen))
    v = torch.randn(t, hk, d, generator=gen, dtype=torch.float64)
    if case == 1:
        k[0, 0, 0], v[-1, -1, -1] = float("inf"), float("nan")     # they set no scale
    planned_cache, planned_scales = cache.clone(), scales.clone()
    before = scales.clone()
    PageScaleWrites(list(slots.view(copies, t)), page_tokens, "cpu").grow(planned_cache, planned_scales, k, v, fmt)
    grow_scales_of_slots(cache, scales, k, v, slots, page_tokens, fmt)
    assert torch.equal(scales, planned_scales), seed
    assert torch.equal(cache.view(torch.uint8), planned_cache.view(torch.uint8)), seed
    written = slots[slots >= 0] // page_tokens
    assert torch.equal(scales[:, written] > 0, (torch.ones_like(scales[:, written]) > 0)), seed   # every written page has one
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(scales[:, untouched], before[:, untouched]), seed
