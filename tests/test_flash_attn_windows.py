"""FLASH_ATTN with sliding windows on the CPU: its windowed layers run on TRITON's kernels, its full layers on
FlashAttention, on one cache and one step's plan.

FlashAttention's varlen call is replaced by a float64 model of it (paged keys through ``page_table`` and
``seqused_k``, causal bottom-right, ``softcap``, LSE [Q, T] in natural log), and TRITON's builder and impl by TORCH's
(TRITON's kernels are checked on the GPU: tests/gpu/test_backend_features_gpu.py). What runs here is FLASH_ATTN's own
routing: which layer goes where, the KV written once, fp8 pages, the new tokens' causal part with the window.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from tests.kernel_feature_cases import check_cpu_model_case, outlier_batch, rel

MIXED = ([1, 7, 1, 33, 5, 1, 30], [40, 0, 500, 10, 250, 0, 300])
EXACT_BOUND = {None: 1e-6, "fp8_e4m3": 1e-1}


def _varlen_model(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  seqused_k=None, page_table=None, softmax_scale=None, causal=False, return_lse=False, softcap=None):
    """flash_attn.cute.flash_attn_varlen_func in float64: (out [T, Q, D], lse [Q, T])."""
    assert return_lse
    t, hq, d = q.shape
    hk = k.shape[-2]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((hq, t), -math.inf, dtype=torch.float64)
    qo = cu_seqlens_q.long().tolist()
    for r in range(len(qo) - 1):
        if page_table is not None:
            n, ps = int(seqused_k[r]), k.shape[1]
            keys = k[page_table[r, :-(-n // ps)].long()].reshape(-1, hk, d)[:n]
            vals = v[page_table[r, :-(-n // ps)].long()].reshape(-1, hk, d)[:n]
        else:
            k0, k1 = int(cu_seqlens_k[r]), int(cu_seqlens_k[r + 1])
            n, keys, vals = k1 - k0, k[k0:k1], v[k0:k1]
        m = qo[r + 1] - qo[r]
        if n == 0 or m == 0:
            continue
        keys, vals = (x.double().repeat_interleave(hq // hk, 1) for x in (keys, vals))
        s = torch.einsum("tqd,lqd->qtl", q[qo[r]:qo[r + 1]].double(), keys) * softmax_scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            s = s.masked_fill(torch.arange(n)[None, :] > (n - m + torch.arange(m))[:, None], -math.inf)
        out[qo[r]:qo[r + 1]] = torch.einsum("qtl,lqd->tqd", s.softmax(-1).nan_to_num(), vals)
        lse[:, qo[r]:qo[r + 1]] = s.logsumexp(-1)
    return out.to(q.dtype), lse.float()


@pytest.fixture
def flash_attn_model(monkeypatch):
    from cpattn.attention.backends import flash_attn, torch_ref
    from cpattn.attention.backends.triton_attn import TritonAttentionBackend

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _varlen_model
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(TritonAttentionBackend, "impl_cls", torch_ref.TorchAttentionImpl)
    monkeypatch.setattr(TritonAttentionBackend, "builder_cls", torch_ref.TorchMetadataBuilder)
    return flash_attn.FlashAttentionBackend


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
@pytest.mark.parametrize("window, cap", [(None, None), (37, None), (100, 5.0)])
@pytest.mark.parametrize("world, interleave", [(1, 1), (3, 1), (2, 16)])
def test_flash_attn_layers_with_and_without_windows_vs_float64(flash_attn_model, fmt, window, cap, world,
                                                               interleave):
    check_cpu_model_case(flash_attn_model, MIXED, window, cap, fmt, world, interleave, EXACT_BOUND[fmt])


def test_a_model_of_full_and_windowed_layers_keeps_flash_attention_for_its_full_layers(flash_attn_model, monkeypatch):
    """Layers (None, 64): one plan per step; layer 0 calls FlashAttention, layer 1 TRITON's impl (with its window);
    each layer's K/V written once."""
    from cpattn.attention import AttentionSpec, make_causal_metadata
    from cpattn.attention.backends import torch_ref

    b = outlier_batch([1, 20], [300, 100], 8, 2, 16, 16, torch.float32, "cpu", seed=5)
    md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table, b.block_size)
    s = AttentionSpec(8, 2, 16, torch.float32, 16, "cpu", sliding_windows=(None, 64))
    calls = []
    monkeypatch.setattr(sys.modules["flash_attn.cute"], "flash_attn_varlen_func",
                        lambda *a, **kw: calls.append("fa") or _varlen_model(*a, **kw))
    reference = torch_ref.TorchAttentionImpl.forward
    monkeypatch.setattr(torch_ref.TorchAttentionImpl, "forward", lambda self, layer, *a, **kw:
                        calls.append(("triton", layer)) or reference(self, layer, *a, **kw))
    plan = flash_attn_model.get_builder_cls()(s).build(0, md)
    impl = flash_attn_model.get_impl_cls()(s)
    for layer, window in enumerate((None, 64)):
        cache = b.kv_cache.clone()
        out, _ = impl.forward(layer, b.q, b.k, b.v, cache, plan)
        ref_spec = AttentionSpec(8, 2, 16, torch.float64, 16, "cpu", sliding_windows=(window,))
        ref, _ = reference(torch_ref.TorchAttentionImpl(ref_spec), 0, b.q.double(), b.k.double(), b.v.double(),
                           b.kv_cache.double().clone(), md)
        assert rel(out, ref) < 1e-5, f"layer {layer}"
        written = md.slot_mapping
        flat = cache.view(2, -1, 2, 16)
        assert torch.equal(flat[0, written], b.k) and torch.equal(flat[1, written], b.v)
    assert calls == ["fa", ("triton", 1)]
