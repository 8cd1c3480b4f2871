"""Dynamic fp8 page scales grown inside a CUDA graph: PageScaleWrites' growth at fixed shapes.

PageScaleWrites (fp8.py) plans on the host which distinct pages a step writes, so its tensors' shapes change
from step to step, and a captured decode graph cannot hold it. In a decode-only step every written slot is in
a page of its own (one new token per sequence; a replica slot is on another page than any own slot; a shared
page is copied before it is written), so here each slot row stands for its page and no planning is needed: the
shapes depend only on the step's token count. The rows' pages are derived once per step (written_pages, into
buffers the graphs read); each layer grows its own scales from them (grow_scales_of_pages).

Rows whose slot is -1 (tokens this shard does not store) must write nothing, but an index_copy cannot skip
rows: they repeat the first written row (its page, its values), so every duplicate write carries identical
bytes. When no row writes, they all re-store page 0 unchanged (ratio 1, scale kept).

Legend: n slot arrays (own, replica), T tokens, R = n * T rows, Hk kv heads, B page tokens, D head size.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from cpattn.kvstore.fp8 import _finite_amax, _page_index, _page_store, needed_scales


class WrittenPages(NamedTuple):
    """Which page each slot row writes, derived once per step from the step's slots (the layers share them)."""
    src: torch.Tensor      # [R] int64: the row whose page and values row r repeats (itself when it writes)
    pages: torch.Tensor    # [R] int64: the page row r writes (page 0 when no row writes)
    fresh: torch.Tensor    # [R] bool: the page's first token: a new owner, its old scale does not count
    writes: torch.Tensor   # [R] bool: False only when no row writes


def written_pages(slots_R: torch.Tensor, page_tokens: int) -> WrittenPages:
    """The per-step half of the growth: fixed shapes (R rows), no host sync."""
    return WrittenPages(*(field[0] for field in written_pages_of_steps(slots_R[None], page_tokens)))


def written_pages_of_steps(slots_SR: torch.Tensor, page_tokens: int) -> WrittenPages:
    """written_pages of each row of ``slots_SR`` (a decode run's S steps of R slot rows), at once: row j of each
    field is step j's (a steady run copies them into the graphs' buffers one row a step)."""
    steps, rows = slots_SR.shape
    valid = slots_SR >= 0
    first = torch.argmax(valid.to(torch.int32), dim=1, keepdim=True)                 # [S, 1]: 0 when none writes
    src = torch.where(valid, torch.arange(rows, device=slots_SR.device).expand(steps, rows), first)
    slots = torch.gather(slots_SR, 1, src)
    writes = slots >= 0
    pages = torch.where(writes, torch.div(slots, page_tokens, rounding_mode="floor"), torch.zeros_like(slots))
    return WrittenPages(src, pages, writes & (slots % page_tokens == 0), writes)


def written_pages_of_steps_host(slots_SR: np.ndarray, page_tokens: int) -> WrittenPages:
    """written_pages_of_steps of host slots, by numpy (the same values and dtypes, as CPU tensors): a steady run's
    rows are laid out on the client, where a torch op on a run's [S, R] rows (over its 32K-element grain at 64
    sequences x 128 steps x 2 slot arrays) waits for torch's intra-op threads."""
    steps, rows = slots_SR.shape
    valid = slots_SR >= 0
    slots_SR = slots_SR.astype(np.int64, copy=False)
    first = valid.argmax(axis=1)                                                       # [S]: 0 when none writes
    src = np.where(valid, np.arange(rows, dtype=np.int64)[None, :], first[:, None].astype(np.int64))
    # the gather's values without a gather: a row that writes keeps its slot, the others take the first's
    slots = np.where(valid, slots_SR, slots_SR[np.arange(steps), first][:, None])
    writes = slots >= 0
    pages = np.where(writes, slots // page_tokens, 0).astype(np.int64, copy=False)
    fresh = writes & (slots % page_tokens == 0)
    return WrittenPages(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (src, pages, fresh, writes)))


def grow_scales_of_pages(kv_cache_2NBKD: torch.Tensor, scales_2NK: torch.Tensor, k_TKD: torch.Tensor,
                         v_TKD: torch.Tensor, written: WrittenPages, kv_format: str) -> None:
    """The per-layer half: grow the scales of ``written``'s pages to cover k/v (T tokens, repeated for each
    slot array) and re-express those pages' cached values under them. In place; no host sync."""
    src, pages, fresh, writes = written
    copies = src.numel() // k_TKD.shape[0]
    amax = torch.stack([_finite_amax(k_TKD, 2), _finite_amax(v_TKD, 2)]).repeat(1, copies, 1)   # [2, R, Hk]
    needed = needed_scales(amax, kv_format).index_select(1, src) * writes[None, :, None]
    old = scales_2NK.index_select(1, pages)
    old = torch.where(fresh[None, :, None], torch.zeros_like(old), old)
    new = torch.maximum(old, needed)
    ratio = torch.where(old > 0, old / torch.where(new > 0, new, torch.ones_like(new)), torch.ones_like(old))
    cached = _page_index(kv_cache_2NBKD, pages)                                        # [2, R, B, Hk, D]
    _page_store(kv_cache_2NBKD, pages, (cached.to(torch.float32) * ratio[:, :, None, :, None]).to(kv_cache_2NBKD.dtype))
    scales_2NK.index_copy_(1, pages, new)


def grow_scales_of_slots(kv_cache_2NBKD: torch.Tensor, scales_2NK: torch.Tensor, k_TKD: torch.Tensor,
                         v_TKD: torch.Tensor, slots_R: torch.Tensor, page_tokens: int, kv_format: str) -> None:
    """Grow the scales of the pages ``slots_R`` (int64, -1: none) write to cover k/v (T tokens, repeated for
    each slot array), and re-express those pages' cached values under them. In place; no host sync; the same
    result as ``PageScaleWrites(slot arrays).grow(...)`` for a decode-only step."""
    grow_scales_of_pages(kv_cache_2NBKD, scales_2NK, k_TKD, v_TKD, written_pages(slots_R, page_tokens), kv_format)
