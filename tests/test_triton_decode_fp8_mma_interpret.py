"""The fp8 tensor-core decode kernel (triton_decode_fp8_mma.py, DECODE_CONFIG fp8_mma: issue 22's speed candidate, off)
against float64, through Triton's interpreter on the CPU: an e4m3 cache at random pages, GQA, odd lengths, an empty
row, split and direct outputs, windows with a soft cap, V pages 2^40 apart, queries far outside e4m3's range, and the
fallbacks (e5m2 caches, pages that tiles cannot start on). The bound is the f16-dot kernels': q's e4m3 hi + lo holds
bf16 queries exactly.
    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch, triton> -m pytest tests/test_triton_decode_fp8_mma_interpret.py
"""

from __future__ import annotations

import os

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

from tests.test_triton_decode_heads_interpret import (D, LENS, PAGES, _case, _decode,  # noqa: E402
                                                       _reference)

MMA = dict(fp8_mma=True, block_n=32)
# q's e4m3 hi + lo: exact for bf16 queries (so the logits and the LSE are as exact as f16 dots'); the PV dot in
# float16, as the f16-dot kernels'.
MMA_TOL = 2e-3
LSE_TOL = 2e-3


def _bf16_case(fmt: str, **kw):
    """_case with bf16-valued queries (what a bf16 model hands over; float16 holds them exactly): e4m3 hi + lo holds
    every normal bf16 value exactly (hi keeps 4 significant bits, the rounding's remainder at most 4 more)."""
    q, *rest = _case(fmt, **kw)
    return (q.to(torch.bfloat16).to(q.dtype), *rest)


def _check(got, ref, rows, tol=MMA_TOL):
    (out, lse), (ref_out, ref_lse) = got, ref
    for t in rows:
        if torch.isinf(ref_lse[t, 0]):
            assert torch.isinf(lse[t]).all() and float(out[t].abs().max()) == 0.0
            continue
        err = float((out[t] - ref_out[t]).norm() / ref_out[t].norm())
        assert err < tol, (t, err)
        assert float((lse[t] - ref_lse[t]).abs().max()) < LSE_TOL, t


@pytest.mark.parametrize("splits", [4, 1])
@pytest.mark.parametrize("seed", [3, 11])
def test_fp8_mma_kernel_vs_float64(splits, seed):
    """Split KV (many splits empty for the short rows) and unsplit (direct rows), two seeds."""
    q, cache, scales, exact, table = _bf16_case("fp8_e4m3", seed=seed)
    ref = _reference(q, exact, table, LENS, None, None, D ** -0.5)
    _check(_decode(MMA, q, cache, scales, table, LENS, splits), ref, range(len(LENS)))


def test_fp8_mma_windows_and_soft_cap_on_some_rows():
    """Windows starting mid-page (and one past its row's end) under a soft cap, decoding rows 0, 2, 3, 4 only."""
    q, cache, scales, exact, table = _bf16_case("fp8_e4m3", seed=4)
    starts = [70, 0, 3, 99, 9]
    ref = _reference(q, exact, table, LENS, starts, 5.0, D ** -0.5)
    got = _decode(MMA, q, cache, scales, table, LENS, 2, starts=starts, cap=5.0, rows=[0, 2, 3, 4])
    _check(got, ref, [0, 2, 3, 4])
    assert got[0][1].isnan().all() and got[1][1].isnan().all()      # row 1 is not decoded: left alone


def test_fp8_mma_v_pages_far_apart():
    """V pages of magnitude 2^-20 and 2^-60 in one tile: each page's scale over the tile's largest goes into the
    probabilities (e4m3's subnormals end near 2^-9), the largest onto the PV dot's float32 result."""
    mags = torch.tensor([2.0 ** -60 if p % 2 else 2.0 ** -20 for p in range(PAGES)])
    q, cache, scales, exact, table = _bf16_case("fp8_e4m3", seed=5, v_page_scales=mags)
    ref = _reference(q, exact, table, LENS, None, None, D ** -0.5)
    _check(_decode(MMA, q, cache, scales, table, LENS, 4), ref, range(len(LENS)))


@pytest.mark.parametrize("magnitude", [2.0 ** 30, 2.0 ** -30])
def test_fp8_mma_queries_beyond_e4m3(magnitude):
    """float32 queries of magnitude 2^30 or 2^-30 (e4m3 holds 2^-9 .. 448): each row is scaled by a power of two into
    [2^7, 2^8) and its logit scale divided by it; the softmax scale over the magnitude keeps the logits O(1)."""
    q, cache, scales, exact, table = _bf16_case("fp8_e4m3", seed=6)
    q = q.float() * magnitude
    scale = D ** -0.5 / magnitude
    got = _decode(MMA, q, cache, scales, table, LENS, 4, scale=scale)
    _check(got, _reference(q, exact, table, LENS, None, None, scale), range(len(LENS)))


def test_fp8_mma_serves_only_e4m3_plain_decodes_on_page_tiles():
    from cpattn.attention.backends.triton_decode_fp8_mma import fp8_mma_serves
    e4m3 = torch.zeros(1, 16, 1, 8, dtype=torch.float8_e4m3fn)
    e5m2 = e4m3.to(torch.float8_e5m2)
    scales = torch.ones(2, 1, 1)
    assert fp8_mma_serves(MMA, e4m3, scales, 16, 32, 1)
    assert not fp8_mma_serves(dict(MMA, fp8_mma=False), e4m3, scales, 16, 32, 1)   # not asked
    assert not fp8_mma_serves(MMA, e5m2, scales, 16, 32, 1)      # e5m2: the other kernels' f16 dots
    assert not fp8_mma_serves(MMA, e4m3, None, 16, 32, 1)        # no scales: not an fp8 cache
    assert not fp8_mma_serves(MMA, e4m3, scales, 16, 32, 4)      # a query group: triton_decode's kernel
    assert not fp8_mma_serves(MMA, e4m3, scales, 12, 48, 1)      # pages not a power of two
    assert not fp8_mma_serves(MMA, e4m3, scales, 16, 16, 1)      # tiles shorter than the PV dot's k (32)


def test_fp8_mma_falls_back_for_e5m2():
    """An e5m2 cache under fp8_mma decodes through the other kernels, exactly as without it."""
    q, cache, scales, exact, table = _case("fp8_e5m2", seed=7)
    ref = _reference(q, exact, table, LENS, None, None, D ** -0.5)
    _check(_decode(MMA, q, cache, scales, table, LENS, 4), ref, range(len(LENS)), tol=2e-3)
