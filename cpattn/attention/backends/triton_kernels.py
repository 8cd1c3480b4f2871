"""Triton kernels of the TRITON backend: paged split-KV decode and paged causal prefill, both with LSE.

Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, S KV splits, P pages of PS tokens.
Both kernels read K/V through a block table from the cache layout every backend shares,
[2, num_blocks, PS, K, D] (NHD pages), keep the softmax in base 2 (exp2 is the fast path) and
report the LSE in natural log (lse = (m + log2 l) * ln 2).

- Decode (flash-decoding): one program per (token, kv head, split). A program holds all G query
  heads of its kv head as the rows of one tile, so each K/V byte is read once per kv head, and the
  key range is cut into S splits so a single long sequence still fills every SM. Partials
  [S, T, Q, D] are merged by LSE (``merge_triton``); with S = 1 the kernel writes the output directly.
- Prefill: one program per (query tile, query head); keys up to the tile's causal limit, full tiles
  unmasked and only the diagonal tiles masked. Also serves non-paged ragged K/V (PAGED=False) for
  the causal part among a step's new tokens.

This module imports triton at import time: import it only where CUDA and triton exist.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


@triton.jit
def _kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, kv0,
             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div,
             offs_d, d_mask, PS: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr):
    """K and V rows of keys ``pos`` (in the dot's dtype only after the caller converts) and, for an fp8 cache,
    their pages' scales [BLOCK_N] (kernel page p uses scale row p // scale_div); ones otherwise (unused)."""
    if PAGED:
        if MASKED:
            page = tl.load(bt_row + pos // PS, mask=n_mask, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + pos // PS).to(tl.int64)
        within = (pos % PS).to(tl.int64)
        k_off = page * stride_kb + within * stride_ks
        v_off = page * stride_vb + within * stride_vs
    else:
        page = pos.to(tl.int64) * 0
        k_off = (kv0 + pos) * stride_ks
        v_off = (kv0 + pos) * stride_vs
    if MASKED:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_ptr + k_off[:, None] + kh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + kh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        srow = (page // scale_div) * stride_sp + kh
        k_scale = tl.load(ks_ptr + srow, mask=n_mask, other=0.0)
        v_scale = tl.load(vs_ptr + srow, mask=n_mask, other=0.0)
    else:
        k_scale = tl.zeros(pos.shape, tl.float32) + 1.0
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _online_softmax_tile(q, k, v, k_scale, v_scale, visible, acc, m_i, l_i, scale_log2, cap_in, cap_out,
                         MASKED: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, KEYS_A: tl.constexpr):
    """One key tile into the running (acc, m, l) of base-2 online softmax. fp8: K's page scale multiplies the
    dot's columns and V's the probabilities (the fp8 values convert to the dot's dtype exactly). Soft cap:
    the scaled logit s becomes cap * tanh(s / cap), tanh(y) = 1 - 2 / (exp(2y) + 1) (cap_in = 2 log2(e) * scale
    / cap, cap_out = cap * log2(e)). KEYS_A: ``q`` is passed transposed [D, G] and the keys are the dot's first
    operand, taken from registers right after their fp8 conversion (no transposed copy of the tile)."""
    if KEYS_A:
        raw = tl.trans(tl.dot(k.to(q.dtype), q))
    else:
        raw = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:
        raw = raw * k_scale[None, :]
    if SOFTCAP:
        qk = (1.0 - 2.0 / (tl.exp2(raw * cap_in) + 1.0)) * cap_out
    else:
        qk = raw * scale_log2
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row may see nothing in this tile
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, tok_ptr, req_ptr, klen_ptr, kstart_ptr, ks_ptr, vs_ptr,
    out_ptr, lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_sp, scale_div,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    scale_log2, cap_in, cap_out,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, KEYS_A: tl.constexpr,
):
    i = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    tok = tl.load(tok_ptr + i).to(tl.int64)
    req = tl.load(req_ptr + i).to(tl.int64)
    kv_len = tl.load(klen_ptr + i)
    # A sliding window: the token's first visible local key; the splits cut only [first, kv_len), so pages
    # wholly before the window are never read.
    if WINDOW:
        first = tl.load(kstart_ptr + i)
    else:
        first = 0
    num_keys = tl.maximum(kv_len - first, 0)
    # Each token cuts its own keys into the S splits (whole tiles): lengths stay on the device, so a
    # captured CUDA graph replays correctly as sequences grow, and short rows of a batch end early.
    chunk = tl.cdiv(tl.cdiv(num_keys, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = first + s * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kh * G + offs_g
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if KEYS_A:
        q = tl.trans(q)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        n_mask = pos < end
        k, v, k_scale, v_scale = _kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, 0,
                                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                          stride_sp, scale_div, offs_d, d_mask, PS, True, True, FP8)
        acc, m_i, l_i = _online_softmax_tile(q, k, v, k_scale, v_scale, n_mask[None, :], acc, m_i, l_i,
                                             scale_log2, cap_in, cap_out, True, FP8, SOFTCAP, KEYS_A)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    if DIRECT:
        o_rows = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        tl.store(lse_ptr + tok * stride_lt + heads, lse, mask=g_mask)
    else:
        o_rows = out_ptr + s * stride_os + i * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_rows, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(lse_ptr + s * stride_ls + i * stride_lt + heads, lse, mask=g_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr,
    tile_req_ptr, tile_q0_ptr, tile_m_ptr, tile_j0_ptr,
    req_seq_ptr, req_qlen_ptr, req_kv0_ptr, kstart_ptr, ks_ptr, vs_ptr,
    out_ptr, lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_sp, scale_div,
    stride_ot, stride_oh, stride_lt,
    scale_log2, cap_in, cap_out,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Tile ``tid`` holds query tokens [q0, q0 + m) of request ``req``, its j0-th .. query.

    Query j of a request with ``seq`` keys and ``qlen`` queries sees keys [0, seq - qlen + j] when
    CAUSAL, else all ``seq``; with WINDOW only keys >= kstart[row] of those (row = the query's token index,
    keys counted like ``seq``). PAGED=False reads keys at rows kv0 + n of a [T, K, D] tensor.
    """
    tid = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    req = tl.load(tile_req_ptr + tid).to(tl.int64)
    q0 = tl.load(tile_q0_ptr + tid).to(tl.int64)
    m_count = tl.load(tile_m_ptr + tid)
    j0 = tl.load(tile_j0_ptr + tid)
    seq = tl.load(req_seq_ptr + req)
    qlen = tl.load(req_qlen_ptr + req)
    kv0 = tl.load(req_kv0_ptr + req).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < m_count
    d_mask = offs_d < D
    rows = q0 + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    if CAUSAL:
        limit = seq - qlen + j0 + offs_m + 1          # keys visible to each row
        hi = tl.minimum(seq - qlen + j0 + m_count, seq)
        lo = tl.maximum(seq - qlen + j0 + 1, 0)       # every row sees [0, lo)
    else:
        limit = tl.zeros([BLOCK_M], tl.int32) + seq
        hi = seq
        lo = seq
    lo = (lo // BLOCK_N) * BLOCK_N
    if WINDOW:
        # Rows see keys [kstart[row], limit[row]); tiles before the tile's smallest kstart are skipped, tiles
        # between its largest kstart and lo need no mask, the rest are masked.
        kstart = tl.load(kstart_ptr + rows, mask=m_mask, other=0)
        k_min = tl.min(tl.where(m_mask, kstart, 2147483647))
        b0 = tl.minimum(tl.cdiv(tl.max(tl.where(m_mask, kstart, 0)), BLOCK_N) * BLOCK_N, lo)
        a0 = tl.minimum((k_min // BLOCK_N) * BLOCK_N, b0)
    else:
        kstart = tl.zeros([BLOCK_M], tl.int32)
        k_min = 0
        a0 = 0
        b0 = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    # Window start tiles: per-row lower bound; keys before every row's window are not even loaded.
    for n in range(a0, b0, BLOCK_N):
        pos = n + offs_n
        n_mask = (pos < hi) & (pos >= k_min)
        k, v, k_scale, v_scale = _kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, kv0,
                                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                          stride_sp, scale_div, offs_d, d_mask, PS, PAGED, True, FP8)
        visible = (pos[None, :] < limit[:, None]) & (pos[None, :] >= kstart[:, None])
        acc, m_i, l_i = _online_softmax_tile(q, k, v, k_scale, v_scale, visible, acc, m_i, l_i,
                                             scale_log2, cap_in, cap_out, True, FP8, SOFTCAP, False)
    # Full tiles: every row sees every key, no mask.
    for n in range(b0, lo, BLOCK_N):
        pos = n + offs_n
        k, v, k_scale, v_scale = _kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, pos >= 0, kh, kv0,
                                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                          stride_sp, scale_div, offs_d, d_mask, PS, PAGED, False, FP8)
        acc, m_i, l_i = _online_softmax_tile(q, k, v, k_scale, v_scale, None, acc, m_i, l_i,
                                             scale_log2, cap_in, cap_out, False, FP8, SOFTCAP, False)
    # Boundary tiles: per-row limit (causal diagonal, sequence end), and the window's start.
    for n in range(lo, hi, BLOCK_N):
        pos = n + offs_n
        n_mask = (pos < hi) & (pos >= k_min)
        k, v, k_scale, v_scale = _kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, kv0,
                                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                          stride_sp, scale_div, offs_d, d_mask, PS, PAGED, True, FP8)
        visible = (pos[None, :] < limit[:, None]) & (pos[None, :] >= kstart[:, None])
        acc, m_i, l_i = _online_softmax_tile(q, k, v, k_scale, v_scale, visible, acc, m_i, l_i,
                                             scale_log2, cap_in, cap_out, True, FP8, SOFTCAP, False)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + rows * stride_lt + h, lse, mask=m_mask)


def _num_sms(device: torch.device) -> int:
    if torch.device(device).type != "cuda":
        return 132          # TRITON_INTERPRET runs on the CPU: plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


# Launch configuration of the decode kernel: programs per SM to aim for when splitting KV, tile
# length, warps and pipeline stages (chosen on an H200, see benchmarks/RESULTS.md).
DECODE_CONFIG = dict(waves=2, block_n=128, num_warps=4, num_stages=4, min_tiles=8)
# An fp8 cache's tiles: what differs from DECODE_CONFIG (keys_a: the keys as the dot's first operand, see
# _online_softmax_tile; measured with benchmarks/triton_fp8_sweep.py).
DECODE_CONFIG_FP8 = dict(keys_a=False)


def decode_num_splits(num_tokens: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                      block_n: int | None = None) -> int:
    """S: enough (token, kv head, split) programs to fill the GPU ``waves`` times, splits at least
    ``min_tiles`` tiles long so each amortizes its merge; a power of two, so a decode loop's S (and
    the CUDA graphs captured for it) changes only a few times as its sequences grow."""
    block_n = block_n or DECODE_CONFIG["block_n"]
    target = DECODE_CONFIG["waves"] * _num_sms(device)
    programs = max(1, num_tokens * num_kv_heads)
    max_splits = max(1, -(-max_kv_len // (DECODE_CONFIG["min_tiles"] * block_n)))
    splits = max(1, min(-(-target // programs), max_splits, 256))
    return 1 << (splits.bit_length() - 1)


def _feature_args(kv_scale: torch.Tensor | None, soft_cap: float | None, scale: float, num_kernel_pages: int,
                  fallback: torch.Tensor) -> tuple[tuple, dict]:
    """(ks, vs, stride_sp, scale_div) and (scale_log2, cap_in, cap_out) plus the FP8 / SOFTCAP flags."""
    if kv_scale is None:
        scales = (fallback, fallback, 0, 1)
    else:
        if num_kernel_pages % kv_scale.shape[1]:
            raise ValueError(f"{num_kernel_pages} kernel pages are not a multiple of {kv_scale.shape[1]} scale pages")
        scales = (kv_scale[0], kv_scale[1], kv_scale.stride(1), num_kernel_pages // kv_scale.shape[1])
    cap = (0.0, 0.0) if soft_cap is None else (2.0 * LOG2E * scale / soft_cap, soft_cap * LOG2E)
    return scales + (scale * LOG2E,) + cap, dict(FP8=kv_scale is not None, SOFTCAP=soft_cap is not None)


def paged_decode(q_TQD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 tok_idx: torch.Tensor, req_idx: torch.Tensor, kv_lens: torch.Tensor, splits: int,
                 scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor, all_rows: bool = False,
                 key_start: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None,
                 soft_cap: float | None = None) -> None:
    """Flash-decoding for the tokens ``tok_idx`` (each sees its first ``kv_lens`` keys of request
    ``req_idx``); writes rows ``tok_idx`` of ``out_TQD`` / ``lse_TQ`` (natural log).
    ``all_rows``: tok_idx is 0 .. T-1 in order (a decode-only step).
    ``key_start`` (int32, one per decode): a sliding window's first visible key (keys before it are not read).
    ``kv_scale`` [2, scale pages, K] float32: an fp8 cache's per-page scales. ``soft_cap``: s -> cap tanh(s / cap)."""
    from cpattn.attention.ops.lse import LseBase
    from cpattn.attention.merge_triton import merge_attn_states_triton

    num_tok = tok_idx.numel()
    if num_tok == 0:
        return
    hq, d = q_TQD.shape[1], q_TQD.shape[2]
    _, ps, hk, _ = k_cache.shape
    g = hq // hk
    block_g = max(16, triton.next_power_of_2(g))
    block_d = triton.next_power_of_2(d)
    cfg = {**DECODE_CONFIG, "keys_a": False, **(DECODE_CONFIG_FP8 if kv_scale is not None else {})}
    block_n = cfg["block_n"] if d <= 128 else min(cfg["block_n"], 32)
    grid = (num_tok, hk, splits)
    feature_args, flags = _feature_args(kv_scale, soft_cap, scale, k_cache.shape[0], kv_lens)
    common = dict(G=g, D=d, PS=ps, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, WINDOW=key_start is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"] if d <= 128 else 2,
                  KEYS_A=cfg["keys_a"], **flags)
    ks, vs, stride_sp, scale_div, *logit_args = feature_args
    args_head = (q_TQD, k_cache, v_cache, block_table, tok_idx, req_idx, kv_lens,
                 kv_lens if key_start is None else key_start, ks, vs)
    strides_in = (q_TQD.stride(0), q_TQD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), stride_sp, scale_div)
    if splits == 1:
        _paged_decode_kernel[grid](*args_head, out_TQD, lse_TQ, *strides_in,
                                   0, out_TQD.stride(0), out_TQD.stride(1), 0, lse_TQ.stride(0),
                                   *logit_args, DIRECT=True, **common)
        return
    part_out = torch.empty(splits, num_tok, hq, d, dtype=torch.float32, device=q_TQD.device)
    part_lse = torch.empty(splits, num_tok, hq, dtype=torch.float32, device=q_TQD.device)
    _paged_decode_kernel[grid](*args_head, part_out, part_lse, *strides_in,
                               part_out.stride(0), part_out.stride(1), part_out.stride(2),
                               part_lse.stride(0), part_lse.stride(1),
                               *logit_args, DIRECT=False, **common)
    if all_rows:
        # Every token is a decode, in order: the merge writes the output in place.
        merge_attn_states_triton(part_out, part_lse, LseBase.E, out=out_TQD, out_lse=lse_TQ)
    else:
        merged, merged_lse = merge_attn_states_triton(part_out, part_lse, LseBase.E, out_dtype=out_TQD.dtype)
        rows = tok_idx.long()
        out_TQD.index_copy_(0, rows, merged)
        lse_TQ.index_copy_(0, rows, merged_lse)


def prefill_block_sizes(head_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by head size (shared memory bound)."""
    if head_size <= 64:
        return 128, 64, 4, 3
    if head_size <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def make_prefill_tiles(req_ids: list[int], q_starts: list[int], q_lens: list[int], block_m: int,
                       device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tiles (request, first token, rows, first query index) for the prefill kernel; the heaviest
    (last, longest-causal) tiles first so the tail of the grid is short."""
    tiles = []
    for r, qs, ql in zip(req_ids, q_starts, q_lens):
        for j0 in range(0, ql, block_m):
            tiles.append((r, qs + j0, min(block_m, ql - j0), j0))
    tiles.sort(key=lambda t: -t[3])
    if not tiles:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return empty, empty, empty, empty
    cols = torch.tensor(tiles, dtype=torch.int64).t().contiguous()
    return tuple(cols[i].to(torch.int32).to(device, non_blocking=True) for i in range(4))


def prefill(q_TQD: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None,
            tiles: tuple[torch.Tensor, ...], req_seq: torch.Tensor, req_qlen: torch.Tensor, req_kv0: torch.Tensor,
            causal: bool, scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor,
            key_start: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None,
            soft_cap: float | None = None) -> None:
    """Tiled attention for the tokens the ``tiles`` cover. Paged when ``block_table`` is given
    (k, v: [P, PS, K, D] caches), else ragged (k, v: [T, K, D], request r's keys start at req_kv0[r]).
    ``key_start`` (int32 [T], by token row): a sliding window's first visible key of each query, counted like
    the request's keys (tiles wholly before it are not read); ``kv_scale`` [2, scale pages, K]: an fp8 paged
    cache's per-page scales; ``soft_cap``: s -> cap tanh(s / cap)."""
    num_tiles = tiles[0].numel()
    if num_tiles == 0:
        return
    hq, d = q_TQD.shape[1], q_TQD.shape[2]
    paged = block_table is not None
    if paged:
        _, ps, hk, _ = k.shape
        kstr = (k.stride(0), k.stride(1), k.stride(2))
        vstr = (v.stride(0), v.stride(1), v.stride(2))
        bt, bt_stride = block_table, block_table.stride(0)
    else:
        ps, hk = 1, k.shape[1]
        kstr = (0, k.stride(0), k.stride(1))
        vstr = (0, v.stride(0), v.stride(1))
        bt, bt_stride = req_kv0, 0
        if kv_scale is not None:
            raise ValueError("fp8 scales apply to a paged cache only")
    feature_args, flags = _feature_args(kv_scale, soft_cap, scale, k.shape[0], req_seq)
    ks, vs, stride_sp, scale_div, *logit_args = feature_args
    block_m, block_n, warps, stages = prefill_block_sizes(d)
    _prefill_kernel[(num_tiles, hq)](
        q_TQD, k, v, bt, *tiles, req_seq, req_qlen, req_kv0, req_seq if key_start is None else key_start, ks, vs,
        out_TQD, lse_TQ, q_TQD.stride(0), q_TQD.stride(1), *kstr, *vstr, bt_stride, stride_sp, scale_div,
        out_TQD.stride(0), out_TQD.stride(1), lse_TQ.stride(0), *logit_args,
        G=hq // hk, D=d, PS=ps, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n,
        CAUSAL=causal, PAGED=paged, WINDOW=key_start is not None, num_warps=warps, num_stages=stages, **flags)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, stride_kt, stride_vt, stride_ct,
                     stride_sp, page_tokens, fmax,
                     ROW: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        if FP8:
            # x / its page's scale (per kv head), saturating at the format's largest value; scale 0 stores 0
            # (kvstore.fp8.quantize, the same rule).
            srow = (slot // page_tokens) * stride_sp + offs // D
            k_scale = tl.load(ks_ptr + srow, mask=mask, other=0.0)
            v_scale = tl.load(vs_ptr + srow, mask=mask, other=0.0)
            k = tl.where(k_scale > 0, k.to(tl.float32) / tl.where(k_scale > 0, k_scale, 1.0), 0.0)
            v = tl.where(v_scale > 0, v.to(tl.float32) / tl.where(v_scale > 0, v_scale, 1.0), 0.0)
            # NaN stays NaN (the hardware max/min would turn it into a bound); rounding to nearest even, as torch.
            k = tl.where(k != k, k, tl.minimum(tl.maximum(k, -fmax), fmax))
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -fmax), fmax))
            k = k.to(kc_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            v = v.to(vc_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(kc_ptr + slot * stride_ct + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * stride_ct + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(kv_cache_2NBKD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                   slot_mapping_T: torch.Tensor, kv_scale_2NK: torch.Tensor | None = None) -> None:
    """``backend.write_kv_cache`` without the host sync: slots < 0 are skipped inside the kernel. An fp8 cache
    (``kv_scale_2NK`` [2, scale pages, K], already grown for these values) is quantised in the kernel."""
    t = slot_mapping_T.numel()
    if t == 0:
        return
    _, nb, ps, hk, d = kv_cache_2NBKD.shape
    k = k_TKD.reshape(t, hk * d)
    v = v_TKD.reshape(t, hk * d)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    flat = kv_cache_2NBKD.view(2, nb * ps, hk * d)
    row = hk * d
    block = min(1024, triton.next_power_of_2(row))
    if kv_scale_2NK is None:
        scales = (slot_mapping_T, slot_mapping_T, 0, 1, 0.0)
    else:
        page_tokens = ps * (nb // kv_scale_2NK.shape[1])          # a kernel view's pages share a scale page
        scales = (kv_scale_2NK[0], kv_scale_2NK[1], kv_scale_2NK.stride(1), page_tokens,
                  torch.finfo(kv_cache_2NBKD.dtype).max)
    ks, vs, stride_sp, page_tokens, fmax = scales
    _write_kv_kernel[(t, triton.cdiv(row, block))](k, v, slot_mapping_T, flat[0], flat[1], ks, vs, k.stride(0),
                                                   v.stride(0), flat.stride(1), stride_sp, page_tokens, fmax,
                                                   ROW=row, D=d, BLOCK=block, FP8=kv_scale_2NK is not None)
