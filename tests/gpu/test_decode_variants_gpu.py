"""The TRITON decode kernel's launch variants (triton_decode.CONFIG_OVERRIDES candidates: page-wise loads, prefetch,
f16 dots, V scaled first, tile lengths, split factors) compile and match float64 on the GPU, bf16 and fp8 e4m3, on
decodes that split KV and on DCP context passes with query groups; tests/test_triton_decode_variants_interpret.py is
the same check through the interpreter. Whatever a sweep adopts is one of these.
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


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_variant_matches_float64(variant, fmt, monkeypatch):
    from cpattn.attention.backends import triton_decode

    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": dict(variant), "query_groups": dict(variant)})
    b = outlier_batch(*MIXED, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    for world, interleave in ((1, 1), (2, 16)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, None, None, fmt, "cuda", world,
                                                   interleave)
        assert rel(out, same) < 1e-2, (world, rel(out, same))
        assert rel(out, exact) < (2e-2 if fmt is None else 1e-1), (world, rel(out, exact))
