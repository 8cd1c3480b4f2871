"""fp8 KV cache: element formats, per-page scales, quantise / dequantise. torch only.

A cached value is ``stored * scale`` with ``stored`` an fp8 number and ``scale`` a float32 of its *page*:
every layer keeps ``scales_2NK`` [2 (K, V), num_pages, Hk] next to its cache [2, num_pages, B, Hk, D].
A page belongs to one sequence, so one sequence's values can never change another sequence's cached
values or outputs (tenant isolation: a client's outlier re-expresses only its own pages).

Dynamic scales (no calibration given) follow one rule per page, applied to the tokens a step writes into
that page (PageScaleWrites plans them once per step, from the step's slots):

    scale = max(scale, 2 ** ceil(log2(amax / fp8_max)))        (per K/V and kv head; 0 = not yet set)

and a write into a page's first slot starts the page afresh (scale 0 before the rule): the page has a new
owner, so nothing of a freed sequence's values survives in it. A page's scale only grows, by powers of two:
- a page's scale depends only on the values written into that page, so every shard that holds the page
  (its owner and its replica, which receive the same tokens in the same steps) computes the same scale;
- when a page's scale grows by 2^e its cached tokens are re-expressed by an exponent shift, exact for every
  value except those that drop below the format's smallest subnormal (values < 2^-9 (e4m3) or 2^-16 (e5m2)
  of the new scale, i.e. far below the rounding error of the page's largest values);
- shard replacement (kv_replicas=2) copies pages as real values together with their scales
  (read_block_scales), so the replacement holds exactly the surviving copy's bytes and scales.
Rounding error per stored value: at most half a unit in the last place of the format, relative 2^-4
(e4m3, 3 mantissa bits) or 2^-3 (e5m2, 2 mantissa bits), for values in the normal range.

Values that do not fit, one policy everywhere: they saturate. Under dynamic scales every finite value fits
(its page's scale grows); +-inf is stored as +-fp8_max * scale and NaN as NaN, and neither moves a scale.
Static scales (a checkpoint's calibration, the same for every page) are fixed; values beyond
``fp8_max * scale`` are stored as +-fp8_max * scale. Quantisation is a function of the values and the
page's scale only, so every shard and replica stores the same bytes.
"""

from __future__ import annotations

import math

import torch

from cpattn.errors import InvalidRequestError

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def is_fp8(kv_format: str) -> bool:
    return kv_format in FP8_FORMATS


def fp8_dtype(kv_format: str) -> torch.dtype:
    try:
        return FP8_FORMATS[kv_format]
    except KeyError:
        raise InvalidRequestError(f"kv cache format {kv_format!r} is not fp8: use fp8_e4m3 or fp8_e5m2") from None


def fp8_format_of(dtype: torch.dtype) -> str | None:
    """fp8_e4m3 / fp8_e5m2 for an fp8 cache dtype, None for any other dtype."""
    for name, dt in FP8_FORMATS.items():
        if dt == dtype:
            return name
    return None


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to the fp8 ``dtype``, saturating at its largest finite value (never inf/NaN).

    ``scale`` broadcasts against x (e.g. [Hk, 1] for x [T, Hk, D]); a scale of 0 stores zeros.
    """
    fmax = torch.finfo(dtype).max
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x.to(torch.float32) / safe).clamp(-fmax, fmax)
    y = torch.where(scale > 0, y, torch.zeros_like(y))
    return y.to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale in ``dtype`` (float32, or float64 for the float64 oracle path)."""
    return x.to(dtype) * scale.to(dtype)


def needed_scales(amax: torch.Tensor, kv_format: str) -> torch.Tensor:
    """The smallest power of two s with amax / s <= fp8_max (0 where amax is 0; inf and NaN count as 0)."""
    amax = torch.nan_to_num(amax.float(), nan=0.0, posinf=0.0)
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX[kv_format]))),
                       torch.zeros_like(amax))


def initial_page_scales(num_pages: int, num_kv_heads: int, static: list[list[float]] | None,
                        device) -> torch.Tensor:
    """[2, num_pages, Hk] float32: a checkpoint's static [2, Hk] scales on every page, or zeros (dynamic:
    each page's scale is set by the first write into it)."""
    if static is None:
        return torch.zeros(2, num_pages, num_kv_heads, dtype=torch.float32, device=device)
    t = torch.tensor(static, dtype=torch.float32, device=device)
    if t.shape != (2, num_kv_heads) or not bool(torch.isfinite(t).all() & (t > 0).all()):
        raise InvalidRequestError(f"static kv scales must be [2, {num_kv_heads}] finite and > 0, got {static}")
    return t[:, None, :].expand(2, num_pages, num_kv_heads).contiguous()


def token_scales(kv_scale_2NK: torch.Tensor, slots_T: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """[2, T, Hk]: the scale of the page each slot lies in (slots < 0 read page 0; callers skip them).

    ``page_tokens``: tokens per scale page (the manager block size), so a kernel view with smaller pages
    addresses the same scales: slot // page_tokens is the page either way."""
    pages = torch.where(slots_T >= 0, slots_T // page_tokens, torch.zeros_like(slots_T))
    return kv_scale_2NK.index_select(1, pages)


def _page_index(kv_cache_2NBKD: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache[:, pages] for any cache dtype (CPU torch has no fp8 indexing kernels: go through bytes)."""
    if fp8_format_of(kv_cache_2NBKD.dtype) is None:
        return kv_cache_2NBKD.index_select(1, pages)
    return kv_cache_2NBKD.view(torch.uint8).index_select(1, pages).view(kv_cache_2NBKD.dtype)


def _page_store(kv_cache_2NBKD: torch.Tensor, pages: torch.Tensor, values: torch.Tensor) -> None:
    """cache[:, pages] = values (same dtype), through bytes for fp8."""
    if fp8_format_of(kv_cache_2NBKD.dtype) is None:
        kv_cache_2NBKD.index_copy_(1, pages, values)
    else:
        kv_cache_2NBKD.view(torch.uint8).index_copy_(1, pages, values.view(torch.uint8))


def dequantize_pages(kv_cache_2NBKD: torch.Tensor, kv_scale_2NK: torch.Tensor, pages_U: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """[2, U, B, Hk, D] ``dtype`` copy of the fp8 cache's pages ``pages_U`` (pages of the view passed, whose page
    count is a multiple of the scales': view page p uses scale row p // multiple), each value times its page's
    scale: for a kernel with no per-page fp8 scales (FLASH_ATTN). Exact in bfloat16 and float16: an fp8 value has
    fewer mantissa bits and the scales are powers of two (needed_scales), so only values the activation dtype
    cannot hold either would round."""
    per_scale = kv_cache_2NBKD.shape[1] // kv_scale_2NK.shape[1]
    values = _page_index(kv_cache_2NBKD, pages_U).to(dtype)
    scales = kv_scale_2NK.index_select(1, torch.div(pages_U, per_scale, rounding_mode="floor")).to(dtype)
    return values.mul_(scales[:, :, None, :, None])


class PageScaleWrites:
    """Which pages a step writes, planned once per step on the host from its slots; every layer reuses it.

    ``pages`` (P,) the distinct pages written; ``token_page`` (n*T,) each written slot's index into
    ``pages`` (P for a slot < 0: a dummy row); ``fresh`` (P,) the page's first slot is written (a new owner).
    ``copies`` n: how many slot arrays (a shard's own slots, then its replica slots) the tokens go to.
    """

    def __init__(self, slot_arrays: list[torch.Tensor], page_tokens: int, device):
        slots = torch.cat([s.to("cpu", torch.int64) for s in slot_arrays])
        valid = slots >= 0
        page_of = torch.where(valid, slots // page_tokens, torch.full_like(slots, -1))
        pages, inverse = torch.unique(page_of[valid], return_inverse=True)
        token_page = torch.full_like(slots, pages.numel())
        token_page[valid] = inverse
        first_slot = torch.zeros(pages.numel(), dtype=torch.bool)
        first_slot[inverse[(slots[valid] % page_tokens) == 0]] = True
        self.copies = len(slot_arrays)
        self.num_pages = pages.numel()
        self.pages = pages.to(device)
        self.token_page = token_page.to(device)
        self.fresh = first_slot.to(device)

    def grow(self, kv_cache_2NBKD: torch.Tensor, scales_2NK: torch.Tensor, k_TKD: torch.Tensor,
             v_TKD: torch.Tensor, kv_format: str) -> None:
        """Dynamic scales of the written pages grown to cover the step's values, in place (module docstring),
        and the pages' cached tokens re-expressed under them. No host synchronisation."""
        if self.num_pages == 0:
            return
        hk = scales_2NK.shape[2]
        amax = torch.stack([_finite_amax(k_TKD, 2), _finite_amax(v_TKD, 2)])                    # [2, T, Hk]
        needed = needed_scales(amax, kv_format).repeat(1, self.copies, 1)
        per_page = torch.zeros(2, self.num_pages + 1, hk, dtype=torch.float32, device=scales_2NK.device)
        per_page.scatter_reduce_(1, self.token_page[None, :, None].expand(2, -1, hk), needed, "amax")
        old = scales_2NK.index_select(1, self.pages)
        old = torch.where(self.fresh[None, :, None], torch.zeros_like(old), old)
        new = torch.maximum(old, per_page[:, :self.num_pages])
        ratio = torch.where(old > 0, old / torch.where(new > 0, new, torch.ones_like(new)), torch.ones_like(old))
        pages = self.pages
        if not pages.is_cuda:
            # The host has no sync to avoid and converts fp8 slowly: re-express only the pages that grew.
            grew = (ratio != 1).any(dim=2).any(dim=0)
            pages, ratio = pages[grew], ratio[:, grew]
        cached = _page_index(kv_cache_2NBKD, pages)                                    # [2, P, B, Hk, D]
        _page_store(kv_cache_2NBKD, pages, (cached.to(torch.float32) * ratio[:, :, None, :, None]).to(kv_cache_2NBKD.dtype))
        scales_2NK.index_copy_(1, self.pages, new)


def page_scales_of(pages_2nBKD: torch.Tensor, kv_format: str) -> torch.Tensor:
    """[2, n, Hk]: dynamic scales of whole pages of real values, as if written afresh."""
    return needed_scales(_finite_amax(pages_2nBKD, (2, 4)), kv_format)


def _finite_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over ``dim`` of the finite values (inf and NaN saturate / stay NaN, they set no scale)."""
    return x.detach().float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=dim)


def max_relative_error(kv_format: str) -> float:
    """Largest relative rounding error of one stored value in the normal range (half an ulp)."""
    mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[kv_format]
    return math.ldexp(1.0, -(mantissa + 1))
