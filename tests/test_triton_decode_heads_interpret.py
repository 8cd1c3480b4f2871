"""The H-kv-heads-per-program decode kernel (triton_decode_heads.py, DECODE_CONFIG heads_per_program: issue 22's fp8
candidate) against float64, through Triton's interpreter on the CPU: fp16 and fp8 e4m3 / e5m2 caches, pages placed at
random, GQA, odd lengths, empty rows and splits, windows, soft caps, f16 dots, direct and split outputs, and a tile
whose pages' V scales differ by 2^40. The reference dequantises the same fp8 bytes with their page scales in float64.
    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch, triton> -m pytest tests/test_triton_decode_heads_interpret.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

from cpattn.attention.backends import triton_decode                                      # noqa: E402
from cpattn.kvstore.fp8 import FP8_FORMATS, page_scales_of, quantize                    # noqa: E402

HQ, HK, D, PS, PAGES = 16, 4, 32, 16, 120
LENS = [333, 0, 17, 100, 5]          # odd lengths, an empty row, a row shorter than a page
KERNEL_TOL = 2e-3                     # float16 activations vs float64 on the same (dequantised) values


def _case(fmt: str | None, seed: int = 3, v_page_scales: torch.Tensor | None = None):
    """q [T, Q, D] f16, the cache [2, PAGES, PS, K, D] (f16 or fp8), its scales [2, PAGES, K] or None, the exact
    float64 values the kernel reads, and each row's pages (shuffled, disjoint)."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(2, PAGES, PS, HK, D, generator=g)
    vals[..., 3] *= 20.0                                              # an outlier channel
    if v_page_scales is not None:                                     # V pages of very different magnitudes
        vals[1] *= v_page_scales[:, None, None, None]
    q = (torch.randn(len(LENS), HQ, D, generator=g) * 0.5).half()
    table = torch.randperm(PAGES, generator=g)[:len(LENS) * 22].view(len(LENS), 22).int()   # 352 keys a row
    if fmt is None:
        cache = vals.half()
        return q, cache, None, cache.double(), table
    scales = page_scales_of(vals, fmt)
    cache = quantize(vals, scales[:, :, None, :, None], FP8_FORMATS[fmt])
    return q, cache, scales, cache.double() * scales.double()[:, :, None, :, None], table


def _reference(q, exact, table, lens, starts, cap, scale):
    """float64 attention of each row over its visible keys [start, len): out [T, Q, D], natural-log lse [T, Q]."""
    g = HQ // HK
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for t, n in enumerate(lens):
        first = 0 if starts is None else starts[t]
        if n <= first:
            continue
        keys = exact[:, table[t].long()].reshape(2, -1, HK, D)[:, first:n]            # [2, n, K, D]
        for h in range(HK):
            s = q[t, h * g:(h + 1) * g].double() @ keys[0, :, h].T * scale
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            lse[t, h * g:(h + 1) * g] = torch.logsumexp(s, -1)
            out[t, h * g:(h + 1) * g] = torch.softmax(s, -1) @ keys[1, :, h]
    return out, lse


def _decode(cfg: dict, q, cache, scales, table, lens, splits, starts=None, cap=None, rows=None, scale=D ** -0.5):
    """paged_decode under ``cfg`` (DECODE_CONFIG entries): every row, or only ``rows`` (tok_idx, not all_rows)."""
    old = triton_decode.DECODE_CONFIG
    triton_decode.DECODE_CONFIG = dict(old, min_tiles=1, **cfg)
    try:
        toks = list(range(len(lens))) if rows is None else rows
        idx = torch.tensor(toks, dtype=torch.int32)
        # NaN-poisoned, float32 rows (the V-scale test's outputs are ~2^-20): every row checked must be written
        out = torch.full(q.shape, float("nan"), dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("nan"))
        key_start = None if starts is None else torch.tensor([starts[t] for t in toks], dtype=torch.int32)
        triton_decode.paged_decode(q, cache[0], cache[1], table, idx, idx,
                                   torch.tensor([lens[t] for t in toks], dtype=torch.int32), splits, scale,
                                   out, lse, all_rows=rows is None, key_start=key_start, kv_scale=scales,
                                   soft_cap=cap)
    finally:
        triton_decode.DECODE_CONFIG = old
    return out.double(), lse.double()


def _check(got, ref, rows):
    (out, lse), (ref_out, ref_lse) = got, ref
    for t in rows:
        if math.isinf(float(ref_lse[t, 0])):   # nothing visible: -inf and zeros, as the one-head kernel writes
            assert torch.isinf(lse[t]).all() and float(out[t].abs().max()) == 0.0
            continue
        err = float((out[t] - ref_out[t]).norm() / ref_out[t].norm())
        assert err < KERNEL_TOL, (t, err)
        assert float((lse[t] - ref_lse[t]).abs().max()) < 2e-3, t


HEADS = [dict(heads_per_program=4, block_n=32, num_warps=4),        # all kv heads in one program, 2 pages a tile
         dict(heads_per_program=2, block_n=16, num_warps=2, fp8_f16_dot=True)]


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("cfg", HEADS, ids=["h4_n32", "h2_n16_f16"])
def test_heads_kernel_vs_float64(fmt, cfg):
    """Split KV (S = 4 x H: many splits empty for the short rows) and unsplit (S = 1: direct rows)."""
    q, cache, scales, exact, table = _case(fmt)
    ref = _reference(q, exact, table, LENS, None, None, D ** -0.5)
    for splits in (4, 1):
        cfg_s = dict(cfg, split_factor=1 / cfg["heads_per_program"]) if splits == 1 else cfg
        _check(_decode(cfg_s, q, cache, scales, table, LENS, splits), ref, range(len(LENS)))


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "fp8_e5m2"])
def test_heads_kernel_windows_and_soft_cap(fmt):
    """Windows starting mid-page (and one past the row's end: nothing visible) with a soft cap, on a subset of rows
    (tok_idx 0, 2, 3, 4: the merged rows are copied into place)."""
    q, cache, scales, exact, table = _case(fmt, seed=4)
    starts = [70, 0, 3, 99, 9]
    ref = _reference(q, exact, table, LENS, starts, 5.0, D ** -0.5)
    got = _decode(HEADS[0], q, cache, scales, table, LENS, 2, starts=starts, cap=5.0, rows=[0, 2, 3, 4])
    _check(got, ref, [0, 2, 3, 4])
    assert got[0][1].isnan().all() and got[1][1].isnan().all()      # row 1 is not decoded: left alone


@pytest.mark.parametrize("cfg", [dict(HEADS[1], block_n=32), dict(block_n=32), dict(block_n=32, page_tiles=True),
                                 dict(block_n=32, fp8_v_scaled=True)], ids=["heads", "one_head", "pages", "v_scaled"])
def test_small_v_scales_keep_f16_dots_in_range(cfg):
    """V pages of magnitude 2^-20 and 2^-40 (scales far below float16's normal range) with float16 dots (here the
    activations' dtype; on a GPU F16_DOT or a float16 model): each page's V scale is taken over its tile's largest and
    that largest applied to the PV dot's float32 result, where p * scale alone underflowed (rel error ~0.3 before)."""
    mags = torch.tensor([2.0 ** -40 if p % 2 else 2.0 ** -20 for p in range(PAGES)])
    q, cache, scales, exact, table = _case("fp8_e4m3", seed=5, v_page_scales=mags)
    ref = _reference(q, exact, table, LENS, None, None, D ** -0.5)
    _check(_decode(cfg, q, cache, scales, table, LENS, 4), ref, range(len(LENS)))


@pytest.mark.parametrize("cfg", [dict(HEADS[1], block_n=32), dict(block_n=32, fp8_f16_dot=True)],
                         ids=["heads", "one_head"])
@pytest.mark.parametrize("magnitude, cap", [(2.0 ** 20, None), (2.0 ** -24, 5.0)])
def test_f16_dots_hold_queries_beyond_float16(cfg, magnitude, cap):
    """float32 queries of magnitude 2^20 (float16 overflows: inf, NaN outputs) or 2^-24 (float16 flushes them) with f16
    dots (triton_tiles.f16_query scales each row by a power of two and its logit scale back); the softmax scale divided
    by the magnitude keeps the logits O(1); float16 values times a power of two, so float16 holds them exactly."""
    q, cache, scales, exact, table = _case("fp8_e4m3", seed=6)
    q = q.float() * magnitude
    scale = D ** -0.5 / magnitude
    got = _decode(cfg, q, cache, scales, table, LENS, 4, cap=cap, scale=scale)
    _check(got, _reference(q, exact, table, LENS, None, cap, scale), range(len(LENS)))


def test_heads_per_program_falls_back_where_tiles_cannot_start_on_pages():
    from cpattn.attention.backends.triton_decode_heads import heads_per_program

    cfg = dict(heads_per_program=8)
    assert heads_per_program(cfg, 8, 16, 32, 1) == 8
    assert heads_per_program(cfg, 4, 16, 32, 1) == 4            # cut to K
    assert heads_per_program(cfg, 6, 16, 32, 1) == 2            # a power of two dividing K
    assert heads_per_program(cfg, 8, 16, 32, 3) == 0            # query groups: the one-head kernel
    assert heads_per_program(cfg, 8, 12, 48, 1) == 0            # pages not a power of two
    assert heads_per_program(cfg, 8, 32, 16, 1) == 0            # a tile shorter than a page
    assert heads_per_program(dict(heads_per_program=0), 8, 16, 32, 1) == 0
