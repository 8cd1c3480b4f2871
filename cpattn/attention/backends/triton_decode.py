"""The TRITON backend's paged split-KV decode (flash-decoding), with LSE.

One program per (token, kv head, split). A program holds all G query heads of its kv head as the rows of one
tile, so each K/V byte is read once per kv head, and the key range is cut into S splits so a single long
sequence still fills every SM. Partials [S, T, Q, D] are merged by LSE (``merge_triton``); with S = 1 the
kernel writes the output directly. Legend and shared tiles: triton_tiles.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpattn.attention.backends.cuda_decode_fp8 import fp8_cuda_unserved, heads_per_block, launch_fp8_cuda
from cpattn.attention.backends.triton_decode_fp8_mma import fp8_mma_serves, launch_fp8_mma
from cpattn.attention.backends.triton_decode_heads import heads_per_program, launch_heads
from cpattn.attention.backends.triton_tiles import (f16_query, feature_args, kv_tile, kv_tile_pages,
                                                    online_softmax_tile)


@triton.jit
def _decode_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, end, kh,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div,
                 offs_d, d_mask, PS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                 PAGE_TILES: tl.constexpr):
    """K, V, their scales and the key mask of the tile [n, n + BLOCK_N) (keys from ``end`` on masked)."""
    pos = n + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    if PAGE_TILES:
        k, v, k_scale, v_scale = kv_tile_pages(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, end, kh,
                                               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                               stride_sp, scale_div, offs_d, d_mask, PS, BLOCK_N, FP8)
    else:
        k, v, k_scale, v_scale = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, n_mask, kh, 0,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                         stride_sp, scale_div, offs_d, d_mask, PS, True, True, FP8)
    return k, v, k_scale, v_scale, n_mask


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
    DIRECT: tl.constexpr, WINDOW: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
    F16_DOT: tl.constexpr = False, NQ: tl.constexpr = 1, PAGE_TILES: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, V_SCALED: tl.constexpr = False,
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

    # Rows: NQ queries (consecutive token rows from ``tok``, a query group) x G heads of kv head kh, query-major.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < NQ * G
    d_mask = offs_d < D
    row_q = (offs_g // G).to(tl.int64)
    heads = kh * G + offs_g % G
    q = tl.load(q_ptr + (tok + row_q)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8 and F16_DOT:
        # The dots in float16: fp8 -> f16 is one instruction per pair on SM89+, fp8 -> bf16 three (the fp8 read
        # is bound by that conversion, benchmarks/RESULTS.md); q's rows scaled into float16's range (f16_query).
        q, scale_log2, cap_in = f16_query(q, scale_log2, cap_in, 1)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    if PREFETCH:
        # Software double buffering: the next tile's loads are issued before this tile's math (a loop-carried
        # copy in registers): a speed candidate in case the compiler's pipeliner does not overlap the gathered loads.
        k_nx, v_nx, ks_nx, vs_nx, m_nx = _decode_tile(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start, end, kh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_sp, scale_div, offs_d, d_mask, PS, BLOCK_N, FP8, PAGE_TILES)
        for n in range(start, end, BLOCK_N):
            k, v, k_scale, v_scale, n_mask = k_nx, v_nx, ks_nx, vs_nx, m_nx
            k_nx, v_nx, ks_nx, vs_nx, m_nx = _decode_tile(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n + BLOCK_N, end, kh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_sp, scale_div, offs_d, d_mask, PS, BLOCK_N, FP8, PAGE_TILES)
            acc, m_i, l_i = online_softmax_tile(q, k, v, k_scale, v_scale, n_mask[None, :], acc, m_i, l_i,
                                                scale_log2, cap_in, cap_out, True, FP8, SOFTCAP, V_SCALED)
    else:
        for n in range(start, end, BLOCK_N):
            k, v, k_scale, v_scale, n_mask = _decode_tile(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, n, end, kh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_sp, scale_div, offs_d, d_mask, PS, BLOCK_N, FP8, PAGE_TILES)
            acc, m_i, l_i = online_softmax_tile(q, k, v, k_scale, v_scale, n_mask[None, :], acc, m_i, l_i,
                                                scale_log2, cap_in, cap_out, True, FP8, SOFTCAP, V_SCALED)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    if DIRECT:
        row = tok + row_q
    else:   # partial row i * NQ + query: the group's queries in order
        row = i.to(tl.int64) * NQ + row_q
    o_rows = out_ptr + s * stride_os + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + s * stride_ls + row * stride_lt + heads, lse, mask=g_mask)


_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    """SMs of ``device``, asked of CUDA once per device (get_device_properties cost ~30 us per step's plan)."""
    device = torch.device(device)
    sms = _SMS.get(device)
    if sms is None:
        if device.type != "cuda":
            sms = 132          # TRITON_INTERPRET runs on the CPU: plan as for an H200
        else:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        _SMS[device] = sms
    return sms


# Launch configuration of the decode kernel: programs per SM to aim for when splitting KV, tile
# length, warps and pipeline stages (chosen on an H200, see benchmarks/RESULTS.md); fp8_f16_dot: an fp8 cache's
# dots in float16 instead of the activations' dtype; page_tiles: block-table entries and fp8 scales loaded once per
# page, not per key (tiles start on pages; not under windows); prefetch: the next tile's loads issued before this
# tile's math; split_factor: S times this at launch (the plan's S is chosen before the cache dtype is known);
# fp8_v_scaled: an fp8 V tile scaled and converted before the PV dot (online_softmax_tile's V_SCALED);
# heads_per_program: H > 0 runs triton_decode_heads.py's kernel (H kv heads per program, 3-D tiles, one warp per head
# when num_warps = H, S times H splits) for plain decodes; 0 this module's one-head kernel; fp8_mma: an e4m3 cache's
# plain decodes through triton_decode_fp8_mma.py's kernel (fp8 tensor-core q.K dots, K not converted; it takes
# precedence over heads_per_program; measured slower, off); fp8_cuda: an e4m3 cache's plain decodes through
# cuda_decode_fp8.py's CUDA kernel where it serves (precedence over both; cuda_stages: its tiles in flight per
# warp; cuda_heads_per_block: a kv head per warp; cuda_min_blocks: the blocks per SM its registers allow;
# cuda_v_swizzle: V's chunks key-major and swizzled in shared memory, so cp.async moves whole sectors);
# fill_splits: launch_splits doubles S where the plan's key floor per split left the GPU under half full.
DECODE_CONFIG = dict(waves=2, block_n=128, num_warps=4, num_stages=4, min_tiles=8, fp8_f16_dot=False,
                     page_tiles=False, prefetch=False, split_factor=1, fp8_v_scaled=False, heads_per_program=0,
                     fp8_mma=False, fp8_cuda=False, cuda_stages=2,
                     cuda_heads_per_block=False, cuda_min_blocks=2, cuda_v_swizzle=False,
                     fill_splits=False)

# What differs from DECODE_CONFIG per case ({}: today's configuration). The sweeps print the line to paste:
# benchmarks/triton_decode_sweep.py --fp8-sweep the "fp8" entry (an fp8 cache's decodes),
# benchmarks/prefix_pass_sweep.py the "query_groups" entry (a context pass's query groups: a shared prefix's pass,
# triton_query_groups.py).
# Adopted 2026-12-01 on nvidia-h200 (torch 2.11, triton 3.6): fp8 e4m3 at 1M keys 0.856 ms vs bf16 1.020 (0.84x; the
# one-head kernel's 1.130), B=64 32K 0.78x; a prefix pass's query groups 0.298 ms, 1.10x one decode over its pages.
# 2026-12-02 (same machine): fp8_cuda, an e4m3 cache's plain decodes on cuda_decode_fp8.py's kernel (the heads kernel
# still serves e5m2, windows and soft caps): 1M keys 0.782 ms vs bf16 1.005 (0.78x; the heads kernel 0.856), B=64 32K
# 1.503 vs 2.009 (0.75x). 2026-12-02 (session 15): cuda_v_swizzle 1M keys 0.551 ms vs bf16 1.018 (0.54x), B=64 32K
# 0.52x; fill_splits at 4,096 keys 0.0152 -> 0.0108 ms (benchmarks/RESULTS.md, session 15).
CONFIG_OVERRIDES = {
    "fp8": {"block_n": 64, "num_stages": 1, "fp8_f16_dot": True, "heads_per_program": 4, "fp8_cuda": True,
            "cuda_v_swizzle": True, "fill_splits": True},
    "query_groups": {"block_n": 64, "num_stages": 1, "page_tiles": True, "prefetch": True},
}


def decode_config(fp8: bool = False, query_groups: bool = False) -> dict:
    """DECODE_CONFIG with the case's overrides (query groups' over fp8's)."""
    cfg = dict(DECODE_CONFIG)
    if fp8:
        cfg.update(CONFIG_OVERRIDES["fp8"])
    if query_groups:
        cfg.update(CONFIG_OVERRIDES["query_groups"])
    return cfg


def decode_num_splits(num_tokens: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                      block_n: int | None = None, config: dict | None = None) -> int:
    """S: enough (token, kv head, split) programs to fill the GPU ``waves`` times, splits at least
    ``min_tiles`` tiles long so each amortizes its merge; a power of two, so a decode loop's S (and
    the CUDA graphs captured for it) changes only a few times as its sequences grow. ``config``: decode_config()'s
    (default DECODE_CONFIG)."""
    cfg = config or DECODE_CONFIG
    block_n = block_n or cfg["block_n"]
    target = cfg["waves"] * _num_sms(device)
    programs = max(1, num_tokens * num_kv_heads)
    max_splits = max(1, -(-max_kv_len // (cfg["min_tiles"] * block_n)))
    splits = max(1, min(-(-target // programs), max_splits, 256))
    return 1 << (splits.bit_length() - 1)


def launch_splits(splits: int, cfg: dict, programs: int = 0, device: torch.device | None = None) -> int:
    """The plan's S scaled by ``cfg``'s split_factor, a power of two in [1, 256]. ``cfg["fill_splits"]``: S doubled
    where the plan had several splits but its key floor per split (min_tiles) left fewer than half its target of
    (token, kv head, split) programs (``programs`` per split on ``device``); the CUDA fp8 kernel at 4,096 keys, B=1:
    32 blocks for 132 SMs, 0.018 -> 0.012 ms with twice the splits (benchmarks/RESULTS.md, session 14)."""
    scaled = max(1, min(256, int(splits * cfg.get("split_factor", 1))))
    if cfg.get("fill_splits") and scaled > 1 and programs and device is not None \
            and 2 * scaled * programs <= cfg["waves"] * _num_sms(device):
        scaled = min(256, 2 * scaled)
    return 1 << (scaled.bit_length() - 1)


def paged_decode(q_TQD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 tok_idx: torch.Tensor, req_idx: torch.Tensor, kv_lens: torch.Tensor, splits: int,
                 scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor, all_rows: bool = False,
                 key_start: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None,
                 soft_cap: float | None = None, queries: int = 1, into_rows: torch.Tensor | None = None) -> None:
    """Flash-decoding for the tokens ``tok_idx`` (each sees its first ``kv_lens`` keys of request
    ``req_idx``); writes rows ``tok_idx`` of ``out_TQD`` / ``lse_TQ`` (natural log).
    ``all_rows``: the rows written are 0 .. T-1 in order (a decode-only step; a query group covering the step).
    ``key_start`` (int32, one per decode): a sliding window's first visible key (keys before it are not read).
    ``kv_scale`` [2, scale pages, K] float32: an fp8 cache's per-page scales. ``soft_cap``: s -> cap tanh(s / cap).
    ``queries``: each ``tok_idx`` entry is the first of that many consecutive rows of one request that see the same
    keys (a context pass's query group, triton_query_groups.py): all their rows x G heads share each program.
    ``into_rows`` (int64, one per row written, queries included): the split partials merge into those rows of
    ``out_TQD`` / ``lse_TQ``, which hold another partial (a cascade's suffix pass), in the one merge launch."""
    from cpattn.attention.ops.lse import LseBase
    from cpattn.attention.merge_triton import merge_attn_states_triton, merge_into_rows_triton

    num_tok = tok_idx.numel()
    if num_tok == 0:
        return
    hq, d = q_TQD.shape[1], q_TQD.shape[2]
    _, ps, hk, _ = k_cache.shape
    g = hq // hk
    block_g = max(16, triton.next_power_of_2(queries * g))
    block_d = triton.next_power_of_2(d)
    cfg = decode_config(fp8=kv_scale is not None, query_groups=queries > 1)
    block_n = cfg["block_n"] if d <= 128 else min(cfg["block_n"], 32)
    cuda = kv_scale is not None and not fp8_cuda_unserved(cfg, q_TQD, k_cache, kv_scale, queries, key_start,
                                                          soft_cap, (block_table, tok_idx, req_idx, kv_lens))
    mma = not cuda and fp8_mma_serves(cfg, k_cache, kv_scale, ps, block_n, queries)
    heads = 0 if mma or cuda else heads_per_program(cfg, hk, ps, block_n, queries)
    # as many programs as the one-head grid's; a split's programs: a block per (token, kv heads of one block)
    per_block = heads_per_block(cfg, hk) if cuda else 1
    programs_per_split = max(1, num_tok * hk // (per_block * max(heads, 1)))
    splits = launch_splits(splits * max(heads, 1) * per_block, cfg, programs_per_split, q_TQD.device)
    page_tiles = (bool(cfg["page_tiles"]) and key_start is None and ps & (ps - 1) == 0 and block_n % ps == 0)
    grid = (num_tok, hk, splits)
    launch_args, flags = feature_args(kv_scale, soft_cap, scale, k_cache.shape[0], kv_lens)
    common = dict(G=g, D=d, PS=ps, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, WINDOW=key_start is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"] if d <= 128 else 2,
                  F16_DOT=bool(cfg["fp8_f16_dot"]), NQ=queries, PAGE_TILES=page_tiles, PREFETCH=bool(cfg["prefetch"]),
                  V_SCALED=bool(cfg["fp8_v_scaled"]), **flags)
    ks, vs, stride_sp, scale_div, *logit_args = launch_args
    args_head = (q_TQD, k_cache, v_cache, block_table, tok_idx, req_idx, kv_lens,
                 kv_lens if key_start is None else key_start, ks, vs)
    strides_in = (q_TQD.stride(0), q_TQD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), stride_sp, scale_div)
    if splits == 1 and into_rows is None:
        if cuda:
            launch_fp8_cuda(splits, num_tok, args_head, strides_in, logit_args, out_TQD, lse_TQ, True, cfg | common)
            return
        if mma:
            launch_fp8_mma(splits, num_tok, args_head, strides_in, logit_args, out_TQD, lse_TQ, True, common)
            return
        if heads:
            launch_heads(heads, splits, num_tok, args_head, strides_in, logit_args, out_TQD, lse_TQ, True, common)
            return
        _paged_decode_kernel[grid](*args_head, out_TQD, lse_TQ, *strides_in,
                                   0, out_TQD.stride(0), out_TQD.stride(1), 0, lse_TQ.stride(0),
                                   *logit_args, DIRECT=True, **common)
        return
    rows_out = num_tok * queries
    part_out = torch.empty(splits, rows_out, hq, d, dtype=torch.float32, device=q_TQD.device)
    part_lse = torch.empty(splits, rows_out, hq, dtype=torch.float32, device=q_TQD.device)
    if cuda:
        launch_fp8_cuda(splits, num_tok, args_head, strides_in, logit_args, part_out, part_lse, False, cfg | common)
    elif mma:
        launch_fp8_mma(splits, num_tok, args_head, strides_in, logit_args, part_out, part_lse, False, common)
    elif heads:
        launch_heads(heads, splits, num_tok, args_head, strides_in, logit_args, part_out, part_lse, False, common)
    else:
        _paged_decode_kernel[grid](*args_head, part_out, part_lse, *strides_in,
                                   part_out.stride(0), part_out.stride(1), part_out.stride(2),
                                   part_lse.stride(0), part_lse.stride(1),
                                   *logit_args, DIRECT=False, **common)
    if into_rows is not None:
        merge_into_rows_triton(part_out, part_lse, out_TQD, lse_TQ, into_rows, LseBase.E)
    elif all_rows:
        # The rows are 0 .. T-1 in order: the merge writes the output in place.
        merge_attn_states_triton(part_out, part_lse, LseBase.E, out=out_TQD, out_lse=lse_TQ)
    else:
        merged, merged_lse = merge_attn_states_triton(part_out, part_lse, LseBase.E, out_dtype=out_TQD.dtype)
        rows = tok_idx.long()
        if queries > 1:
            rows = (rows[:, None] + torch.arange(queries, device=rows.device)).flatten()
        out_TQD.index_copy_(0, rows, merged)
        lse_TQ.index_copy_(0, rows, merged_lse)
