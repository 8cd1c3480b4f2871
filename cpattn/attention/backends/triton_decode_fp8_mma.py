"""The TRITON paged decode of an fp8 e4m3 cache with fp8 tensor-core dots for q.K: a speed candidate of issue 22
(DECODE_CONFIG fp8_mma; off: measured slower, see below).

Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size, PS tokens per page, M the tile's rows.

Why it was tried: the other fp8 kernels convert every cached value to 16 bits before their dots (fp8 -> f16 one cvt per
two values, ~4.2T cvt/s on an H200), and their M = 16 tiles compile to mma.sync, which on SM90 has no fp8 form in
Triton: at 1M keys they read half of bf16's bytes in 0.81-0.84x its time. Here a program's tile has M = 64 rows (G of
them real), so Triton 3.6 emits SM90's wgmma with e4m3 operands (m64nNk32) for q.K^T, and K feeds it as stored.

Measured (2026-12-02, nvidia-h200, triton 3.6, benchmarks/fp8_mma_probe.py, B=1 over 1M keys, bf16 1.033 ms): correct
(rel 2.1e-2 vs float64, the fp8 cache's own error) but 1.33 ms at best (64-key tiles, 4 warps, 1 stage; 1.29x bf16, the
heads kernel's 0.855): the 64-row tiles' softmax and layout work cost more than the conversions they save. With the PV
dot in e4m3 too (P split in hi + lo, V as stored) Triton 3.6 compiled it, but its outputs were NaN or wrong (rel 1.4-2.2)
at every tiling, on the GPU only (the interpreter's were right): V is the PV dot's N-major B operand, which SM90's fp8
wgmma does not take; that path is not kept. So the PV dot here is in float16 (V converted, as the other kernels do).

Precision: q's rows are split in two e4m3 parts, hi + lo, each row first scaled by a power of two that puts its largest
|value| in [2^7, 2^8) (e4m3's largest is 448), and q.K^T is two dots summed in float32 (accumulators of one layout: the
sum is free); hi + lo holds bf16 queries exactly. The logit scales come back per row divided by that power of two
(exact), as triton_tiles.f16_query does for f16. P: each tile's probabilities against the tile's own row max (so in
[0, 1]), times V's page scale over the tile's largest (powers of two <= 1) and 2^8, in float16 for the PV dot; the
tile max's offset to the running max, that largest V scale and 2^-8 go on the dot's float32 result.

Tiles start on pages (PS a power of two dividing BLOCK_N: one block-table entry and one scale per page); a window's
keys before its first are masked, the pages wholly before it never read. Plain decodes only (one query per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpattn.attention.backends.triton_tiles import kv_tile_pages

E4M3 = torch.float8_e4m3fn
MMA_ROWS = 64           # wgmma's M per warpgroup: fewer rows compile to mma.sync through f16


@triton.jit
def _round_to_e4m3_bits(x):
    """float32 x rounded (half away from zero) to e4m3's 4 significant bits, in float32: exact in e4m3 when normal,
    so the split below does not depend on how a conversion rounds (Triton's interpreter: 125.5 -> 64)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x80000) & -0x100000).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_query(q, scale_log2, cap_in):
    """q's rows split in e4m3 hi + lo, each row scaled by a power of two so its largest |value| is in [2^7, 2^8); the
    logit scales per row ([M, 1]) divided by that power of two (exact). hi + lo is exact for bf16 values (hi keeps 4
    significant bits, the remainder at most 4 more), down to e4m3's normals (2^-6, here 2^-14 of the row's largest)."""
    amax = tl.max(tl.abs(q), 1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF                    # amax in [2^(e-127), 2^(e-126))
    up = tl.minimum(tl.maximum(261 - e, 1), 253)                           # 2^(134 - e): biased exponent, clamped
    grow = (up << 23).to(tl.float32, bitcast=True)
    undo = ((254 - up) << 23).to(tl.float32, bitcast=True)                 # 1 / grow, exactly
    x = q * grow[:, None]
    hi = _round_to_e4m3_bits(x)
    lo = _round_to_e4m3_bits(x - hi)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv), scale_log2 * undo[:, None], cap_in * undo[:, None]


@triton.jit
def _paged_decode_fp8_mma_kernel(
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
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    i = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    tok = tl.load(tok_ptr + i).to(tl.int64)
    req = tl.load(req_ptr + i).to(tl.int64)
    kv_len = tl.load(klen_ptr + i)
    if WINDOW:
        first = tl.load(kstart_ptr + i)
    else:
        first = 0
    base = first - first % PS            # tiles start on pages; the window's keys before ``first`` are masked
    num_keys = tl.maximum(kv_len - base, 0)
    chunk = tl.cdiv(tl.cdiv(num_keys, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = base + s * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_m < G
    d_mask = offs_d < D
    heads = kh * G + offs_m
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q_hi, q_lo, row_scale, row_cap = e4m3_query(q, scale_log2, cap_in)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    for n in range(start, end, BLOCK_N):
        # The page's keys before a window's first are read (tiles start on pages) and masked below
        k, v, k_scale, v_scale = kv_tile_pages(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, end, kh, stride_kb, stride_ks,
                                               stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div, offs_d,
                                               d_mask, PS, BLOCK_N, True)
        pos = n + tl.arange(0, BLOCK_N)
        n_mask = (pos < end) & (pos >= first)
        v_top = tl.max(v_scale, 0)
        v_scale = v_scale / tl.where(v_top > 0.0, v_top, 1.0)        # exact: powers of two (or 0: unused pages)
        k_t = tl.trans(k)
        raw = (tl.dot(q_hi, k_t) + tl.dot(q_lo, k_t)) * k_scale[None, :]
        if SOFTCAP:
            qk = (1.0 - 2.0 / (tl.exp2(raw * row_cap) + 1.0)) * cap_out
        else:
            qk = raw * row_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        t_max = tl.max(qk, 1)
        t_safe = tl.where(t_max == float("-inf"), 0.0, t_max)   # a window may hide a whole tile
        m_new = tl.maximum(m_i, t_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - t_safe[:, None])                        # [0, 1], 1 at the tile's own max
        alpha = tl.exp2(m_i - m_safe)
        lift = tl.exp2(t_safe - m_safe)                          # the tile's max against the running max
        l_i = l_i * alpha + tl.sum(p, 1) * lift
        # float16 PV (V the N-major B operand: SM90's e4m3 wgmma does not take it, see above)
        # (times 2^8 into float16: 8 more bits before a page far below its tile's largest V scale reaches subnormals)
        pv = tl.dot((p * (v_scale * 256.0)[None, :]).to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv * (lift * (v_top * 0.00390625))[:, None]
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        row = tok
    else:
        row = i.to(tl.int64)
    o_rows = out_ptr + s * stride_os + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + s * stride_ls + row * stride_lt + heads, lse, mask=g_mask)


def fp8_mma_serves(cfg: dict, k_cache: torch.Tensor, kv_scale, page_size: int, block_n: int, queries: int) -> bool:
    """Whether this launch takes the fp8-dot kernel: the configuration asks (fp8_mma), the cache is e4m3 with per-page
    scales, one query per program, and tiles can start on pages (PS a power of two dividing BLOCK_N; BLOCK_N >= 32, the
    shortest tiling compiled and measured)."""
    return (bool(cfg.get("fp8_mma")) and kv_scale is not None and k_cache.dtype == E4M3 and queries == 1
            and page_size & (page_size - 1) == 0 and block_n % page_size == 0 and block_n >= 32)


def launch_fp8_mma(splits: int, grid_tokens: int, args_head: tuple, strides_in: tuple, logit_args: list,
                   out: torch.Tensor, lse: torch.Tensor, direct: bool, common: dict) -> None:
    """One launch over (tokens, K, splits); ``out`` / ``lse`` the output rows (direct) or the split partials
    [S, T, Q, D] / [S, T, Q]. ``common``: triton_decode's constexprs and launch options."""
    hk = args_head[1].shape[2]
    opts = {k: common[k] for k in ("G", "D", "PS", "BLOCK_D", "BLOCK_N", "WINDOW", "SOFTCAP", "num_warps",
                                   "num_stages")}
    out_strides = (0, out.stride(0), out.stride(1)) if direct else (out.stride(0), out.stride(1), out.stride(2))
    lse_strides = (0, lse.stride(0)) if direct else (lse.stride(0), lse.stride(1))
    _paged_decode_fp8_mma_kernel[(grid_tokens, hk, splits)](
        *args_head, out, lse, *strides_in, *out_strides, *lse_strides, *logit_args,
        BLOCK_M=max(MMA_ROWS, triton.next_power_of_2(common["G"])), DIRECT=direct, **opts)
