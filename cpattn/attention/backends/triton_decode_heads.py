"""The TRITON paged decode with several kv heads per program: a speed candidate for fp8 caches (issue 22).

Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, PS tokens per page, H kv heads per program.

Why (the H200 numbers of 2026-12-01: bf16 1.00-1.04 ms at 1M keys, fp8 1.07, fp8 with f16 dots 0.97: fp8 reads half
the bytes in about the same time, so the fp8 kernel is bound per key tile, not per byte). triton_decode.py's program
holds one kv head: its tile is S = q [16 rows, G of them real] x K^T [D, BLOCK_N keys], a 2-D dot whose warps the
compiler lays along the keys (chained dots, M = 16 < N), so every tile pays cross-warp reductions (the row max and
sum go through shared memory with barriers) and a shared-memory round trip of P to the next dot's operand layout; a
tile's fixed cost is the same for 128 fp8 keys (32 KB) as for 128 bf16 keys (64 KB), so fp8 halves the bytes and not
the time. Here a program holds H kv heads and the tiles are 3-D, [H, rows | keys, D], through batched dots: Triton
puts all warps on the batch axis of a 3-D dot (warpsPerTileV2: rank 3 -> [num_warps, 1, 1]), so with num_warps = H
each warp owns one head: its softmax reductions stay within the warp (shuffles, no barrier) and P feeds the PV dot
from registers. Per tile of BLOCK_N keys the program reads H heads (H x the bytes of a one-head tile at the same
per-warp work), and the loads are the page's H heads as one contiguous run per token (H x D bytes; a whole
16-token page, 16 KB of fp8, when H = K), with one block-table entry per page for all H heads (not one per key and
head) and one [pages, H] vector of scales per tile. The split count grows H-fold so the grid keeps as many programs.

The conversion (counts for 1M keys x 8 heads x D 128, K and V: 2.1G fp8 values; H200 conversions ~16 per clock per SM,
~4.2T/s): fp8 -> bf16 is three cvt per two values (>= 0.75 ms: the goal, ~0.6 ms, is out of reach with bf16 dots),
fp8 -> f16 one (~0.25 ms), so the candidates mostly take f16 dots (F16_DOT, made range-safe by
triton_tiles.f16_query). An integer bit trick instead of cvt (idea (c) of issue 22) was weighed and not built: in
per-value Triton code it costs ~4-5 integer ops per value (64 per clock per SM), no cheaper than the f16 cvt; to bf16
it maps e4m3 onto 2^-120-scaled bf16 whose subnormals and products the dots may flush.

fp8 V scales: the probabilities are multiplied by each page's V scale over the tile's largest (a power of two <= 1)
and the PV dot's result by that largest scale in float32, so a cache whose V scales are all tiny or all huge keeps
f16 dots (F16_DOT) in range; only pages whose scale is 2^14 below their tile's largest lose low probability bits.

Plain decodes only (one query per program: a context pass's query groups keep triton_decode's kernel); windows start
their tiles on the window's first page and mask the keys before it (pages wholly before the window are not read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpattn.attention.backends.triton_tiles import f16_query


@triton.jit
def _heads_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, first, end, kh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div,
                offs_d, d_mask, PS: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """K, V [H, BLOCK_N, BLOCK_D] of keys [n, n + BLOCK_N) (n on a page), the key mask [BLOCK_N] (first <= key <
    end), and for fp8 K's page scales [H, BLOCK_N], V's scales over the tile's largest [H, BLOCK_N] and that largest
    [H] (ones otherwise)."""
    offs_p = tl.arange(0, BLOCK_N // PS)
    p_mask = n + offs_p * PS < end
    page_p = tl.load(bt_row + n // PS + offs_p, mask=p_mask, other=0).to(tl.int64)
    page = tl.reshape(tl.broadcast_to(page_p[:, None], (BLOCK_N // PS, PS)), (BLOCK_N,))
    pos = n + tl.arange(0, BLOCK_N)
    n_mask = (pos < end) & (pos >= first)
    within = (pos % PS).to(tl.int64)
    kv_mask = n_mask[None, :, None] & d_mask[None, None, :]
    k_rows = (page * stride_kb + within * stride_ks)[None, :, None] + (kh * stride_kh)[:, None, None]
    v_rows = (page * stride_vb + within * stride_vs)[None, :, None] + (kh * stride_vh)[:, None, None]
    k = tl.load(k_ptr + k_rows + offs_d[None, None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_rows + offs_d[None, None, :], mask=kv_mask, other=0.0)
    if FP8:
        srow = ((page_p // scale_div) * stride_sp)[None, :] + kh[:, None]                 # [H, NP]
        ks_p = tl.load(ks_ptr + srow, mask=p_mask[None, :], other=0.0)
        vs_p = tl.load(vs_ptr + srow, mask=p_mask[None, :], other=0.0)
        v_top = tl.max(vs_p, 1)
        v_rel = vs_p / tl.where(v_top > 0.0, v_top, 1.0)[:, None]     # exact: powers of two (or 0: unused pages)
        k_scale = tl.reshape(tl.broadcast_to(ks_p[:, :, None], (H, BLOCK_N // PS, PS)), (H, BLOCK_N))
        v_scale = tl.reshape(tl.broadcast_to(v_rel[:, :, None], (H, BLOCK_N // PS, PS)), (H, BLOCK_N))
    else:
        k_scale = tl.zeros((H, BLOCK_N), tl.float32) + 1.0
        v_scale = k_scale
        v_top = tl.zeros((H,), tl.float32) + 1.0
    return k, v, k_scale, v_scale, v_top, n_mask


@triton.jit
def _paged_decode_heads_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, tok_ptr, req_ptr, klen_ptr, kstart_ptr, ks_ptr, vs_ptr,
    out_ptr, lse_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_sp, scale_div,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    scale_log2, cap_in, cap_out,
    G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, H: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, F16_DOT: tl.constexpr,
):
    i = tl.program_id(0)
    kh = tl.program_id(1) * H + tl.arange(0, H)          # this program's kv heads
    s = tl.program_id(2)
    tok = tl.load(tok_ptr + i).to(tl.int64)
    req = tl.load(req_ptr + i).to(tl.int64)
    kv_len = tl.load(klen_ptr + i)
    if WINDOW:
        first = tl.load(kstart_ptr + i)
    else:
        first = 0
    # The splits cut [first's page start, kv_len) into whole tiles that start on pages (one block-table entry
    # and one scale row per page); a window's keys before ``first`` are masked, the pages before it never read.
    base = first - first % PS
    num_keys = tl.maximum(kv_len - base, 0)
    chunk = tl.cdiv(tl.cdiv(num_keys, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = base + s * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kh[:, None] * G + offs_g[None, :]                                              # [H, BLOCK_G]
    q_mask = g_mask[None, :, None] & d_mask[None, None, :]
    q = tl.load(q_ptr + tok * stride_qt + heads[:, :, None] * stride_qh + offs_d[None, None, :], mask=q_mask,
                other=0.0)
    if FP8 and F16_DOT:   # fp8 -> f16 is one cvt per two values, fp8 -> bf16 three; rows scaled into f16's range
        q, scale_log2, cap_in = f16_query(q, scale_log2, cap_in, 2)

    m_i = tl.full([H, BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([H, BLOCK_G], tl.float32)
    acc = tl.zeros([H, BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    for n in range(start, end, BLOCK_N):
        k, v, k_scale, v_scale, v_top, n_mask = _heads_tile(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, first, end, kh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sp, scale_div, offs_d, d_mask, PS, H, BLOCK_N, FP8)
        raw = tl.dot(q, tl.trans(k.to(q.dtype), (0, 2, 1)))                             # [H, BLOCK_G, BLOCK_N]
        if FP8:
            raw = raw * k_scale[:, None, :]
        if SOFTCAP:
            qk = (1.0 - 2.0 / (tl.exp2(raw * cap_in) + 1.0)) * cap_out
        else:
            qk = raw * scale_log2
        qk = tl.where(n_mask[None, None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a window may hide a whole tile
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        if FP8:
            p = p * v_scale[:, None, :]
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        if FP8:
            pv = pv * v_top[:, None, None]
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, :, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        row = tok
    else:
        row = i.to(tl.int64)
    o_rows = out_ptr + s * stride_os + row * stride_ot + heads[:, :, None] * stride_oh + offs_d[None, None, :]
    tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + s * stride_ls + row * stride_lt + heads, lse, mask=g_mask[None, :])


def heads_per_program(cfg: dict, num_kv_heads: int, page_size: int, block_n: int, queries: int) -> int:
    """H for this launch: the configuration's heads_per_program cut to a power of two dividing K; 0 (the one-head
    kernel) when it is off, for query groups, or when tiles cannot start on pages (PS not a power of two dividing
    the tile)."""
    want = int(cfg.get("heads_per_program", 0))
    if want <= 0 or queries != 1 or page_size & (page_size - 1) or block_n % page_size:
        return 0
    h = 1 << (min(want, num_kv_heads).bit_length() - 1)
    while num_kv_heads % h:
        h //= 2
    return h


def launch_heads(h: int, splits: int, grid_tokens: int, args_head: tuple, strides_in: tuple, logit_args: list,
                 out: torch.Tensor, lse: torch.Tensor, direct: bool, common: dict) -> None:
    """One launch of the H-heads kernel over (tokens, K / H, splits); ``out`` / ``lse`` the output rows (direct) or
    the split partials [S, T, Q, D] / [S, T, Q]. ``common``: triton_decode's constexprs and launch options."""
    hk = args_head[1].shape[2]
    opts = {k: common[k] for k in ("G", "D", "PS", "BLOCK_G", "BLOCK_D", "BLOCK_N", "WINDOW", "FP8", "SOFTCAP",
                                   "F16_DOT", "num_warps", "num_stages")}
    out_strides = (0, out.stride(0), out.stride(1)) if direct else (out.stride(0), out.stride(1), out.stride(2))
    lse_strides = (0, lse.stride(0)) if direct else (lse.stride(0), lse.stride(1))
    _paged_decode_heads_kernel[(grid_tokens, hk // h, splits)](
        *args_head, out, lse, *strides_in, *out_strides, *lse_strides, *logit_args, H=h, DIRECT=direct, **opts)
