"""Reference attention in plain torch: dense, ragged causal, and one request's K/V gathered from pages.

The math of the TORCH backend (backends/torch_ref.py) and the oracle every other backend is tested
against; natural-log LSE, float32 (float64 for float64 inputs). Clear rather than fast.
Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, L keys of one request.
"""

from __future__ import annotations

import math

import torch

from cpattn.kvstore.fp8 import dequantize


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


def ragged_causal_pieces(q_RQD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, pieces_P4: torch.Tensor,
                         scale: float, window: int | None = None,
                         soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces (q_start, q_end, k_start, k_end) whose queries and keys are rows of their own tensors (q's rows need
    not be k's: a rank's compact message): queries q[qs:qe] attend causally to keys k[ks:ke], aligned at the end
    (ke - ks >= qe - qs; query i sits at key ks + (ke - ks) - (qe - qs) + i). Returns the pieces' rows in order,
    out [sum of qe - qs, Q, D] and natural-log lse; a window is relative, as in ragged_causal_attention."""
    compute = torch.float64 if q_RQD.dtype == torch.float64 else torch.float32
    outs = [torch.zeros(0, *q_RQD.shape[1:], dtype=q_RQD.dtype, device=q_RQD.device)]
    lses = [torch.zeros(0, q_RQD.shape[1], dtype=compute, device=q_RQD.device)]
    for qs, qe, ks, ke in pieces_P4.tolist():
        lq, offset = qe - qs, (ke - ks) - (qe - qs)
        if lq <= 0:
            continue
        key_start, k0 = None, 0
        if window is not None:
            k0 = max(0, offset - window + 1)                   # nothing before it is in any query's window
            key_start = (torch.arange(lq) + offset - window + 1 - k0).clamp(min=0)
        o, l = dense_attention(q_RQD[qs:qe], k_SKD[ks + k0:ke], v_SKD[ks + k0:ke], scale, causal_offset=offset - k0,
                               soft_cap=soft_cap, key_start_Lq=key_start)
        outs.append(o)
        lses.append(l)
    lse = torch.cat(lses)
    return torch.cat(outs), lse.float() if compute == torch.float32 else lse


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
