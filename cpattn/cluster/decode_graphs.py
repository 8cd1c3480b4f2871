"""CUDA graphs of one shard's per-layer decode work: one replay instead of ~10 launches from Python.

Legend: T tokens (= requests: a decode-only step), Q query heads, K kv heads, D head size, L layers.
A decode layer on a shard is a KV write (and a replica write), the paged split-KV kernel and its split
merge. Launched from Python these cost 20-60 us each on the host, more than the kernels themselves
below ~256K tokens, so a decode loop was host-bound. Captured once per bucket (T, KV splits, block-table
width rounded up to a power of two, replica or not), one graph per layer (each layer has its own cache),
they replay from buffers at fixed addresses (invariant 8): each step copies its slots, block table and
key counts into them, each layer its q|k|v. Lengths live on the device (the kernel cuts each token's keys
into the splits itself), so a growing sequence replays the same graphs until its bucket changes.
An fp8 cache's page scales are read from the shard's per-layer tensors; dynamic scales grow inside the graph
(kvstore/fp8_graphed.py: one row per written slot, so no per-step host planning).
Used by the shard actor and by a client computing a shard on its own GPU (cluster.layer_runner).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from cpattn.attention import AttentionCGSupport, to_natural_lse
from cpattn.attention.cascade_plan import PrefixPass
from cpattn.attention.backends.triton_attn import write_kv_cache_fast
from cpattn.cluster.graph_capture import capture_graphs, fill_qkv
from cpattn.cluster.row_arena import RowArena
from cpattn.kvstore import kernel_kv_view
from cpattn.kvstore.fp8_graphed import WrittenPages, grow_scales_of_pages, written_pages

logger = logging.getLogger("cpattn")


class DecodeGraphs:
    """Per-layer graphs of one ShardLayerRunner's decode steps; ``prepare`` once per step, ``run`` per layer."""

    def __init__(self, runner):
        self.runner = runner
        self.key: tuple | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replica: torch.Tensor | None = None
        self.written: WrittenPages | None = None
        """Dynamic fp8 scales: the pages the step's own then replica slots write, derived once per step."""
        self.arena: RowArena | None = None
        """The buffers a steady step refills, laid out in one (cluster/row_arena.py): made with the bucket's."""
        self.prefix: PrefixPass | None = None
        """The prefix pass's plan and rows in buffers (its q_start and into_rows are the bucket's)."""
        self.prefix_source: PrefixPass | None = None
        """The PrefixPass whose plan and rows the buffers hold (refilled only when a step brings another)."""
        self.disabled = False
        self.table_source: tuple[int, int] | None = None
        """(id, version) of the host block table whose device copy the buffers hold (prepare_from_host)."""
        self._table_held: torch.Tensor | None = None

    @staticmethod
    def supported(runner) -> bool:
        """Graphs need CUDA and a backend declaring decode graphs with the hooks to refill its metadata."""
        return (runner.config.cuda_graphs == "auto" and runner.device.type == "cuda"
                and runner.backend.cudagraph_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
                and all(hasattr(runner.builder, h) for h in ("graph_key", "make_static", "refill")))

    def prepare(self, attn_metadata, replica_slots: torch.Tensor | None, pieces: torch.Tensor,
                rows: torch.Tensor | None, prefix_pass: tuple | None = None) -> bool:
        """Ready this step's graphs (capturing on a new bucket); False when the step must run eagerly.
        ``prefix_pass`` (plan, rows): forks' shared prefixes read once (layer_runner.attend_prefix), captured with
        the layer: its plan's buffers are refilled like the step's (a decode loop keeps its forks, so its bucket)."""
        if self.disabled or pieces.numel() or rows is not None:
            return False
        key = self.bucket(attn_metadata, replica_slots, prefix_pass)
        if key is None:
            return False
        if key != self.key:
            try:
                self._capture(attn_metadata, key, prefix_pass)
            except RuntimeError as exc:   # a kernel or op that cannot be captured here: stay eager
                logger.warning("CUDA graphs off for this shard (%s); decode runs eagerly", exc)
                self.disabled, self.key, self.graphs, self.outputs = True, None, [], []
                return False
        builder = self.runner.builder
        builder.refill(self.static, attn_metadata)
        self.table_source = None   # the buffers' table is this plan's, not a kept host table's
        self._refill_writes(replica_slots)
        if prefix_pass is not None and prefix_pass is not self.prefix_source:   # a run's steps share one pass
            builder.refill(self.prefix.plan, prefix_pass.plan)
            self.prefix.rows.copy_(prefix_pass.rows)
            self.prefix_source = prefix_pass   # held, so its id is not reused while kept
        return True

    def prepare_from_host(self, common, table: torch.Tensor, replica_slots: torch.Tensor | None) -> bool:
        """``prepare`` for a plain decode step whose bucket is the one captured, without building its plan: its
        slots, key counts and replica slots copied from the host into the buffers, its block table (``table``,
        on the device; ``common.block_table_cpu`` its host copy) only when it is not the one they hold (a decode
        run's steps share one). False (nothing changed) when the step needs build() and ``prepare``."""
        builder = self.runner.builder
        if self.disabled or self.key is None or self.prefix is not None or not hasattr(builder, "host_graph_key"):
            return False
        key = builder.host_graph_key(common)
        if key is None or key + (replica_slots is not None, None) != self.key:
            return False
        source = common.block_table_cpu
        same = self.table_source is not None and self.table_source == (id(source), source._version)
        builder.refill_from_host(self.static, common, None if same else table)
        self.table_source, self._table_held = (id(source), source._version), source   # held: its id stays unique
        self._refill_writes(None if replica_slots is None else replica_slots.to(self.runner.device, non_blocking=True))
        return True

    def step_rows(self, slots: torch.Tensor, kv_lens: torch.Tensor, window_starts: dict[int, torch.Tensor],
                  replica: torch.Tensor | None, written: WrittenPages | None) -> list[torch.Tensor]:
        """Decode steps' values ([S, ...] each) of the buffers in ``arena``, in its buffers' order (``arena.pack``)."""
        return self._with_writes(self.runner.builder.step_rows(slots, kv_lens, window_starts), replica, written)

    def _with_writes(self, own: list, replica, written) -> list:
        """The arena's order: the builder's buffers, then replica slots and written pages where the bucket has them."""
        return own + ([replica] if self.replica is not None else []) + (list(written) if self.written is not None
                                                                        else [])

    def _pack_step_buffers(self) -> RowArena | None:
        """The buffers a steady step refills (the builder's step_row_buffers, replica slots, written pages) moved
        into one RowArena, before capture (the graphs read the views); None for a builder without the hooks."""
        builder = self.runner.builder
        if not all(hasattr(builder, h) for h in ("step_row_buffers", "with_step_row_buffers", "step_rows")):
            return None
        own = builder.step_row_buffers(self.static)
        arena = RowArena(self._with_writes(own, self.replica, self.written))
        self.static = builder.with_step_row_buffers(self.static, arena.views[:len(own)])
        rest = arena.views[len(own):]
        if self.replica is not None:
            self.replica, rest = rest[0], rest[1:]
        if self.written is not None:
            self.written = WrittenPages(*rest)
        return arena

    def _refill_writes(self, replica_slots: torch.Tensor | None) -> None:
        """The step's replica slots (on the device) and, for dynamic fp8 scales, the pages its slots write, into
        the buffers (once per step, not in every layer's graph)."""
        if replica_slots is not None:
            self.replica.copy_(replica_slots)
        if self.written is not None:
            own = self.static.slot_mapping
            slots = own if replica_slots is None else torch.cat([own, replica_slots])
            for buffer, value in zip(self.written, written_pages(slots, self.runner.config.block_size)):
                buffer.copy_(value)

    def bucket(self, attn_metadata, replica_slots: torch.Tensor | None, prefix_pass: tuple | None) -> tuple | None:
        """The graphs' key of a step: the backend's (T, S, width bucket), replica writes, and the prefix pass's
        own key with its row count; None when the backend cannot replay this step."""
        builder = self.runner.builder
        key = builder.graph_key(attn_metadata)
        if key is None:
            return None
        prefix_key = None
        if prefix_pass is not None:
            prefix_key = builder.graph_key(prefix_pass.plan)
            if prefix_key is None:
                return None
            prefix_key = (prefix_key, prefix_pass.rows.numel(), prefix_pass.q_start, prefix_pass.into_rows)
        return key + (replica_slots is not None, prefix_key)

    def run(self, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor,
            v_TKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: out [T, Q, D], natural-log lse [T, Q] in the graph's buffers (overwritten when this
        layer replays again: a caller that keeps them past the step copies them)."""
        fill_qkv(self.qkv, q_TQD, k_TKD, v_TKD)
        self.graphs[layer].replay()
        return self.outputs[layer]

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        extra, scale = {}, None
        if r.kv_format is not None:
            scale = extra["kv_scale"] = r.kv_scales[layer]
            if self.written is not None:   # dynamic scales: grown before this layer's writes (as run_layer does)
                grow_scales_of_pages(r.kv_caches[layer], scale, self.k, self.v, self.written, r.kv_format)
        if self.replica is not None:
            write_kv_cache_fast(r.kv_caches[layer], self.k, self.v, self.replica, scale)
        kv_cache = kernel_kv_view(r.kv_caches[layer], r.config.block_size, r.kernel_block_size)
        out, lse = r.impl.forward(layer, self.q, self.k, self.v, kv_cache, self.static, **extra)
        lse = to_natural_lse(lse.to(r.lse_dtype), r.backend.lse_base)
        if self.prefix is not None:
            out, lse = r.attend_prefix(layer, self.prefix, self.q, self.k, self.v, kv_cache, out, lse, extra)
        return out.to(r.dtype), lse

    def _capture(self, attn_metadata, key: tuple, prefix_pass: tuple | None = None) -> None:
        r = self.runner
        self.graphs, self.outputs, self.key = [], [], None
        self.make_buffers(attn_metadata, key, prefix_pass)
        # Warm-up: JIT compilation and allocations happen outside the capture.
        self.graphs, self.outputs = capture_graphs(r.device, r.config.num_layers, self._layer,
                                                   warmup=lambda: self._layer(0), sync_device=False)
        self.key = key
        logger.info("captured %d decode graphs for bucket %s", len(self.graphs), key)

    def make_buffers(self, attn_metadata, key: tuple, prefix_pass: tuple | None = None) -> None:
        """The buffers of ``key``'s bucket that the graphs read (``_layer`` runs from them; so does a CPU test,
        without capture). Slots stay -1 (no writes) until refill puts a step's in; a prefix pass's rows stay 0
        and its table empty (reads only)."""
        r, cfg = self.runner, self.runner.config
        t = key[0]
        hq, hk = cfg.num_q_heads, cfg.num_kv_heads
        self.static = r.builder.make_static(attn_metadata, key[:3])
        self.qkv = torch.zeros(t, hq + 2 * hk, cfg.head_size, dtype=r.dtype, device=r.device)
        self.q, self.k, self.v = self.qkv.split([hq, hk, hk], dim=1)
        self.replica = torch.full((t,), -1, dtype=torch.int64, device=r.device) if key[3] else None
        dynamic_fp8 = r.kv_format is not None and cfg.kv_scales is None
        no_writes = torch.full(((2 if key[3] else 1) * t,), -1, dtype=torch.int64, device=r.device)
        self.written = written_pages(no_writes, cfg.block_size) if dynamic_fp8 else None
        self.arena = self._pack_step_buffers()
        self.prefix, self.prefix_source = None, None
        if prefix_pass is not None:
            self.prefix = replace(prefix_pass, plan=r.builder.make_static(prefix_pass.plan, key[4][0]),
                                  rows=torch.zeros_like(prefix_pass.rows))
