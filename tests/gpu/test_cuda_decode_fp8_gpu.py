"""cuda_decode_fp8.py's CUDA kernel (an e4m3 cache's plain decodes, DECODE_CONFIG fp8_cuda) matches float64 through
the TRITON backend on the GPU: G = 1 .. 16 (odd G too), pages of 8 / 16 / 64 tokens, bf16 and f16 queries, key counts
around the 32-key tiles (1, 31, 33, ...) and long ones, one split (rows written directly) and many, DCP shards
(interleave 1 and 16), outlier data; the kernel is checked to be the one that ran. ``same`` is float64 over the same
fp8 cache (the kernel's own error), ``exact`` float64 over the unquantised cache (issue 22's bound).
Run: bash scripts/test_gpu.sh kernels
"""

from __future__ import annotations

import pytest
import torch

from cpattn.attention.backends import cuda_decode_fp8
from cpattn.attention.backends.triton_attn import TritonAttentionBackend
from tests.kernel_feature_cases import outlier_batch, rel, run_case

pytestmark = pytest.mark.gpu
LENGTHS = [1, 31, 33, 5000, 95, 32, 64, 2047, 129, 7]


@pytest.fixture
def counted(monkeypatch):
    """CONFIG_OVERRIDES' fp8 entry asks for the CUDA kernel; the launches are counted."""
    calls = []
    real = cuda_decode_fp8.launch_fp8_cuda

    def launch(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    # by name, when a test runs: triton_decode imports triton, which a CPU run that collects this module lacks
    monkeypatch.setattr("cpattn.attention.backends.triton_decode.launch_fp8_cuda", launch)

    def use(**cfg):
        monkeypatch.setattr("cpattn.attention.backends.triton_decode.CONFIG_OVERRIDES",
                            {"fp8": dict(fp8_cuda=True, **cfg), "query_groups": {}})
        return calls

    return use


@pytest.mark.parametrize("hq, hk", [(32, 8), (16, 16), (32, 2), (24, 8), (16, 2)])
@pytest.mark.parametrize("page", [8, 16, 64])
def test_cuda_fp8_decode_matches_float64(hq, hk, page, counted):
    calls = counted()
    b = outlier_batch([1] * len(LENGTHS), LENGTHS, hq, hk, 128, page, torch.bfloat16, "cuda", seed=hq + page)
    for world, interleave in ((1, 1), (2, 16), (3, 1)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, None, None, "fp8_e4m3", "cuda", world,
                                                   interleave)
        assert torch.isfinite(out).all()
        assert rel(out, same) < 1e-2, (world, rel(out, same))
        assert rel(out, exact) < 1e-1, (world, rel(out, exact))
    assert calls, "the CUDA kernel did not run"


@pytest.mark.parametrize("split_factor", [0.01, 1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp8_decode_one_split_and_many(split_factor, dtype, counted):
    """split_factor 0.01: one split, the block writes the output rows (bf16 / f16); 8: short splits, many empty."""
    calls = counted(split_factor=split_factor)
    b = outlier_batch([1, 1, 1], [20000, 3, 700], 32, 8, 128, 16, dtype, "cuda", seed=11)
    (out, lse), (same, same_lse), (exact, _) = run_case(TritonAttentionBackend, b, None, None, "fp8_e4m3", "cuda")
    assert rel(out, same) < 1e-2 and rel(out, exact) < 1e-1, (rel(out, same), rel(out, exact))
    assert (lse.double() - same_lse).abs().max() < 2e-2
    assert calls and (split_factor != 0.01 or set(calls) == {1}), calls


def test_cuda_fp8_decode_declines_what_it_does_not_serve(counted):
    """Windows and soft caps take the Triton kernels (still exact); the reasons are named."""
    calls = counted()
    b = outlier_batch([1, 1], [3000, 500], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    (out, _), _, (exact, _) = run_case(TritonAttentionBackend, b, 1000, 30.0, "fp8_e4m3", "cuda")
    assert rel(out, exact) < 1e-1 and not calls
    q = torch.zeros(1, 32, 64, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(4, 16, 8, 64, dtype=torch.float8_e4m3fn, device="cuda")
    idx = torch.zeros(1, dtype=torch.int64, device="cuda")
    why = cuda_decode_fp8.fp8_cuda_unserved({"fp8_cuda": True}, q, cache, torch.ones(2, 4, 8), 1, None, None,
                                            (idx, idx))
    assert any("head size 64" in w for w in why) and any("int32" in w for w in why), why


@pytest.mark.parametrize("cfg", [dict(cuda_v_swizzle=True), dict(cuda_v_swizzle=True, cuda_stages=3),
                                 dict(cuda_heads_per_block=True), dict(cuda_min_blocks=3),
                                 dict(cuda_stages=3, split_factor=2), dict(cuda_heads_per_block=True, split_factor=0.5)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("hq, hk, page", [(32, 8, 16), (32, 2, 64), (16, 4, 8)])
def test_cuda_fp8_decode_variants_match_float64(cfg, hq, hk, page, counted):
    """fp8_cuda_probe.py's candidates (a kv head per warp: 2 kv heads do not divide into 4 warps, one head per block
    serves them; fewer registers; deeper rings)."""
    calls = counted(**cfg)
    b = outlier_batch([1] * len(LENGTHS), LENGTHS, hq, hk, 128, page, torch.bfloat16, "cuda", seed=hq * hk + page)
    for world, interleave in ((1, 1), (2, 16)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, None, None, "fp8_e4m3", "cuda", world,
                                                   interleave)
        assert rel(out, same) < 1e-2 and rel(out, exact) < 1e-1, (world, rel(out, same), rel(out, exact))
    assert calls
