"""Sliding windows, soft caps and fp8 KV caches for a backend's kernels, against the TORCH backend in float64.

Used by the GPU tests (tests/gpu/test_backend_features_gpu.py) and, with TRITON_INTERPRET=1 on the CPU, by
tests/test_triton_interpret.py. Two references per case:
- ``same``: TORCH in float64 on exactly the values the kernel reads (the fp8 bytes dequantised with their page
  scales): the kernel's own error (the dot's dtype, base-2 softmax);
- ``exact``: float64 attention on the exact K/V before any fp8 rounding: what the user gets (the format's floor).
A DCP case deals the context over shards (tests/gpu/batches.dcp_shards), runs the backend on every shard (context
partial, causal=False), the new tokens' causal part with forward_new_tokens, and merges by LSE.
Legend: T tokens, Q query heads, K kv heads, D head size, N pages.
"""

from __future__ import annotations

import dataclasses

import torch

from cpattn.attention import AttentionSpec, LseBase, make_causal_metadata, merge_attn_states, to_natural_lse
from cpattn.attention.backend import write_kv_cache
from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchMetadataBuilder
from cpattn.kvstore.fp8 import FP8_FORMATS, PageScaleWrites, fp8_format_of, page_scales_of, quantize
from tests.gpu.batches import dcp_shards, new_token_pieces, random_batch


def with_outliers(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One channel 20x larger and 0.2% of entries at +-40 sigma (the fp8 tests' data)."""
    x = x.clone()
    x[..., 3] *= 20.0
    spikes = torch.rand(x.shape, generator=g) < 0.002
    return torch.where(spikes, torch.sign(x) * 40.0, x)


def outlier_batch(query_lens, context_lens, hq, hk, d, block_size, dtype, device, seed=0):
    """tests/gpu/batches.random_batch with outliers in K (scaled 0.3) and V, context and new tokens alike."""
    b = random_batch(query_lens, context_lens, hq, hk, d, block_size, torch.float32, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    kv = torch.stack([with_outliers(b.kv_cache[0], g) * 0.3, with_outliers(b.kv_cache[1], g)])
    k, v = with_outliers(b.k, g) * 0.3, with_outliers(b.v, g)
    return dataclasses.replace(b, q=b.q.to(dtype).to(device), k=k.to(dtype).to(device), v=v.to(dtype).to(device),
                               kv_cache=kv.to(dtype).to(device), block_table=b.block_table.to(device))


def to_fp8(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str):
    """The cache as the service stores it: per-page scales from the pages' values, then the step's new tokens
    written with their pages' scales grown (kvstore.fp8.PageScaleWrites). Returns (fp8 cache, scales)."""
    scales = page_scales_of(kv_cache.float(), fmt)                                   # [2, N, K]
    cache = quantize(kv_cache.float(), scales[:, :, None, :, None], FP8_FORMATS[fmt])
    plan = PageScaleWrites([slots.cpu()], kv_cache.shape[2], kv_cache.device)
    plan.grow(cache, scales, k.float(), v.float(), fmt)
    write_kv_cache(cache, k.float(), v.float(), slots, scales)
    return cache, scales


def spec(b, dtype, device, window, cap, kv_cache_dtype="auto") -> AttentionSpec:
    return AttentionSpec(num_q_heads=b.q.shape[1], num_kv_heads=b.k.shape[1], head_size=b.q.shape[2], dtype=dtype,
                         block_size=b.block_size, device=str(device), sliding_windows=(window,),
                         logits_soft_caps=(cap,), kv_cache_dtype=kv_cache_dtype)


def _torch64(b, md, cache, scales, window, cap, device):
    s = spec(b, torch.float64, device, window, cap)
    plan = TorchMetadataBuilder(s).build(0, md)
    cache64 = cache if scales is not None else cache.double()
    return TorchAttentionImpl(s).forward(0, b.q.double(), b.k.double(), b.v.double(), cache64.clone(), plan,
                                         kv_scale=scales)


def _backend(cls, b, md, cache, scales, window, cap, device):
    s = spec(b, b.q.dtype, device, window, cap, fp8_format_of(cache.dtype) or "auto")
    plan = cls.get_builder_cls()(s).build(0, md)
    extra = {} if scales is None else {"kv_scale": scales}
    out, lse = cls.get_impl_cls()(s).forward(0, b.q, b.k, b.v, cache.clone(), plan, **extra)
    return out, to_natural_lse(lse.double(), cls.lse_base)


def run_case(cls, b, window, cap, fmt, device, world=1, interleave=1):
    """(out, lse) of the backend, and the ``same`` and ``exact`` references (out, lse) in float64."""
    if world == 1:
        md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table.cpu(), b.block_size).to(device)
        cache, scales = (b.kv_cache, None) if fmt is None else to_fp8(b.kv_cache, md.slot_mapping, b.k, b.v, fmt)
        got = _backend(cls, b, md, cache, scales, window, cap, device)
        same = _torch64(b, md, cache, scales, window, cap, device)
    else:
        parts, refs = [], []
        for sh in dcp_shards(b, world, interleave, device):
            cache, scales = (sh.kv_cache, None) if fmt is None else to_fp8(sh.kv_cache, sh.md.slot_mapping, b.k,
                                                                           b.v, fmt)
            parts.append(_backend(cls, b, sh.md, cache, scales, window, cap, device))
            refs.append(_torch64(b, sh.md, cache, scales, window, cap, device))
        pieces = new_token_pieces(b.query_lens)
        s = spec(b, b.q.dtype, device, window, cap)
        new = cls.get_impl_cls()(s).forward_new_tokens(b.q, b.k, b.v, pieces, layer=0)
        parts.append((new[0], new[1].double()))
        s64 = spec(b, torch.float64, device, window, cap)
        refs.append(TorchAttentionImpl(s64).forward_new_tokens(b.q.double(), b.k.double(), b.v.double(), pieces, 0))
        got = merge_attn_states(torch.stack([o.double() for o, _ in parts]), torch.stack([l for _, l in parts]),
                                LseBase.E)
        same = merge_attn_states(torch.stack([o for o, _ in refs]), torch.stack([l for _, l in refs]), LseBase.E)
    md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table.cpu(), b.block_size).to(device)
    exact = _torch64(b, md, b.kv_cache, None, window, cap, device)
    return got, same, exact


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def check_cpu_model_case(cls, shape, window, cap, fmt, world, interleave, exact_bound: float) -> None:
    """A backend whose kernels are modelled in float64 on the CPU (tests/test_flashinfer_plumbing.py,
    tests/test_flash_attn_windows.py), on a fresh seed: its output and LSE as TORCH's in float64 on the same values,
    so no error of its own beside the cache format's (an fp8 cache's error vs exact float64 has a tail at these tiny
    heads: e4m3 over 0.1 in ~2 of 1,000 seeds, so ``exact_bound``, the README's bound, is checked at twice it)."""
    seed = int(torch.randint(1 << 30, ()))
    b = outlier_batch(*shape, 8, 2, 16, 16, torch.float32, "cpu", seed=seed)
    (out, lse), (same, same_lse), (exact, _) = run_case(cls, b, window, cap, fmt, "cpu", world, interleave)
    what = f"fmt={fmt} cap={cap} window={window} world={world} I={interleave} seed={seed}"
    assert torch.equal(lse.isinf(), same_lse.isinf()), what
    assert rel(out, same) < 1e-5, f"{what}: vs the same values {rel(out, same):.2e}"
    assert rel(lse.masked_fill(lse.isinf(), 0), same_lse.masked_fill(same_lse.isinf(), 0)) < 1e-5, what
    assert rel(out, exact) <= rel(same, exact) + 1e-5, f"{what}: {rel(out, exact):.2e} vs {rel(same, exact):.2e}"
    assert rel(out, exact) < 2 * exact_bound, f"{what}: vs exact float64 {rel(out, exact):.2e}"
