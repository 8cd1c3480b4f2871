"""The TRITON backend's paged causal prefill, with LSE.

One program per (query tile, query head); keys up to the tile's causal limit, full tiles unmasked and only the
diagonal tiles (and a sliding window's first tiles) masked. Also serves non-paged ragged K/V (PAGED=False) for
the causal part among a step's new tokens. Legend and shared tiles: triton_tiles.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpattn.attention.backends.triton_tiles import feature_args, kv_tile, online_softmax_tile


@triton.jit
def _masked_key_tiles(start, stop, q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kh, kv0,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div,
                      offs_n, offs_d, d_mask, hi, k_min, limit, kstart, scale_log2, cap_in, cap_out,
                      PS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, FP8: tl.constexpr,
                      SOFTCAP: tl.constexpr):
    """Key tiles [start, stop) whose keys rows see differently: each row's ``limit`` (causal diagonal, sequence
    end) and its window's first key ``kstart``; keys outside [k_min, hi) are not loaded."""
    for n in range(start, stop, BLOCK_N):
        pos = n + offs_n
        n_mask = (pos < hi) & (pos >= k_min)
        k, v, k_scale, v_scale = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, kv0,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         stride_sp, scale_div, offs_d, d_mask, PS, PAGED, True, FP8)
        visible = (pos[None, :] < limit[:, None]) & (pos[None, :] >= kstart[:, None])
        acc, m_i, l_i = online_softmax_tile(q, k, v, k_scale, v_scale, visible, acc, m_i, l_i,
                                            scale_log2, cap_in, cap_out, True, FP8, SOFTCAP)
    return acc, m_i, l_i


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
    acc, m_i, l_i = _masked_key_tiles(a0, b0, q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kh, kv0,
                                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp,
                                      scale_div, offs_n, offs_d, d_mask, hi, k_min, limit, kstart, scale_log2,
                                      cap_in, cap_out, PS, BLOCK_N, PAGED, FP8, SOFTCAP)
    # Full tiles: every row sees every key, no mask.
    for n in range(b0, lo, BLOCK_N):
        pos = n + offs_n
        k, v, k_scale, v_scale = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, pos >= 0, kh, kv0,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         stride_sp, scale_div, offs_d, d_mask, PS, PAGED, False, FP8)
        acc, m_i, l_i = online_softmax_tile(q, k, v, k_scale, v_scale, None, acc, m_i, l_i,
                                            scale_log2, cap_in, cap_out, False, FP8, SOFTCAP)
    # Boundary tiles: per-row limit (causal diagonal, sequence end), and the window's start.
    acc, m_i, l_i = _masked_key_tiles(lo, hi, q, acc, m_i, l_i, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kh, kv0,
                                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp,
                                      scale_div, offs_n, offs_d, d_mask, hi, k_min, limit, kstart, scale_log2,
                                      cap_in, cap_out, PS, BLOCK_N, PAGED, FP8, SOFTCAP)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + rows * stride_lt + h, lse, mask=m_mask)


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
    launch_args, flags = feature_args(kv_scale, soft_cap, scale, k.shape[0], req_seq)
    ks, vs, stride_sp, scale_div, *logit_args = launch_args
    block_m, block_n, warps, stages = prefill_block_sizes(d)
    _prefill_kernel[(num_tiles, hq)](
        q_TQD, k, v, bt, *tiles, req_seq, req_qlen, req_kv0, req_seq if key_start is None else key_start, ks, vs,
        out_TQD, lse_TQ, q_TQD.stride(0), q_TQD.stride(1), *kstr, *vstr, bt_stride, stride_sp, scale_div,
        out_TQD.stride(0), out_TQD.stride(1), lse_TQ.stride(0), *logit_args,
        G=hq // hk, D=d, PS=ps, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n,
        CAUSAL=causal, PAGED=paged, WINDOW=key_start is not None, num_warps=warps, num_stages=stages, **flags)
