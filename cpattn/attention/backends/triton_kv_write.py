"""The TRITON backend's KV-cache write: new tokens' K and V into their slots, fp8 quantised in the kernel.

Slots < 0 are skipped inside the kernel, so it needs no host sync (a CUDA graph captures it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
