"""Growing a layer's dynamic fp8 scales before a write: shards and the client's local shards do it alike."""

from __future__ import annotations

import torch

from cpattn.kvstore.fp8 import dynamic_scales, rescale_cache


def grow_scales(kv_cache_2NBKD: torch.Tensor, scale_2K: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                kv_format: str) -> None:
    """Grow ``scale_2K`` in place to cover the new K/V and re-express the cached values under it (the rule
    and why it is exact: kvstore/fp8.py)."""
    grown = dynamic_scales(scale_2K, k_TKD, v_TKD, kv_format)
    rescale_cache(kv_cache_2NBKD, scale_2K, grown)
    scale_2K.copy_(grown)
