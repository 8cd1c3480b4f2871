"""Sliding windows (global positions), soft caps and fp8 KV caches in the GPU backends, vs float64.

Every backend that declares a feature (its validate() gives no reason) is checked on real shapes:
- against TORCH in float64 on exactly the values the kernel reads (``same``: the kernel's own error), and
- against float64 on the exact K/V (``exact``): bf16 rel < 2e-2; fp8 e4m3 rel < 1e-1, e5m2 < 2e-1 on outlier data
  (one 20x channel, 0.2% of entries at 40 sigma; the README's bounds).
Single-rank causal batches and DCP (2 and 4 shards on one GPU, interleave 1 and 16) with the new tokens' causal
part and the LSE merge; windows smaller than a shard's share, crossing pages and shards; caps; sinks applied
after the merge (as the client does). Cases a backend does not declare are skipped with its reasons.
Run: bash scripts/test_gpu.sh features   (FlashInfer's cases: bash scripts/test_gpu.sh flashinfer -k features)
"""

from __future__ import annotations

import pytest
import torch

from cpattn.attention import apply_sinks
from cpattn.attention.registry import load_backend_class
from cpattn.attention.selector import get_attn_backend
from cpattn.errors import BackendUnavailableError
from tests.kernel_feature_cases import outlier_batch, rel, run_case, spec

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
MIXED = ([1, 7, 1, 33, 5, 1, 300], [40, 0, 5000, 10, 250, 0, 3000])      # the 5000 decode splits KV
LONG_DECODE = ([1, 1], [100_000, 5000])
SAME_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
EXACT_BOUND = {None: 2e-2, "fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}


def _backend_or_skip(name, fmt, window, cap, dtype=torch.bfloat16, d=128):
    try:
        return get_attn_backend(name, head_size=d, dtype=dtype, block_size=16, num_q_heads=8, num_kv_heads=2,
                                device=DEVICE, kv_cache_dtype=fmt or "auto", sliding_window=window is not None,
                                logits_soft_cap=cap is not None)
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} does not serve fmt={fmt} window={window} cap={cap}: {exc.reasons}")


def _check(name, shape, window, cap, fmt, world=1, interleave=1, dtype=torch.bfloat16, seed=0, sinks=False):
    cls = _backend_or_skip(name, fmt, window, cap, dtype)
    b = outlier_batch(*shape, 8, 2, 128, 16, dtype, DEVICE, seed=seed)
    (out, lse), (same, same_lse), (exact, exact_lse) = run_case(cls, b, window, cap, fmt, DEVICE, world, interleave)
    if sinks:                                  # applied once after the merge, as the client does
        s = torch.linspace(-1.0, 2.0, 8, dtype=torch.float64, device=DEVICE)
        out, lse = apply_sinks(out.double(), lse.double(), s)
        same, same_lse = apply_sinks(same, same_lse, s)
        exact, exact_lse = apply_sinks(exact, exact_lse, s)
    what = f"{name} fmt={fmt} window={window} cap={cap} world={world} I={interleave}"
    assert torch.equal(lse.isinf(), same_lse.isinf()), what
    assert rel(out, same) < SAME_TOL[dtype], f"{what}: vs same values {rel(out, same):.2e}"
    assert rel(out, exact) < EXACT_BOUND[fmt], f"{what}: vs exact float64 {rel(out, exact):.2e}"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window, cap, fmt", [
    (None, None, "fp8_e4m3"), (None, None, "fp8_e5m2"), (4096, None, None), (100, None, None), (None, 30.0, None),
    (None, 5.0, None), (100, 5.0, "fp8_e4m3"), (4096, 30.0, "fp8_e5m2")])
def test_features_single_rank(name, window, cap, fmt):
    _check(name, MIXED, window, cap, fmt)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("world, interleave", [(2, 1), (2, 16), (4, 1), (4, 16)])
@pytest.mark.parametrize("window, cap, fmt", [(100, 5.0, "fp8_e4m3"), (700, None, None), (None, 30.0, "fp8_e5m2")])
def test_features_dcp_merge(name, world, interleave, window, cap, fmt):
    """Windows, caps, fp8 and sinks combined under DCP: every shard's partial, the new tokens, one merge."""
    _check(name, MIXED, window, cap, fmt, world, interleave, seed=world + interleave, sinks=True)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window, fmt", [(4096, None), (4096, "fp8_e4m3"), (None, "fp8_e4m3")])
def test_features_long_decode(name, window, fmt):
    _check(name, LONG_DECODE, window, None, fmt, seed=7)


@pytest.mark.parametrize("name", BACKENDS)
def test_features_float16(name):
    _check(name, MIXED, 100, 5.0, "fp8_e4m3", dtype=torch.float16, seed=9)


def test_triton_window_never_reads_pages_before_the_window():
    """Pages wholly before every query's window hold NaN: outputs are unchanged (not read, not just masked)."""
    from cpattn.attention import make_causal_metadata

    cls = _backend_or_skip("TRITON", None, 512, None)
    window = 512
    b = outlier_batch([1, 300, 1], [20000, 1000, 3000], 8, 2, 128, 16, torch.bfloat16, DEVICE, seed=2)
    md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table.cpu(), b.block_size)
    starts = md.window_key_start(window)
    poisoned = b.kv_cache.clone()
    qsl = md.query_start_loc_cpu.tolist()
    for r in range(md.num_reqs):
        first_page = int(starts[qsl[r]:qsl[r + 1]].min()) // b.block_size
        poisoned[:, b.block_table[r, :first_page]] = float("nan")
    s = spec(b, torch.bfloat16, DEVICE, window, None)
    outs = []
    for cache in (b.kv_cache, poisoned):
        plan = cls.get_builder_cls()(s).build(0, md.to(DEVICE))
        outs.append(cls.get_impl_cls()(s).forward(0, b.q, b.k, b.v, cache.clone(), plan)[0])
    assert torch.equal(outs[0], outs[1]) and bool(outs[1].isfinite().all())


@pytest.mark.parametrize("name", BACKENDS)
def test_declared_features_match_validate(name):
    """A backend's validate() reasons name exactly the features it does not declare (issue-19's select_backend
    reads them), each saying what to use instead."""
    from cpattn.attention.backend import AttentionSelectorConfig

    cls = load_backend_class(name)
    cfg = AttentionSelectorConfig(head_size=128, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", block_size=16,
                                  num_q_heads=8, num_kv_heads=2, device_type="cuda",
                                  device_capability=torch.cuda.get_device_capability(), sliding_window=True,
                                  logits_soft_cap=True)
    reasons = " | ".join(cls.validate(cfg))
    assert ("fp8" in reasons) == ("fp8_e4m3" not in cls.supported_kv_cache_dtypes)
    assert ("sliding_window" in reasons) == (not cls.supports_sliding_window)
    assert ("logits_soft_cap" in reasons) == (not cls.supports_logits_soft_cap)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_triton_fp8_write_matches_torch_quantize_bytes(fmt):
    """The KV write kernel quantises exactly as kvstore.fp8.quantize (torch): same bytes, on a cache view with
    kernel pages smaller than the scale pages, with values that saturate (inf), stay NaN, or go subnormal."""
    from cpattn.attention.backend import write_kv_cache as torch_write
    from cpattn.attention.backends import triton_kv_write as tk
    from cpattn.kvstore.fp8 import FP8_FORMATS, PageScaleWrites

    _backend_or_skip("TRITON", fmt, None, None)
    g = torch.Generator().manual_seed(4)
    n, ps, hk, d, t = 64, 32, 8, 128, 500
    slots = torch.randperm(n * ps, generator=g)[:t]
    slots[::7] = -1
    k = torch.randn(t, hk, d, generator=g) * torch.logspace(-6, 3, d)            # down to subnormals
    v = torch.randn(t, hk, d, generator=g)
    k[3, 1, 5], v[4, 2, 6], k[5, 0, 0] = float("inf"), float("nan"), 1e6
    k, v, slots = k.to(torch.bfloat16).to(DEVICE), v.to(torch.bfloat16).to(DEVICE), slots.to(DEVICE)
    scales = torch.zeros(2, n, hk, device=DEVICE)
    ref = torch.zeros(2, n, ps, hk, d, dtype=FP8_FORMATS[fmt], device=DEVICE)
    PageScaleWrites([slots.cpu()], ps, DEVICE).grow(ref, scales, k, v, fmt)
    torch_write(ref, k, v, slots, scales)
    got = torch.zeros_like(ref)
    tk.write_kv_cache(got.view(2, n * 2, ps // 2, hk, d), k, v, slots, scales)      # kernel pages of 16
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=0, equal_nan=True)   # NaN's sign bit aside
    finite = ref.float().isfinite()
    assert torch.equal(got.view(torch.uint8)[finite], ref.view(torch.uint8)[finite])
