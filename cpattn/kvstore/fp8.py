"""fp8 KV cache: element formats, per-(layer, K/V, kv head) scales, quantise / dequantise. torch only.

A cached value is ``stored * scale`` with ``stored`` an fp8 number and ``scale`` a float32 per layer,
K or V, and kv head (``scales_2K`` [2, Hk] per layer).

Dynamic scales (no calibration given) follow one rule, applied by every shard to the *whole* step's
new K/V of a layer before it writes the tokens it owns:

    scale = max(scale, 2 ** ceil(log2(amax / fp8_max)))        (per K/V and kv head; 0 = not yet set)

so a scale only grows, and always by a power of two. Three consequences:
- every shard receives the whole step's K/V, so every shard computes the same scales, step after step
  (the scales are "replicated" with the cache by construction, and a replica page holds exactly the bytes
  its owner holds);
- when a scale grows by 2^e the tokens already cached are re-expressed with the new scale by an exponent
  shift, which is exact for every value except those that drop below the format's smallest subnormal
  (values < 2^-9 (e4m3) or 2^-16 (e5m2) of the new scale, i.e. far below the rounding error of the
  largest values);
- copying a page between shards through its real values (dequantise, requantise with the receiver's
  scale, which is a power of two not larger than the sender's) is exact: shard replacement
  (kv_replicas=2) rebuilds the scales from the copied pages.
Rounding error per stored value: at most half a unit in the last place of the format, relative 2^-4
(e4m3, 3 mantissa bits) or 2^-3 (e5m2, 2 mantissa bits), for values in the normal range.
Static scales (a checkpoint's calibration) are fixed; values beyond ``fp8_max * scale`` saturate.
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


def dynamic_scales(old_2K: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, kv_format: str) -> torch.Tensor:
    """The grown scales [2, Hk] covering the new K/V (see the module docstring); float32, powers of two."""
    fmax = FP8_MAX[kv_format]
    amax = torch.stack([k_TKD.detach().abs().amax(dim=(0, 2)), v_TKD.detach().abs().amax(dim=(0, 2))]).float()
    amax = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    needed = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / fmax))), torch.zeros_like(amax))
    return torch.maximum(old_2K, needed.to(old_2K.device))


def rescale_cache(kv_cache_2NBKD: torch.Tensor, old_2K: torch.Tensor, new_2K: torch.Tensor) -> None:
    """Re-express cached values under grown scales, in place: stored * old / new (an exponent shift)."""
    changed = (new_2K != old_2K) & (old_2K > 0)
    if not bool(changed.any()):
        return
    ratio = torch.where(changed, old_2K / new_2K, torch.ones_like(old_2K))      # [2, Hk], powers of two
    for kv, head in changed.nonzero().tolist():
        part = kv_cache_2NBKD[kv, :, :, head]
        part.copy_((part.to(torch.float32) * ratio[kv, head]).to(kv_cache_2NBKD.dtype))


def initial_scales(num_kv_heads: int, static: list[list[float]] | None, device) -> torch.Tensor:
    """[2, Hk] float32: a checkpoint's static scales, or zeros (dynamic, set by the first write)."""
    if static is None:
        return torch.zeros(2, num_kv_heads, dtype=torch.float32, device=device)
    t = torch.tensor(static, dtype=torch.float32, device=device)
    if t.shape != (2, num_kv_heads) or not bool(torch.isfinite(t).all() & (t > 0).all()):
        raise InvalidRequestError(f"static kv scales must be [2, {num_kv_heads}] finite and > 0, got {static}")
    return t


def max_relative_error(kv_format: str) -> float:
    """Largest relative rounding error of one stored value in the normal range (half an ulp)."""
    mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[kv_format]
    return math.ldexp(1.0, -(mantissa + 1))
