"""A shard's KV pages outside a step: read and written whole (a replacement's refill, then marked ready; tests),
handed to a client on the same GPU (CUDA IPC), filled with seeded synthetic KV, summed as a checksum.

A mixin of cluster.shard.ShardWorker (its caches, page scales, device and fence); per-layer attention is not
here (ShardWorker.run_step). Every method is a remote one, checked by the shard's authority rules first.
"""

from __future__ import annotations

import torch

from cpattn.attention import write_kv_cache
from cpattn.cluster.fencing import StepFence
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import AccessDeniedError, StepFencedError
from cpattn.kvstore import copy_pages
from cpattn.kvstore.fp8 import PageScaleWrites, dequantize, page_scales_of, quantize

SYNTHETIC_CHUNK = 1 << 16

def synthetic_kv(seed: int, layer: int, start: int, num_tokens: int, num_kv_heads: int, head_size: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, Hk, D] float32 of tokens [start, start + T) that fill_synthetic writes for one layer.

    Drawn in fixed chunks of SYNTHETIC_CHUNK tokens (each seeded by seed, layer, chunk), so every shard
    draws the same values on the same device kind, and memory stays bounded for million-token fills.
    """
    if start % SYNTHETIC_CHUNK:
        raise ValueError(f"start {start} must be a multiple of {SYNTHETIC_CHUNK}")
    parts = []
    for c in range(start, start + num_tokens, SYNTHETIC_CHUNK):
        n = min(SYNTHETIC_CHUNK, start + num_tokens - c)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer * 10_007 + c // SYNTHETIC_CHUNK)
        parts.append(torch.randn(2, n, num_kv_heads, head_size, generator=gen, device=device))
    kv = torch.cat(parts, dim=1)
    return kv[0], kv[1]


class ShardKVPages:
    """ShardWorker's remote methods on whole KV pages."""

    config: ServiceConfig
    bundle_index: int
    device: torch.device
    dtype: torch.dtype
    kv_caches: list[torch.Tensor]
    kv_scales: list[torch.Tensor] | None
    kv_format: str | None
    _fence: StepFence
    _ready: bool

    def kv_checksum(self, secret: str | None = None) -> float:
        """Sum of |KV| over every layer, a cheap fingerprint for 'nothing changed' checks (an fp8 cache's real,
        dequantised values, so a replacement holding the same values under other scales sums the same)."""
        if self.kv_scales is None:
            return float(sum(t.double().abs().sum() for t in self.kv_caches))
        return float(sum(dequantize(t, s[:, :, None, :, None], torch.float64).abs().sum()
                         for t, s in zip(self.kv_caches, self.kv_scales)))

    def get_kv_scales(self, secret: str | None = None) -> list[list[list[float]]] | None:
        """fp8 caches: every layer's [2, Hk] largest page scale (a summary; read_block_scales has the pages')."""
        return None if self.kv_scales is None else [s.amax(dim=1).tolist() for s in self.kv_scales]

    def read_block_scales(self, block_ids: list[int], secret: str | None = None) -> torch.Tensor | None:
        """fp8 caches: the pages' scales [num_layers, 2, n, Hk] float32 on the CPU (None for other caches), so a
        copy made with read_blocks + write_blocks holds exactly the source's bytes and scales."""
        if self.kv_scales is None:
            return None
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return torch.stack([s.index_select(1, idx) for s in self.kv_scales]).cpu()

    def export_kv(self, group_name: str, ticket: str | None = None) -> list[tuple]:
        """CUDA IPC handles of every layer's KV cache (and an fp8 cache's page scales), for a client on this GPU to
        open once per connection.

        Such a client computes this shard's share in its own process (no per-layer hand-over between
        two processes on one GPU, which costs a context switch each way); the caches stay owned here.
        Only non-detached services use it (gateway._local_ranks): writes made there bypass the fence. The
        caller proves it is a registered client (a group ticket); it then holds this whole shard's KV, which
        is why services whose clients must be isolated from each other run with local_shards='off' (README
        Security), which the shard itself enforces here.
        """
        self._live_ticket(group_name, ticket)
        refusal = self.config.in_process_refusal()   # local_shards='off', detached, or a cache not on CUDA
        if refusal is not None:
            raise AccessDeniedError(f"shard {self.bundle_index}: export_kv refused: {refusal}")
        from torch.multiprocessing.reductions import reduce_tensor

        # fp8: the page scales too (after the caches), which the client grows as it writes its pages.
        return [reduce_tensor(t)[1] for t in self.kv_caches + (self.kv_scales or [])]

    def read_blocks(self, block_ids: list[int], secret: str | None = None) -> torch.Tensor:
        """KV pages [num_layers, 2, n, block_size, Hk, D] on the CPU (recovery and tests; never per layer).
        An fp8 cache's pages come back dequantised (float32 real values), so the receiver needs no scales."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.kv_scales is None:
            return torch.stack([t[:, idx] for t in self.kv_caches]).cpu()
        return torch.stack([dequantize(t[:, idx], s.index_select(1, idx)[:, :, None, :, None], torch.float32)
                            for t, s in zip(self.kv_caches, self.kv_scales)]).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, secret: str | None = None,
                     scales: torch.Tensor | None = None) -> None:
        """Pages [num_layers, 2, n, B, Hk, D] of real values into ``block_ids``. An fp8 cache takes the pages'
        ``scales`` (read_block_scales of the source: the copy is then exact, bytes and scales); without them
        dynamic scales are computed from the pages as if written afresh, static ones are the config's."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, t in enumerate(self.kv_caches):
            if self.kv_scales is None:
                t[:, idx] = data[layer].to(self.device, self.dtype)
                continue
            pages = data[layer].to(self.device, torch.float32)             # [2, n, B, Hk, D] real values
            scale = self.kv_scales[layer]
            if scales is not None:
                scale.index_copy_(1, idx, scales[layer].to(self.device, torch.float32))
            elif self.config.kv_scales is None:
                scale.index_copy_(1, idx, page_scales_of(pages, self.kv_format))
            t[:, idx] = quantize(pages, scale.index_select(1, idx)[:, :, None, :, None], t.dtype)

    def fill_synthetic(self, plan: ShardStepPlan, seed: int) -> int:
        """Write seeded random K/V for the plan's new tokens this shard owns (benchmarks, load tests).

        Every shard draws the same values (synthetic_kv on its device) and keeps its own tokens, so
        the sequence's logical KV is reproducible from ``seed``.
        """
        slots = plan.metadata.slot_mapping.to(self.device)
        replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(self.device)
        hk, d = self.config.num_kv_heads, self.config.head_size
        copies = None if plan.page_copies is None else plan.page_copies.to(self.device)
        for layer, cache in enumerate(self.kv_caches):
            if not self._fence.enter(plan.incarnation):
                raise StepFencedError(f"shard {self.bundle_index}: fill_synthetic of coordinator incarnation "
                                      f"{plan.incarnation} was fenced by a restarted coordinator: fill again")
            try:
                if copies is not None:
                    copy_pages(cache, copies)   # copy on write of a forked prefix's shared page
                for start in range(0, plan.num_tokens, SYNTHETIC_CHUNK):
                    n = min(SYNTHETIC_CHUNK, plan.num_tokens - start)
                    k, v = synthetic_kv(seed, layer, start, n, hk, d, self.device)
                    k, v = k.to(self.dtype), v.to(self.dtype)
                    scale = None
                    if self.kv_scales is not None:
                        scale = self.kv_scales[layer]
                        if self.config.kv_scales is None:
                            chunk = [a[start:start + n] for a in (plan.metadata.slot_mapping,
                                                                  plan.replica_slot_mapping) if a is not None]
                            PageScaleWrites(chunk, self.config.block_size, self.device).grow(
                                cache, scale, k, v, self.kv_format)
                    for chunk_slots in (slots, replica):
                        if chunk_slots is not None:
                            write_kv_cache(cache, k, v, chunk_slots[start:start + n], scale)
            finally:
                self._fence.leave()
        return int((slots >= 0).sum())

    def mark_ready(self, secret: str | None = None) -> None:
        """The coordinator finished refilling this replacement: it may serve now."""
        self._ready = True
