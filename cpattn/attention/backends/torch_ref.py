"""TORCH reference backend: paged attention in plain torch, any device, float32 and float64.

The oracle every other backend is tested against; returns natural-log LSE [T, Hq]. It loops over
requests in Python, which is clear rather than fast.
Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, L keys of one request.
"""

from __future__ import annotations

import math

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, write_kv_cache)
from cpattn.attention.merge import LseBase
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.kvstore import MultipleOf


# Scores of one tile (queries x keys x heads) stay under this many bytes: memory grows with T, not T^2.
TILE_BYTES = 32 << 20


def dense_attention(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, scale: float,
                    causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: queries vs keys, GQA by grouping. causal_offset c: query i sees keys j <= c + i;
    None: every key. Returns out [Lq, Q, D] and natural-log lse [Lq, Q] (float32, or float64 for float64).

    Runs in query tiles whose scores fit TILE_BYTES (a causal tile reads only the keys it can see), so a
    long prefill never materialises [Lq, L] scores at once.
    """
    lq, hq, _ = q_LQD.shape
    lk = k_LKD.shape[0]
    itemsize = 8 if q_LQD.dtype == torch.float64 else 4
    rows = max(1, TILE_BYTES // max(1, 3 * lk * hq * itemsize))   # scores, probabilities and a mask copy
    if lq <= rows:
        return _dense_attention_tile(q_LQD, k_LKD, v_LKD, scale, causal_offset)
    outs, lses = [], []
    for a in range(0, lq, rows):
        b = min(lq, a + rows)
        if causal_offset is None:
            o, l = _dense_attention_tile(q_LQD[a:b], k_LKD, v_LKD, scale, None)
        else:
            visible = max(0, min(lk, causal_offset + b))   # keys j <= c + i for the tile's last query
            o, l = _dense_attention_tile(q_LQD[a:b], k_LKD[:visible], v_LKD[:visible], scale, causal_offset + a)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _dense_attention_tile(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, scale: float,
                          causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    lq, hq, d = q_LQD.shape
    lk, hk, _ = k_LKD.shape
    compute = torch.float64 if q_LQD.dtype == torch.float64 else torch.float32
    if lk == 0 or lq == 0:
        return (torch.zeros(lq, hq, d, dtype=q_LQD.dtype, device=q_LQD.device),
                torch.full((lq, hq), -math.inf, dtype=compute, device=q_LQD.device))
    g = hq // hk
    q = q_LQD.to(compute).view(lq, hk, g, d)
    scores = torch.einsum("qkgd,lkd->kgql", q, k_LKD.to(compute)) * scale
    if causal_offset is not None:
        qi = torch.arange(lq, device=q.device)[:, None]
        kj = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill(kj > qi + causal_offset, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                                    # [K, G, Lq]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None])
    out = torch.einsum("kgql,lkd->qkgd", probs, v_LKD.to(compute)).reshape(lq, hq, d)
    return out.to(q_LQD.dtype), lse.permute(2, 0, 1).reshape(lq, hq)


def ragged_causal_attention(q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                            pieces_P3: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [qs, qe) attend causally to keys [ks, qe) for each piece (qs, qe, ks); see AttentionImpl."""
    t, hq, d = q_TQD.shape
    compute = torch.float64 if q_TQD.dtype == torch.float64 else torch.float32
    out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
    lse = torch.full((t, hq), -math.inf, dtype=compute, device=q_TQD.device)
    for qs, qe, ks in pieces_P3.tolist():
        o, l = dense_attention(q_TQD[qs:qe], k_TKD[ks:qe], v_TKD[ks:qe], scale, causal_offset=qs - ks)
        out[qs:qe], lse[qs:qe] = o, l
    return out, lse.float() if compute == torch.float32 else lse


def gather_request_kv(kv_cache_2NBKD: torch.Tensor, block_row: torch.Tensor, seq_len: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, K, D] of one request, read page by page through its block-table row."""
    _, _, block_size, hk, d = kv_cache_2NBKD.shape
    num_pages = (seq_len + block_size - 1) // block_size
    pages = block_row[:num_pages]
    if bool((pages < 0).any()):
        raise ValueError(f"block-table row has padding within its first {num_pages} pages: {pages.tolist()}")
    k = kv_cache_2NBKD[0, pages].reshape(-1, hk, d)[:seq_len]
    v = kv_cache_2NBKD[1, pages].reshape(-1, hk, d)[:seq_len]
    return k, v


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common.to(self.spec.device)


class TorchAttentionImpl(AttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata):
        md: CommonAttentionMetadata = attn_metadata
        write_kv_cache(kv_cache, k_TKD, v_TKD, md.slot_mapping)
        t, hq, d = q_TQD.shape
        compute = torch.float64 if q_TQD.dtype == torch.float64 else torch.float32
        out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.full((t, hq), -math.inf, dtype=compute, device=q_TQD.device)
        qsl = md.query_start_loc_cpu.tolist()
        lens = md.seq_lens_cpu.tolist()
        for r in range(md.num_reqs):
            qs, qe, seq_len = qsl[r], qsl[r + 1], lens[r]
            if qe == qs or seq_len == 0:
                continue
            k, v = gather_request_kv(kv_cache, md.block_table_tensor[r], seq_len)
            offset = seq_len - (qe - qs) if md.causal else None
            out[qs:qe], lse[qs:qe] = dense_attention(q_TQD[qs:qe], k, v, self.spec.scale, offset)
        return out, lse


class TorchReferenceBackend(AttentionBackend):
    name = "TORCH"
    impl_cls = TorchAttentionImpl
    builder_cls = TorchMetadataBuilder
    supported_dtypes = ("float16", "bfloat16", "float32", "float64")
    supported_devices = ("cpu", "cuda")
    supported_head_sizes = None
    lse_base = LseBase.E
    can_return_lse = True
    supports_pcp = True
    cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [MultipleOf(1)]

    @classmethod
    def kernel_version(cls) -> str:
        return f"torch {torch.__version__}"

    @classmethod
    def validate(cls, config):
        reasons = super().validate(config)
        # Beyond the declarations: any head size works here (no kernel constraints).
        return [r for r in reasons if not r.startswith("head_size")]
