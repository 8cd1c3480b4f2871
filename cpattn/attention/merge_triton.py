"""GPU merge of partial attention states: one Triton kernel, base-aware, -inf safe, correction fused.

Legend: N partials, T tokens, H heads, D head size.
Same contract and math as ``ops.merge.merge_attn_states`` (the CPU path and the oracle):
    l_n in natural log (base-2 LSEs scaled by ln 2 inside the kernel), m = max_n l_n,
    w_n = exp(l_n - m), o = sum_n w_n o_n / sum_n w_n, l = m + log(sum_n w_n).
Each program owns one token and a block of heads: a first pass over N finds m, a second
accumulates the weighted outputs in float32 and writes o and l once, so every input byte is read
once and every output byte written once. Partials with l_n = -inf are skipped (their outputs may
hold garbage); rows where every l_n = -inf give o = 0, l = -inf. ``merge_into_rows_triton``: the result rows
are given by an index and already hold one more partial, merged in place (a cascade's prefix into its suffix).

Callers use ``ops.merge.merge_partials`` / ``merge_into_rows`` (this kernel for CUDA 16/32-bit tensors, torch
otherwise); this module imports only from the ops floor (and errors), so the floor may call it.
"""

from __future__ import annotations

import torch

from cpattn.attention.ops.lse import LseBase, check_lse_base
from cpattn.attention.ops.partials import stack_partials
from cpattn.errors import InvalidRequestError

_kernel = None


def _get_kernel():
    """Build the kernel on first use, so importing this module needs no triton."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_kernel(out_ptr, lse_ptr, res_ptr, res_lse_ptr, rows_ptr, N, H,
                      stride_on, stride_ot, stride_oh, stride_ln, stride_lt,
                      stride_rt, stride_rh, stride_rlt,
                      to_natural, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      UNROLL: tl.constexpr, INTO: tl.constexpr = False):
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < H
        hd_mask = h_mask[:, None] & (offs_d[None, :] < D)
        if INTO:   # partial row t merges into result row rows[t]
            r = tl.load(rows_ptr + t).to(tl.int64)
        else:
            r = t
        res_rows = res_ptr + r * stride_rt + offs_h[:, None] * stride_rh + offs_d[None, :]
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if INTO:
            # One more partial, natural log, already in the result's row (the suffix pass's): the merge starts
            # from it (weight 1 at its own max), read before this program overwrites the row.
            m = tl.load(res_lse_ptr + r * stride_rlt + offs_h, mask=h_mask, other=float("-inf")).to(tl.float32)
            total = tl.where(m > float("-inf"), 1.0, 0.0)
            acc = tl.load(res_rows, mask=hd_mask & (m[:, None] > float("-inf")), other=0.0).to(tl.float32)
        if UNROLL > 0:
            # Few partials (the DCP merge): unrolled, so all N loads are in flight at once; one
            # pass with the online rescale (acc and total follow the running max).
            for n in tl.static_range(UNROLL):
                l = tl.load(lse_ptr + n * stride_ln + t * stride_lt + offs_h, mask=h_mask,
                            other=float("-inf")).to(tl.float32) * to_natural
                o = tl.load(out_ptr + n * stride_on + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                            mask=hd_mask & (l[:, None] > float("-inf")), other=0.0)
                m_new = tl.maximum(m, l)
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_new_safe)                  # 0 while m = -inf
                w = tl.exp(l - m_new_safe)                      # 0 for an empty partial
                total = total * alpha + w
                acc = acc * alpha[:, None] + o.to(tl.float32) * w[:, None]
                m = m_new
            empty = m == float("-inf")
            m_safe = tl.where(empty, 0.0, m)
        else:
            # Many partials (split-KV decode): max first, then one weighted pass.
            m_into = m
            for n in range(N):
                l = tl.load(lse_ptr + n * stride_ln + t * stride_lt + offs_h, mask=h_mask, other=float("-inf"))
                m = tl.maximum(m, l.to(tl.float32) * to_natural)
            empty = m == float("-inf")
            m_safe = tl.where(empty, 0.0, m)
            w_into = tl.exp(m_into - m_safe)                    # 1 at m_into = m; 0 without INTO
            total = total * w_into
            acc = acc * w_into[:, None]
            for n in range(N):
                l = tl.load(lse_ptr + n * stride_ln + t * stride_lt + offs_h, mask=h_mask, other=float("-inf"))
                w = tl.exp(l.to(tl.float32) * to_natural - m_safe)      # -inf -> 0
                o = tl.load(out_ptr + n * stride_on + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                            mask=hd_mask & (w[:, None] > 0.0), other=0.0)
                total += w
                acc += o.to(tl.float32) * w[:, None]
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
        res = acc * inv[:, None]
        res_lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
        tl.store(res_rows, res.to(res_ptr.dtype.element_ty), mask=hd_mask)
        tl.store(res_lse_ptr + r * stride_rlt + offs_h, res_lse.to(res_lse_ptr.dtype.element_ty), mask=h_mask)

    _kernel = _merge_kernel
    return _kernel


def merge_attn_states_triton(outs_NTHD: torch.Tensor | list[torch.Tensor], lses_NTH: torch.Tensor | list[torch.Tensor],
                             lse_base: LseBase = LseBase.E, out_dtype: torch.dtype | None = None,
                             out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partials on the GPU; same arguments and results as ``merge_attn_states``.

    Args:
        outs_NTHD: [N, T, H, D] CUDA float16/bfloat16/float32 partial outputs (or a list of [T, H, D]).
        lses_NTH: [N, T, H] their LSEs in ``lse_base`` (or a list of [T, H]).
        lse_base: base of ``lses_NTH``; the result's LSE is always natural log.
        out_dtype: dtype of the merged output; default the dtype of ``outs``.
        out, out_lse: optional [T, H, D] / [T, H] float32 tensors to write into (row stride free,
            last dimension contiguous), e.g. the caller's output so no copy follows.
    Returns:
        out [T, H, D] and lse [T, H] float32 natural log.
    """
    outs, lses = stack_partials(outs_NTHD, lses_NTH, "merge_attn_states_triton")
    n, t, h, d = outs.shape
    res = out if out is not None else torch.empty(t, h, d, dtype=out_dtype or outs.dtype, device=outs.device)
    res_lse = out_lse if out_lse is not None else torch.empty(t, h, dtype=torch.float32, device=outs.device)
    _launch(outs, lses, lse_base, res, res_lse, None)
    return res, res_lse


def merge_into_rows_triton(outs_NRHD: torch.Tensor, lses_NRH: torch.Tensor, out_THD: torch.Tensor,
                           lse_TH: torch.Tensor, rows_R: torch.Tensor, lse_base: LseBase = LseBase.E) -> None:
    """Merge N partials of R rows into rows ``rows_R`` of ``out_THD`` / ``lse_TH``, which already hold one more
    partial (natural log): in place, one launch (a cascade's prefix splits into its suffix pass's rows: no gather of
    those rows, no stack, no scatter after). ``rows_R`` int64 on the device, distinct; ``lse_base`` the partials'."""
    outs, lses = stack_partials(outs_NRHD, lses_NRH, "merge_into_rows_triton")
    if rows_R.shape != outs.shape[1:2] or out_THD.shape[1:] != outs.shape[2:] or lse_TH.shape[1:] != lses.shape[2:]:
        raise InvalidRequestError(f"merge_into_rows_triton needs rows [R] and out [T, H, D] / lse [T, H] matching the "
                                  f"partials [N, R, H, D]; got rows {tuple(rows_R.shape)}, out {tuple(out_THD.shape)},"
                                  f" lse {tuple(lse_TH.shape)}, partials {tuple(outs.shape)}")
    _launch(outs, lses, lse_base, out_THD, lse_TH, rows_R)


def _launch(outs: torch.Tensor, lses: torch.Tensor, lse_base: LseBase, res: torch.Tensor, res_lse: torch.Tensor,
            rows: torch.Tensor | None) -> None:
    import triton

    check_lse_base(lse_base)
    n, t, h, d = outs.shape
    if t == 0:
        return
    if outs.stride(-1) != 1:
        outs = outs.contiguous()
    if lses.stride(-1) != 1:
        lses = lses.contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), max(1, 1024 // block_d)))
    grid = (t, triton.cdiv(h, block_h))
    _get_kernel()[grid](outs, lses, res, res_lse, lses if rows is None else rows, n, h,
                        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1),
                        res.stride(0), res.stride(1), res_lse.stride(0),
                        lse_base.to_natural, D=d, BLOCK_H=block_h, BLOCK_D=block_d,
                        UNROLL=n if n <= 16 else 0, INTO=rows is not None, num_warps=4)


__all__ = ["merge_attn_states_triton", "merge_into_rows_triton"]
