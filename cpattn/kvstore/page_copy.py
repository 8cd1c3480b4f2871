"""Copy on write of KV pages: a step that writes into a page it shares first copies that page.

The coordinator picks the pages (kvstore/sharded_allocator.py ``Growth.copies``); every layer's cache
copies them before that layer's KV update, so the copy and the write happen inside the step. An fp8
cache's pages copy bit for bit: a layer's scales are per shard, not per page, so the copy reads the same.
Legend: C pages copied; a cache is [2, num_blocks, ...] for every backend (the page axis is 1).
"""

from __future__ import annotations

import torch


def copy_pages(kv_cache: torch.Tensor, copies_C2: torch.Tensor) -> None:
    """``kv_cache[:, copy] = kv_cache[:, shared]`` for each (shared, copy) row of ``copies_C2`` (int64, the
    cache's device). Copies never overlap their sources: a copy is a freshly allocated page."""
    if copies_C2.numel():
        bits = kv_cache.view(_SAME_SIZE_INT[kv_cache.element_size()])   # fp8 has no index_copy kernel on CPU
        bits.index_copy_(1, copies_C2[:, 1], bits.index_select(1, copies_C2[:, 0]))


# Copies move bits: viewed as integers of the element's size, every cache dtype copies exactly.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
