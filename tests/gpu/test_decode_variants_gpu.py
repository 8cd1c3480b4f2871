"""The TRITON decode kernel's launch variants (triton_decode.CONFIG_OVERRIDES candidates: page-wise loads, prefetch,
f16 dots, V scaled first, tile lengths, split factors, H kv heads per program: triton_decode_heads.py) compile and match
float64 on the GPU, bf16 and fp8 e4m3 (e5m2, windows, soft caps for the heads kernel), on decodes that split KV and on
DCP context passes with query groups; tests/test_triton_decode_variants_interpret.py and
tests/test_triton_decode_heads_interpret.py are the same checks through the interpreter. Whatever a sweep adopts is
one of these.
Run: bash scripts/test_gpu.sh kernels
"""

from __future__ import annotations

import pytest
import torch

from cpattn.attention.backends.triton_attn import TritonAttentionBackend
from tests.kernel_feature_cases import outlier_batch, rel, run_case

pytestmark = pytest.mark.gpu
MIXED = ([1, 7, 1, 16, 5, 1], [40, 0, 5000, 3000, 250, 3000])   # 16 queries x G 4 = a prefix pass's 64 rows
VARIANTS = [dict(page_tiles=True), dict(prefetch=True), dict(fp8_v_scaled=True, fp8_f16_dot=True),
            dict(block_n=256, num_warps=8, num_stages=2, split_factor=2), dict(block_n=64, num_warps=8, num_stages=3),
            dict(block_n=32, num_warps=4, num_stages=2, waves=4, page_tiles=True, prefetch=True),
            dict(split_factor=0.5, num_stages=1)]
# triton_decode_heads.py (fp8 decodes only: query groups and bf16 keep the one-head kernel): benchmarks/
# triton_decode_sweep.py's HEADS_CANDIDATES and HEADS_TILINGS' shapes
HEADS = [dict(heads_per_program=8, block_n=16, num_warps=8, num_stages=4, fp8_f16_dot=True),
         dict(heads_per_program=8, block_n=32, num_warps=8, num_stages=3, fp8_f16_dot=True),
         dict(heads_per_program=4, block_n=64, num_warps=4, num_stages=2, fp8_f16_dot=True),
         dict(heads_per_program=8, block_n=16, num_warps=4, num_stages=4, split_factor=0.5),
         dict(heads_per_program=4, block_n=64, num_stages=1, fp8_f16_dot=True),   # adopted 2026-12-01
         dict(heads_per_program=2, block_n=64, num_warps=2, num_stages=1, fp8_f16_dot=True),
         dict(heads_per_program=4, block_n=128, num_warps=4, num_stages=1, fp8_f16_dot=True)]
# triton_decode_fp8_mma.py (e4m3 plain decodes only; e5m2 and query groups take the kernels above): the sweep's
# MMA_CANDIDATES' shapes
MMA = [dict(fp8_mma=True, block_n=64, num_warps=8, num_stages=1), dict(fp8_mma=True, block_n=32, num_warps=4,
                                                                        num_stages=3),
       dict(fp8_mma=True, block_n=64, num_warps=4, num_stages=3), dict(fp8_mma=True, block_n=128, num_warps=8,
                                                                       num_stages=2, split_factor=0.5)]
VARIANTS += HEADS + MMA + [dict(block_n=64, num_stages=1, page_tiles=True, prefetch=True)]   # query groups' adopted
VARIANTS += [dict(fp8_cuda=True), dict(fp8_cuda=True, split_factor=4)]   # cuda_decode_fp8.py (e4m3 plain decodes)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_variant_matches_float64(variant, fmt, monkeypatch):
    from cpattn.attention.backends import triton_decode

    # Query groups take a tile of up to 128 keys (benchmarks/prefix_pass_sweep.py's candidates): a bf16 pass over
    # 256-key tiles asks ~280 KB of shared memory, more than an H200 has (measured 2026-12-01), and no sweep adopts it.
    groups = dict(variant) if variant.get("block_n", 0) <= 128 else {}
    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": dict(variant), "query_groups": groups})
    b = outlier_batch(*MIXED, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    for world, interleave in ((1, 1), (2, 16)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, None, None, fmt, "cuda", world,
                                                   interleave)
        assert rel(out, same) < 1e-2, (world, rel(out, same))
        assert rel(out, exact) < (2e-2 if fmt is None else 1e-1), (world, rel(out, exact))


@pytest.mark.parametrize("variant", HEADS + MMA[:2], ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("window, cap, fmt", [(None, None, "fp8_e5m2"), (1000, 30.0, "fp8_e4m3"),
                                              (37, None, "fp8_e5m2")])
def test_heads_kernel_features_match_float64(variant, window, cap, fmt, monkeypatch):
    """The heads kernel (and the fp8-dot one: e4m3 rows) under windows (mid-page starts), soft caps and fp8 e5m2, one
    shard and two."""
    from cpattn.attention.backends import triton_decode

    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": dict(variant), "query_groups": {}})
    b = outlier_batch(*MIXED, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=4)
    bound = {"fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}[fmt]
    for world, interleave in ((1, 1), (2, 16)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, window, cap, fmt, "cuda", world,
                                                   interleave)
        assert rel(out, same) < 1e-2, (world, rel(out, same))
        assert rel(out, exact) < bound, (world, rel(out, exact))
