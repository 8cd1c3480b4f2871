"""TORCH reference backend: paged attention in plain torch, any device, float32 and float64.

The oracle every other backend is tested against; returns natural-log LSE [T, Hq]. It loops over
requests in Python, which is clear rather than fast.
Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, L keys of one request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, write_kv_cache)
from cpattn.attention.cascade import SharedPrefix, cascade_forward, find_shared_prefixes
from cpattn.attention.merge import LseBase
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.errors import InvalidRequestError
from cpattn.kvstore import MultipleOf
from cpattn.kvstore.fp8 import dequantize, fp8_format_of


# Scores of one tile (queries x keys x heads) stay under this many bytes: memory grows with T, not T^2.
TILE_BYTES = 32 << 20


def dense_attention(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, scale: float,
                    causal_offset: int | None, soft_cap: float | None = None,
                    key_start_Lq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: queries vs keys, GQA by grouping. causal_offset c: query i sees keys j <= c + i;
    None: every key. ``key_start_Lq`` (int64 [Lq]): query i also sees only keys j >= key_start[i] (a sliding
    window, already in this key tensor's indices). ``soft_cap``: scaled logits s -> cap * tanh(s / cap).
    K/V may be any float dtype (an fp8 cache is dequantised by the caller). Returns out [Lq, Q, D] and
    natural-log lse [Lq, Q] (float32, or float64 for float64); a query that sees no key gets 0 / -inf.

    Runs in query tiles whose scores fit TILE_BYTES (a causal tile reads only the keys it can see), so a
    long prefill never materialises [Lq, L] scores at once.
    """
    lq, hq, _ = q_LQD.shape
    lk = k_LKD.shape[0]
    itemsize = 8 if q_LQD.dtype == torch.float64 else 4
    rows = max(1, TILE_BYTES // max(1, 3 * lk * hq * itemsize))   # scores, probabilities and a mask copy
    if lq <= rows:
        return _dense_attention_tile(q_LQD, k_LKD, v_LKD, scale, causal_offset, soft_cap, key_start_Lq)
    outs, lses = [], []
    for a in range(0, lq, rows):
        b = min(lq, a + rows)
        starts = None if key_start_Lq is None else key_start_Lq[a:b]
        if causal_offset is None:
            o, l = _dense_attention_tile(q_LQD[a:b], k_LKD, v_LKD, scale, None, soft_cap, starts)
        else:
            visible = max(0, min(lk, causal_offset + b))   # keys j <= c + i for the tile's last query
            o, l = _dense_attention_tile(q_LQD[a:b], k_LKD[:visible], v_LKD[:visible], scale, causal_offset + a,
                                         soft_cap, starts)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _dense_attention_tile(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, scale: float,
                          causal_offset: int | None, soft_cap: float | None,
                          key_start_Lq: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    lq, hq, d = q_LQD.shape
    lk, hk, _ = k_LKD.shape
    compute = torch.float64 if q_LQD.dtype == torch.float64 else torch.float32
    if lk == 0 or lq == 0:
        return (torch.zeros(lq, hq, d, dtype=q_LQD.dtype, device=q_LQD.device),
                torch.full((lq, hq), -math.inf, dtype=compute, device=q_LQD.device))
    g = hq // hk
    q = q_LQD.to(compute).view(lq, hk, g, d)
    scores = torch.einsum("qkgd,lkd->kgql", q, k_LKD.to(compute)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    qi = torch.arange(lq, device=q.device)[:, None]
    kj = torch.arange(lk, device=q.device)[None, :]
    if causal_offset is not None:
        scores = scores.masked_fill(kj > qi + causal_offset, -math.inf)
    if key_start_Lq is not None:
        scores = scores.masked_fill(kj < key_start_Lq.to(q.device)[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                                    # [K, G, Lq]
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None])
    out = torch.einsum("kgql,lkd->qkgd", probs, v_LKD.to(compute)).reshape(lq, hq, d)
    return out.to(q_LQD.dtype), lse.permute(2, 0, 1).reshape(lq, hq)


def ragged_causal_attention(q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                            pieces_P3: torch.Tensor, scale: float, window: int | None = None,
                            soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [qs, qe) attend causally to keys [ks, qe) for each piece (qs, qe, ks); see AttentionImpl.

    A piece's tokens are consecutive positions of one sequence, so a sliding window is relative here:
    query at step index i sees keys i - window < j <= i (and j >= ks). Keys outside every query's
    window are not read at all.
    """
    t, hq, d = q_TQD.shape
    compute = torch.float64 if q_TQD.dtype == torch.float64 else torch.float32
    out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
    lse = torch.full((t, hq), -math.inf, dtype=compute, device=q_TQD.device)
    for qs, qe, ks in pieces_P3.tolist():
        if qe <= qs:
            continue
        key_start = None
        if window is not None:
            k0 = max(ks, qs - window + 1)                      # nothing before it is in any query's window
            key_start = (torch.arange(qs, qe) - window + 1 - k0).clamp(min=0)
            ks = k0
        o, l = dense_attention(q_TQD[qs:qe], k_TKD[ks:qe], v_TKD[ks:qe], scale, causal_offset=qs - ks,
                               soft_cap=soft_cap, key_start_Lq=key_start)
        out[qs:qe], lse[qs:qe] = o, l
    return out, lse.float() if compute == torch.float32 else lse


def gather_request_kv(kv_cache_2NBKD: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                      first_key: int = 0, kv_scale_2NK: torch.Tensor | None = None,
                      compute: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, K, D] of one request's keys [first_key', seq_len), read page by page through its
    block-table row, where first_key' = first_key rounded down to its page start (pages before it are not
    read, so a sliding window reads only its own pages); the first returned key is local key first_key'.
    An fp8 cache (``kv_scale_2NK`` [2, scale pages, Hk] given) is dequantised to ``compute``, each page with
    its own scales.
    """
    _, _, block_size, hk, d = kv_cache_2NBKD.shape
    num_pages = (seq_len + block_size - 1) // block_size
    first_page = min(first_key // block_size, num_pages)
    pages = block_row[first_page:num_pages]
    if bool((pages < 0).any()):
        raise ValueError(f"block-table row has padding within its first {num_pages} pages: "
                         f"{block_row[:num_pages].tolist()}")
    n = seq_len - first_page * block_size
    if kv_scale_2NK is None:
        return kv_cache_2NBKD[0, pages].reshape(-1, hk, d)[:n], kv_cache_2NBKD[1, pages].reshape(-1, hk, d)[:n]
    per_scale_page = kv_cache_2NBKD.shape[1] // kv_scale_2NK.shape[1]      # kernel pages per scale page
    s = kv_scale_2NK.index_select(1, pages // per_scale_page)[:, :, None, :, None]   # [2, P, 1, Hk, 1]
    k = dequantize(kv_cache_2NBKD[0, pages], s[0], compute).reshape(-1, hk, d)[:n]
    v = dequantize(kv_cache_2NBKD[1, pages], s[1], compute).reshape(-1, hk, d)[:n]
    return k, v


@dataclass
class TorchAttentionMetadata(CommonAttentionMetadata):
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    """Requests reading the same first pages (forked sequences): attended as a cascade (attention/cascade.py)."""


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        md = common.to(self.spec.device)
        visible = md.seq_lens_cpu - md.query_lens_cpu if md.causal else md.context_lens_cpu
        block_size = self.spec.block_size
        prefixes = find_shared_prefixes(md.block_table_tensor, visible, block_size, min_keys=block_size)
        return TorchAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, shared_prefixes=prefixes)


class TorchAttentionImpl(AttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        md: CommonAttentionMetadata = attn_metadata
        fp8 = fp8_format_of(kv_cache.dtype) is not None
        if fp8 and kv_scale is None:
            raise InvalidRequestError(f"layer {layer}: the KV cache is {kv_cache.dtype}; pass its scales (kv_scale)")
        write_kv_cache(kv_cache, k_TKD, v_TKD, md.slot_mapping, kv_scale)
        t, hq, d = q_TQD.shape
        compute = torch.float64 if q_TQD.dtype == torch.float64 else torch.float32
        out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.full((t, hq), -math.inf, dtype=compute, device=q_TQD.device)
        qsl = md.query_start_loc_cpu.tolist()
        lens = md.seq_lens_cpu.tolist()
        key_start_T = md.window_key_start(self.spec.window(layer))
        block_size = kv_cache.shape[2]
        done = set()
        if key_start_T is None and getattr(md, "shared_prefixes", ()):   # windows read their own pages anyway
            done = cascade_forward(
                q_TQD, kv_cache, md.block_table_tensor, qsl, lens, md.causal, md.shared_prefixes,
                lambda row, n, first: gather_request_kv(kv_cache, row, n, first, kv_scale if fp8 else None, compute),
                lambda q, k, v, offset: dense_attention(q, k, v, self.spec.scale, offset, self.spec.soft_cap(layer)),
                out, lse)
        for r in range(md.num_reqs):
            qs, qe, seq_len = qsl[r], qsl[r + 1], lens[r]
            if qe == qs or seq_len == 0 or r in done:
                continue
            first = 0
            if key_start_T is not None:
                first = int(key_start_T[qs:qe].min())
                if first >= seq_len:
                    continue          # this rank holds none of these queries' window: empty partial, no kernel
            k, v = gather_request_kv(kv_cache, md.block_table_tensor[r], seq_len, first,
                                     kv_scale if fp8 else None, compute)
            offset_keys = (first // block_size) * block_size            # index of k[0] among the local keys
            starts = None if key_start_T is None else (key_start_T[qs:qe] - offset_keys).clamp(min=0)
            offset = seq_len - offset_keys - (qe - qs) if md.causal else None
            out[qs:qe], lse[qs:qe] = dense_attention(q_TQD[qs:qe], k, v, self.spec.scale, offset,
                                                     self.spec.soft_cap(layer), starts)
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
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")   # dequantised before float32/64 math
    supports_sliding_window = True
    supports_logits_soft_cap = True
    reads_shared_prefix_once = True   # cascade inside forward (attention/cascade.py): no split by the shard

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
