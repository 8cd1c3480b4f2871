"""One shard's attention work: plan a step once, then one call per layer. No Ray, no wire.

Legend: T tokens of the step, R rows this shard computes, Q query heads, K kv heads, D head size.
The shard actor runs it on the tensors it received over the data plane; a client that shares the
shard's GPU runs the same code in its own process on the shard's KV cache opened by CUDA IPC
(cpattn.cluster.gateway), so per-layer tensors never leave that GPU's memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from cpattn.attention import AttentionSpec, to_natural_lse
from cpattn.attention.backends.triton_attn import write_kv_cache_fast
from cpattn.attention.cascade_plan import PrefixPass, PrefixSplitter, consecutive_start, merge_prefix_rows
from cpattn.attention.ops.merge import merge_partials
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.new_tokens import NewTokensStep, covers_rows, plan_new_tokens
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError
from cpattn.kvstore.fp8 import PageScaleWrites, is_fp8
from cpattn.kvstore import copy_pages, expand_block_table, kernel_kv_view, select_common_kernel_block_size


@dataclass
class PlannedStep:
    """A step planned for one shard: the backend's plan and the device copies every layer reuses."""

    plan: ShardStepPlan
    attn_metadata: Any
    replica_slots: torch.Tensor | None
    pieces: torch.Tensor
    rows: torch.Tensor | None
    """(R,) int64 on the device, None = all T rows."""
    scale_writes: PageScaleWrites | None = None
    """Dynamic fp8 scales: the pages this step writes (grown per layer before the write)."""
    copies: torch.Tensor | None = None
    """[C, 2] int64 on the device: pages each layer copies before its KV update (copy on write)."""
    prefix_pass: PrefixPass | None = None
    """Shared prefixes read once per layer (attention/cascade_plan.py); None: none."""
    prefix_shift: torch.Tensor | None = None
    """With ``prefix_pass``: (B,) int64 on the CPU, the keys it reads of each request (CascadeSplit.shift)."""
    graphs: DecodeGraphs | None = None
    """Set when every layer replays a captured CUDA graph (cluster.decode_graphs): outputs then live in the
    graphs' buffers until that layer replays again."""
    runner: "ShardLayerRunner | None" = None
    """The runner that planned the step and runs its layers: the prefill backend's for a prefill step (any
    sequence with more than one new token), else the runner asked (the decode backend's)."""
    new_tokens_only: NewTokensStep | None = None
    """Set when no query of the step has a key on this shard from before it (a prefill from empty): each layer
    writes its K/V and runs the causal pieces alone (cluster/new_tokens.py), without a context pass over all T
    queries (its out 0 / lse -inf would change nothing in the merge) or the merge itself; ``compact``: q, k, v come
    as this rank's own message, never expanded to T rows."""


def lse_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSEs travel in float32 (float64 for a float64 service, so the oracle comparison stays exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ShardLayerRunner:
    """One shard's layers on its KV cache with the decode backend ``backend_cls`` and, when ``prefill_backend_cls``
    is another backend (select_prefill_backend), a second runner of that backend on the same cache that plans
    and runs every prefill step. Both see the cache through one kernel page size both accept."""

    def __init__(self, config: ServiceConfig, backend_cls, kv_caches: list[torch.Tensor], device: torch.device,
                 kv_scales: list[torch.Tensor] | None = None, prefill_backend_cls=None,
                 kernel_block_size: int | None = None):
        self.config = config
        self.backend = backend_cls
        self.kv_caches = kv_caches
        self.kv_format = config.kv_cache_format if is_fp8(config.kv_cache_format) else None
        self.kv_scales = kv_scales
        """fp8 caches: per layer [2, num_blocks, Hk] float32 page scales (owned by the shard; dynamic ones grow
        on write, page by page: cpattn/kvstore/fp8.py)."""
        if self.kv_format is not None and kv_scales is None:
            raise CpattnError(f"an {self.kv_format} KV cache needs its scales: pass kv_scales")
        self.device = device
        self.dtype = config.torch_dtype
        self.lse_dtype = lse_wire_dtype(self.dtype)
        both = [backend_cls] + ([prefill_backend_cls] if prefill_backend_cls not in (None, backend_cls) else [])
        self.kernel_block_size = kernel_block_size or select_common_kernel_block_size(
            config.block_size, [b.get_supported_kernel_block_sizes() for b in both])
        spec = AttentionSpec(config.num_q_heads, config.num_kv_heads, config.head_size, self.dtype,
                             self.kernel_block_size, str(device), tuple(config.layer_windows()),
                             tuple(config.layer_soft_caps()), self.kv_format or "auto")
        self.builder = backend_cls.get_builder_cls()(spec)
        self.impl = backend_cls.get_impl_cls()(spec)
        # Forks in one step share prefix pages: read them once (cascade). TORCH does it inside its own loop;
        # others get the split of cascade_plan.py, which windows cannot use (their key ranges start at 0).
        self.split_prefixes = (not getattr(backend_cls, "reads_shared_prefix_once", False)
                               and not any(w is not None for w in config.layer_windows()))
        self._prefix_builder = None   # its own builder: a FlashInfer builder's wrappers hold one plan each
        self._splitter = PrefixSplitter(self.kernel_block_size)
        self._prefix_kept: tuple | None = None   # (the prefix metadata of the last split, its PrefixPass)
        self._device_tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables_lock = threading.Lock()   # a shard plans its clients' steps on their own threads
        self.prefill_runner = None if len(both) == 1 else ShardLayerRunner(
            config, prefill_backend_cls, kv_caches, device, kv_scales, kernel_block_size=self.kernel_block_size)
        self.prefill_backend = both[-1]

    def new_graphs(self) -> DecodeGraphs | None:
        """A set of decode graphs for one caller that runs one step at a time (a client's connection), or
        None where graphs cannot serve; steps of concurrent callers must not share one set."""
        return DecodeGraphs(self) if DecodeGraphs.supported(self) else None

    def plan(self, plan: ShardStepPlan, graphs: DecodeGraphs | None = None, compact: bool = False) -> PlannedStep:
        """Once per step: the backend plans, and the step's index tensors move to the device once; with
        ``graphs`` (new_graphs()) a decode-only step is readied to replay them. A prefill step (a sequence with
        more than one new token) is planned and run by the prefill backend's runner, without graphs.
        ``compact``: a remote rank of a selected step, whose q, k, v are its own message's rows where the step
        runs new tokens only (``PlannedStep.new_tokens_only.compact``; wire_select.LayerReceiver asks)."""
        md = plan.metadata
        if self.prefill_runner is not None and md.max_query_len > 1:
            return self.prefill_runner.plan(plan, compact=compact)
        if self.kernel_block_size != self.config.block_size:
            # Slots are token addresses, identical under both page sizes; only the table changes.
            md.block_table_tensor = expand_block_table(md.block_table_tensor, self.config.block_size,
                                                       self.kernel_block_size)
        split = self._splitter.split(md) if self.split_prefixes else None
        if (split is None and graphs is not None and plan.rows is None and not plan.causal_pieces.numel()
                and self._prepared_from_host(md, plan, graphs)):
            copies = None if plan.page_copies is None else plan.page_copies.to(self.device)
            return PlannedStep(plan, graphs.static, None, plan.causal_pieces, None, copies=copies, graphs=graphs,
                               runner=self)
        prefix_pass = None
        if split is not None:
            md = split.suffix
            prefix_pass = self._plan_prefix(split)
        attn_md = self.builder.build(0, self._to_device(md))
        replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(self.device)
        rows = None if plan.rows is None else plan.rows.to(self.device)
        if graphs is not None and not graphs.prepare(attn_md, replica, plan.causal_pieces, rows, prefix_pass):
            graphs = None
        new_only = None
        # A prefill rank given no causal piece (a remote rank whose wire costs more than its share) only writes.
        if (graphs is None and prefix_pass is None and md.max_seq_len == 0
                and (plan.causal_pieces.numel() or md.max_query_len > 1) and covers_rows(plan)):
            new_only = plan_new_tokens(plan, compact)
        scale_writes = None
        if self.kv_format is not None and self.config.kv_scales is None and graphs is None:   # graphs grow their own
            slot_arrays = ([md.slot_mapping, plan.replica_slot_mapping] if new_only is None else
                           [new_only.slots, new_only.replica_slots])   # the rows of the k/v each layer gets
            scale_writes = PageScaleWrites([s for s in slot_arrays if s is not None], self.config.block_size,
                                           self.device)
        copies = None if plan.page_copies is None else plan.page_copies.to(self.device)
        if new_only is not None:
            new_only = new_only.to(self.device)
            replica = new_only.replica_slots
        return PlannedStep(plan, attn_md, replica, plan.causal_pieces, rows, scale_writes, copies, prefix_pass,
                           None if split is None else split.shift, graphs, self, new_only)

    def _prepared_from_host(self, md, plan: ShardStepPlan, graphs: DecodeGraphs) -> bool:
        """A decode step in the bucket ``graphs`` captured (a decode run's later steps): its buffers filled from the
        host values, no plan built (DecodeGraphs.prepare_from_host); False: plan it as any step."""
        if graphs.key is None:
            return False
        on_device = self._to_device(md)
        return graphs.prepare_from_host(on_device, on_device.block_table_tensor, plan.replica_slot_mapping)

    def _plan_prefix(self, split) -> PrefixPass:
        """The prefix pass of a split step: the backend's plan, and where its impl can merge into the suffix pass's
        rows itself (attend_into_rows) the plan for that. A decode run's steps bring the same prefix metadata
        (PrefixSplitter keeps it): its pass is planned and moved to the device once, not per step (~25 copies and
        launches on a GPU host, most of a forked step's extra time to open)."""
        kept = self._prefix_kept
        if kept is not None and kept[0] is split.prefix:
            return kept[1]
        prefix_pass = self._build_prefix(split)
        self._prefix_kept = (split.prefix, prefix_pass)   # one tuple, replaced whole (a shard's clients' threads)
        return prefix_pass

    def _build_prefix(self, split) -> PrefixPass:
        if self._prefix_builder is None:
            self._prefix_builder = type(self.builder)(self.builder.spec)
        plan = self._prefix_builder.build(0, self._to_device(split.prefix))
        into = getattr(self._prefix_builder, "into_step_rows", None)
        fused = into(plan, split.rows) if into is not None and hasattr(self.impl, "attend_into_rows") else None
        return PrefixPass(plan if fused is None else fused, split.rows.to(self.device), consecutive_start(split.rows),
                          fused is not None)

    def _to_device(self, md):
        """What the builder plans from: the block table on the device, its copy kept while the next step brings the
        same table (a decode run's steps share one; the cascade's shifted tables are kept by PrefixSplitter): a
        16 x 16K table is 2 MB per step otherwise. The step's small index tensors (query starts, lengths, slots)
        stay on the CPU: every builder plans from host values and copies what its kernels read itself, without
        blocking; ``md.to(device)`` made three blocking copies and the builders' ``bool(slots >= 0)`` a read back,
        each a wait for the device on every step (issue 18)."""
        table = md.block_table_tensor
        key = (id(table), table._version)
        with self._tables_lock:
            entry = self._device_tables.get(key)
            if entry is None:   # the CPU tensor is kept with its copy (so its id stays unique, and the copy made
                # without blocking reads it after this returns) while the entry lives
                entry = self._device_tables[key] = (table, table.to(self.device, non_blocking=True))
                while len(self._device_tables) > 4:   # a plain or suffix table and a prefix table, and the last run's
                    self._device_tables.pop(next(iter(self._device_tables)))
        return replace(md, block_table_tensor=entry[1], block_table_cpu=table)

    def run_layer(self, step: PlannedStep, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor,
                  v_TKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV update, then this shard's partial: out [R, Q, D] (activation dtype), natural-log lse [R, Q].

        No host synchronisation and no Python work that grows with T: every index was planned.
        """
        if step.runner is not None and step.runner is not self:
            return step.runner.run_layer(step, layer, q_TQD, k_TKD, v_TKD)   # a prefill step: its backend's runner
        if step.copies is not None:
            copy_pages(self.kv_caches[layer], step.copies)   # copy on write: before this layer's KV update
            if self.kv_format is not None:   # an fp8 page's scales go with its bytes ([2, pages, Hk] per layer)
                scale = self.kv_scales[layer]
                scale.index_copy_(1, step.copies[:, 1], scale.index_select(1, step.copies[:, 0]))
        if step.graphs is not None:
            return step.graphs.run(layer, q_TQD, k_TKD, v_TKD)
        scale = None
        if self.kv_format is not None:
            scale = self.kv_scales[layer]
            if step.scale_writes is not None:
                # Dynamic scales, page by page: a page's scale depends only on the tokens written into it.
                step.scale_writes.grow(self.kv_caches[layer], scale, k_TKD, v_TKD, self.kv_format)
        if step.replica_slots is not None:
            write_kv_cache_fast(self.kv_caches[layer], k_TKD, v_TKD, step.replica_slots, scale)
        if step.new_tokens_only is not None:
            return self._new_tokens_only(step, layer, q_TQD, k_TKD, v_TKD, scale)
        kv_cache = kernel_kv_view(self.kv_caches[layer], self.config.block_size, self.kernel_block_size)
        extra = {} if scale is None else {"kv_scale": scale}
        out, lse = self.impl.forward(layer, q_TQD, k_TKD, v_TKD, kv_cache, step.attn_metadata, **extra)
        lse = to_natural_lse(lse.to(self.lse_dtype), self.backend.lse_base)
        if step.prefix_pass is not None:   # after the pass above wrote the new K/V; its plan writes nothing
            out, lse = self.attend_prefix(layer, step.prefix_pass, q_TQD, k_TKD, v_TKD, kv_cache, out, lse, extra)
        if step.pieces.numel():
            new_out, new_lse = self.impl.forward_new_tokens(q_TQD, k_TKD, v_TKD, step.pieces, layer=layer)
            out, lse = merge_partials(torch.stack([out, new_out.to(out.dtype)]),
                                      torch.stack([lse, new_lse.to(self.lse_dtype)]))
        if step.rows is not None:
            out, lse = out.index_select(0, step.rows), lse.index_select(0, step.rows)
        return out.to(self.dtype), lse.to(self.lse_dtype)

    def _new_tokens_only(self, step: PlannedStep, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor,
                         v_TKD: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with no context on this shard: the KV update (the backends' own, which the replica writes use
        too; slots are token addresses under any page size), then the causal pieces, the computed rows only.
        q/k/v: the step's T rows, or (compact) this rank's own message's rows."""
        new = step.new_tokens_only
        write_kv_cache_fast(self.kv_caches[layer], k_TKD, v_TKD, new.slots, scale)
        if not new.pieces.numel():   # no row to compute
            empty = q_TQD.new_zeros((0,) + tuple(q_TQD.shape[1:]), dtype=self.dtype)
            return empty, empty.new_zeros((0, q_TQD.shape[1]), dtype=self.lse_dtype)
        out, lse = self.impl.forward_causal_pieces(q_TQD, k_TKD, v_TKD, new.pieces, layer=layer)   # rows in order
        return out.to(self.dtype), lse.to(self.lse_dtype)

    def attend_prefix(self, layer: int, prefix_pass: PrefixPass, q_TQD: torch.Tensor, k_TKD: torch.Tensor,
                      v_TKD: torch.Tensor, kv_cache: torch.Tensor, out_TQD: torch.Tensor, lse_TQ: torch.Tensor,
                      extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefixes' pass merged into the suffix pass's rows of ``out_TQD`` / natural-log ``lse_TQ`` in
        place (returns them): eager and graphed alike. One merge per layer either way (the backend's own, or
        merge_prefix_rows of its output)."""
        rows = prefix_pass.rows
        if prefix_pass.into_rows:   # TRITON: its split partials and the suffix partial in one merge, q read in place
            self.impl.attend_into_rows(layer, q_TQD, kv_cache, prefix_pass.plan, rows, out_TQD, lse_TQ, **extra)
            return out_TQD, lse_TQ
        r = rows.numel()
        q = q_TQD.index_select(0, rows) if prefix_pass.q_start is None else q_TQD.narrow(0, prefix_pass.q_start, r)
        # The pass writes nothing (its slots are all PAD), so any R rows of k / v serve: views, not gathers.
        p_out, p_lse = self.impl.forward(layer, q, k_TKD.narrow(0, 0, r), v_TKD.narrow(0, 0, r), kv_cache,
                                         prefix_pass.plan, **extra)
        return merge_prefix_rows(out_TQD, lse_TQ, rows, p_out, p_lse, self.backend.lse_base)

