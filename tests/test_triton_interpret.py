"""The TRITON kernels' sliding window, soft cap and fp8 KV read on the CPU, through Triton's interpreter.

Runs where triton is installed and no GPU is (the GPU tests cover real shapes: tests/gpu/
test_backend_features_gpu.py); skipped otherwise, e.g. in the CPU suite's own process, which has no triton (the suite
runs it beside, with triton: tests/interpreter_run.py). By hand:
    TRITON_INTERPRET=1 PYTHONPATH=. <a python with torch and triton> -m pytest tests/test_triton_interpret.py
The interpreter cannot run a bf16 dot (numpy has no bfloat16), so these cases use float16 activations.
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

from cpattn.attention import make_causal_metadata                                      # noqa: E402
from cpattn.attention.backends.triton_attn import TritonAttentionBackend                # noqa: E402
from tests.kernel_feature_cases import outlier_batch, rel, run_case, spec              # noqa: E402

SHAPE = ([1, 7, 1, 33, 5, 1], [40, 0, 300, 10, 150, 0])     # decodes that split KV, prefills with context
KERNEL_TOL = 1e-3        # vs TORCH float64 on the same (dequantised) values, float16 activations
FP8_BOUND = {"fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}


@pytest.mark.parametrize("window, cap, fmt, world, interleave", [
    (None, None, None, 1, 1), (37, None, None, 1, 1), (None, 5.0, None, 1, 1), (None, None, "fp8_e4m3", 1, 1),
    (37, 5.0, "fp8_e5m2", 1, 1), (37, 5.0, "fp8_e4m3", 2, 1), (70, 5.0, "fp8_e4m3", 2, 16),
    # DCP context passes without windows: the 7- and 5-query requests run as query groups (triton_query_groups.py)
    (None, None, None, 2, 1), (None, 5.0, "fp8_e4m3", 3, 16)])
def test_triton_features_vs_float64(window, cap, fmt, world, interleave):
    b = outlier_batch(*SHAPE, 8, 2, 32, 16, torch.float16, "cpu", seed=1)
    (out, lse), (same, same_lse), (exact, _) = run_case(TritonAttentionBackend, b, window, cap, fmt, "cpu", world,
                                                        interleave)
    assert rel(out, same) < KERNEL_TOL
    finite = ~same_lse.isinf()
    assert torch.equal(lse.isinf(), ~finite) and float((lse - same_lse)[finite].abs().max()) < 1e-3
    assert rel(out, exact) < (KERNEL_TOL if fmt is None else FP8_BOUND[fmt])


def test_triton_window_never_reads_pages_before_the_window():
    """Pages wholly before every query's window hold NaN: the outputs are unchanged (not read, not just masked)."""
    from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchMetadataBuilder

    window = 40
    b = outlier_batch([1, 30, 1], [200, 100, 300], 8, 2, 32, 16, torch.float16, "cpu", seed=2)
    md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table, b.block_size)
    starts = md.window_key_start(window)
    poisoned = b.kv_cache.clone()
    qsl = md.query_start_loc_cpu.tolist()
    for r in range(md.num_reqs):
        first_page = int(starts[qsl[r]:qsl[r + 1]].min()) // b.block_size
        poisoned[:, b.block_table[r, :first_page]] = float("nan")
    s = spec(b, torch.float16, "cpu", window, None)
    outs = []
    for cache in (b.kv_cache, poisoned):
        plan = TritonAttentionBackend.get_builder_cls()(s).build(0, md)
        outs.append(TritonAttentionBackend.get_impl_cls()(s).forward(0, b.q, b.k, b.v, cache.clone(), plan)[0])
    assert torch.equal(outs[0], outs[1]) and bool(outs[1].isfinite().all())
    s64 = spec(b, torch.float64, "cpu", window, None)
    ref, _ = TorchAttentionImpl(s64).forward(0, b.q.double(), b.k.double(), b.v.double(), b.kv_cache.double(),
                                            TorchMetadataBuilder(s64).build(0, md))
    assert rel(outs[1], ref) < KERNEL_TOL


def test_triton_fp8_kernel_pages_smaller_than_scale_pages():
    """A kernel view with pages of 16 over manager pages of 32: kernel page p reads scale page p // 2."""
    import dataclasses

    from cpattn.kvstore import expand_block_table, kernel_kv_view
    from tests.kernel_feature_cases import _torch64, to_fp8

    b = outlier_batch([1, 9, 1], [100, 20, 300], 8, 2, 32, 32, torch.float16, "cpu", seed=3)
    md32 = make_causal_metadata(b.query_lens, b.context_lens, b.block_table, 32)
    cache, scales = to_fp8(b.kv_cache, md32.slot_mapping, b.k, b.v, "fp8_e4m3")
    ref, _ = _torch64(b, md32, cache, scales, 50, 5.0, "cpu")
    table16 = expand_block_table(b.block_table, 32, 16)
    md16 = make_causal_metadata(b.query_lens, b.context_lens, table16, 16)
    s = spec(dataclasses.replace(b, block_size=16, block_table=table16), torch.float16, "cpu", 50, 5.0)
    plan = TritonAttentionBackend.get_builder_cls()(s).build(0, md16)
    out, _ = TritonAttentionBackend.get_impl_cls()(s).forward(0, b.q, b.k, b.v, kernel_kv_view(cache.clone(), 32, 16),
                                                              plan, kv_scale=scales)
    assert rel(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_triton_fp8_decode_with_float16_dots(fmt, monkeypatch):
    """DECODE_CONFIG's fp8_f16_dot (the dots in float16, a speed candidate for bf16 services): as exact as the
    default on decodes that split KV and on DCP context passes (query groups)."""
    from cpattn.attention.backends import triton_decode

    monkeypatch.setitem(triton_decode.DECODE_CONFIG, "fp8_f16_dot", True)
    b = outlier_batch(*SHAPE, 8, 2, 32, 16, torch.float16, "cpu", seed=4)
    for world, interleave in ((1, 1), (2, 16)):
        (out, _), (same, _), (exact, _) = run_case(TritonAttentionBackend, b, None, None, fmt, "cpu", world, interleave)
        assert rel(out, same) < KERNEL_TOL and rel(out, exact) < FP8_BOUND[fmt]
