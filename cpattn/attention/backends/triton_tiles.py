"""What the TRITON backend's attention kernels share (cpattn/attention/backends/triton_decode.py, triton_prefill.py):
reading a tile of K/V through a block table, one key tile into a base-2 online softmax, and the launch
arguments of the window / soft cap / fp8 features.

Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, P pages of PS tokens.
Both kernels read K/V from the cache layout every backend shares, [2, num_blocks, PS, K, D] (NHD pages), keep
the softmax in base 2 (exp2 is the fast path) and report the LSE in natural log (lse = (m + log2 l) * ln 2).

These modules import triton at import time: import them only where CUDA (or Triton's interpreter) and triton exist.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


@triton.jit
def kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, kv0,
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
def kv_tile_pages(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, end, kh,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div,
                  offs_d, d_mask, PS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """kv_tile for keys [n, n + BLOCK_N) of a paged cache, masked at ``end``, for a tile that starts on a page
    (n % PS == 0, BLOCK_N % PS == 0, PS a power of two): one block-table entry and, for fp8, one K and one V scale
    per page, broadcast to its PS keys, instead of a gather per key (a 128-key tile of 16-token pages: 8 loads,
    not 128, for each of the three)."""
    offs_p = tl.arange(0, BLOCK_N // PS)
    p_mask = n + offs_p * PS < end
    page_p = tl.load(bt_row + n // PS + offs_p, mask=p_mask, other=0).to(tl.int64)
    page = tl.reshape(tl.broadcast_to(page_p[:, None], (BLOCK_N // PS, PS)), (BLOCK_N,))
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = n + offs_n < end
    within = (offs_n % PS).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_off = page * stride_kb + within * stride_ks
    v_off = page * stride_vb + within * stride_vs
    k = tl.load(k_ptr + k_off[:, None] + kh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + kh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        srow = (page_p // scale_div) * stride_sp + kh
        ks_p = tl.load(ks_ptr + srow, mask=p_mask, other=0.0)
        vs_p = tl.load(vs_ptr + srow, mask=p_mask, other=0.0)
        k_scale = tl.reshape(tl.broadcast_to(ks_p[:, None], (BLOCK_N // PS, PS)), (BLOCK_N,))
        v_scale = tl.reshape(tl.broadcast_to(vs_p[:, None], (BLOCK_N // PS, PS)), (BLOCK_N,))
    else:
        k_scale = tl.zeros(offs_n.shape, tl.float32) + 1.0
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def online_softmax_tile(q, k, v, k_scale, v_scale, visible, acc, m_i, l_i, scale_log2, cap_in, cap_out,
                        MASKED: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, V_SCALED: tl.constexpr = False):
    """One key tile into the running (acc, m, l) of base-2 online softmax. fp8: K's page scale multiplies the
    dot's columns and V's the probabilities (the fp8 values convert to the dot's dtype exactly). Soft cap:
    the scaled logit s becomes cap * tanh(s / cap), tanh(y) = 1 - 2 / (exp(2y) + 1) (cap_in = 2 log2(e) * scale
    / cap, cap_out = cap * log2(e)). V_SCALED (fp8): V's rows times their scales in float32, then the dot's dtype
    (exact: the scales are powers of two), instead of the probabilities' columns: a speed candidate (the sweep
    decides) that converts the fp8 V tile before the dot, so the transposed operand may be a 16-bit one (ldmatrix.trans
    has no 8-bit form)."""
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
    v_top = 1.0
    if FP8 and q.dtype == tl.float16:
        # float16 dots (F16_DOT, float16 models): V's scales over the tile's largest (powers of two <= 1), that
        # largest applied to the PV dot's float32 result: p * scale alone leaves float16's range for small page scales
        # (p * 2^-20 underflows; tests/test_triton_decode_heads_interpret.py's far-apart scales).
        v_top = tl.max(v_scale, 0)
        v_scale = v_scale / tl.where(v_top > 0.0, v_top, 1.0)
    if FP8 and V_SCALED:
        v_dot = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    else:
        v_dot = v.to(q.dtype)
        if FP8:
            p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v_dot) * v_top
    return acc, m_new, l_i


@triton.jit
def f16_query(q, scale_log2, cap_in, AXIS: tl.constexpr):
    """q in float16 for an fp8 cache's float16 dots (F16_DOT) and the logit scales that undo its row scaling.

    Each row (D along ``AXIS``) is multiplied by a power of two that puts its largest |value| in [2^13, 2^14), so
    float16 holds any finite bf16 query (bf16's 7 mantissa bits fit float16's 10; only entries 2^38 below their row's
    largest reach float16's subnormals); scale_log2 and cap_in come back per row ([rows, 1]) divided by the same power
    of two, so the logits are unchanged (both exact: powers of two). Without it a row beyond 65504 would overflow."""
    amax = tl.max(tl.abs(q.to(tl.float32)), AXIS)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF                    # amax in [2^(e-127), 2^(e-126))
    up = tl.minimum(tl.maximum(267 - e, 1), 253)                           # 2^(140 - e): biased exponent, clamped
    grow = (up << 23).to(tl.float32, bitcast=True)
    undo = ((254 - up) << 23).to(tl.float32, bitcast=True)                 # 1 / grow, exactly
    q16 = (q.to(tl.float32) * tl.expand_dims(grow, AXIS)).to(tl.float16)
    return q16, scale_log2 * tl.expand_dims(undo, AXIS), cap_in * tl.expand_dims(undo, AXIS)


def feature_args(kv_scale: torch.Tensor | None, soft_cap: float | None, scale: float, num_kernel_pages: int,
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
