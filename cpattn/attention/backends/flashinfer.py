"""FLASHINFER backend: FlashInfer's paged decode and prefill wrappers, base-2 LSE.

Legend: T tokens, Q query heads, K kv heads, D head size, B requests.
plan() once per step, run() per layer: the builder turns the block table into FlashInfer's CSR page
table (``paged_kv_indptr / indices / last_page_len``), moves decodes (one query) before prefills
with one permutation (``batch_split``), and plans a BatchDecode wrapper on the decode prefix and a
BatchPrefill wrapper (causal as the metadata says; FlashInfer aligns the mask bottom-right) on the
rest, once per soft cap some layer uses (the cap is a plan() argument). Requests with no readable key (a DCP shard
that holds none of a sequence yet) are left out of both plans: their rows are out 0, lse -inf. The impl permutes q,
runs both wrappers with ``return_lse`` and writes the outputs back in request order. A layer with a sliding window
runs its own plans (flashinfer_windows: a window on global positions covers a different number of a DCP shard's
local keys for each query, and FlashInfer's window_left is one count per plan), planned once per step per window.

An fp8 cache: FlashInfer's fp8 KV takes one k_scale / v_scale per call, and cpattn's pages each carry their own
(so no tenant's values change another's), so, as FLASH_ATTN does, the step's distinct pages are dequantised per layer
into a scratch in q's dtype (exact: kvstore.fp8.dequantize_pages) and the wrappers are planned on that scratch's
page numbers (found once per step on the host). The price is one read of the step's fp8 pages and one write in q's
dtype per layer: small beside a prefill's attention, not beside a decode's (TRITON reads fp8 pages itself).

FlashInfer reports LSE in base 2 (log2 sum 2^(s log2 e)), measured on an H200 with 0.7.2.
flashinfer is imported lazily: the module imports on machines without it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, AttentionSelectorConfig)
from cpattn.attention.batch_split import split_decodes_and_prefills
from cpattn.attention.backends.flashinfer_windows import packed_mask, plan_inputs, window_groups
from cpattn.attention.backends.triton_attn import write_kv_cache_fast
from cpattn.attention.ops.lse import LseBase
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.kvstore import block_table_to_csr
from cpattn.kvstore.fp8 import dequantize_pages, is_fp8

WORKSPACE_BYTES = 256 * 1024 * 1024
_workspaces: dict[str, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    """One zero-initialized float workspace per device, shared by every wrapper (they run in turn)."""
    key = str(device)
    if key not in _workspaces:
        _workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[key]


@dataclass
class FlashInferMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    """(T,) int64, device."""
    token_order: torch.Tensor | None
    """(Ta,) int64, device: planned token j is step token token_order[j]; None = identity over all T."""
    num_decode_tokens: int
    num_prefill_tokens: int
    decode_wrapper: dict
    """Soft cap (None = none) -> the decode wrapper planned with it, for every cap some layer uses; {} = none."""
    prefill_wrapper: dict
    """Soft cap -> the prefill wrapper planned with it; {} = no prefill."""
    fp8_pages: torch.Tensor | None = None
    """An fp8 cache: (U,) int64, device, the step's distinct pages in the order the plans number them (page u of
    the layer's dequantised scratch is cache page fp8_pages[u]); None otherwise."""
    window_plans: dict = field(default_factory=dict)
    """(soft cap, window) -> [(wrapper, (t,) int64 device: the step rows of its queries)]: a windowed layer's plans
    (flashinfer_windows); rows in none of them see no key here."""


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Owns the wrappers, two per soft cap some layer uses and two per plan of a windowed layer (FlashInfer takes
    the cap and window_left in plan(); their int workspaces and pinned buffers live across steps)."""

    def __init__(self, spec):
        super().__init__(spec)
        self._by_cap: dict = {}

    def _pairs(self) -> list:
        """(soft cap, window) of every layer, once each (a plan serves one cap; a window its own plans)."""
        spec = self.spec
        pairs = {(spec.soft_cap(l), spec.window(l))
                 for l in range(max(len(spec.logits_soft_caps), len(spec.sliding_windows), 1))}
        return sorted(pairs, key=lambda p: tuple(-1.0 if x is None else x for x in p))

    def _wrappers(self, key):
        """The decode and prefill wrappers of ``key`` (a soft cap; or (cap, window, kind, ordinal) for windows)."""
        import flashinfer

        if key not in self._by_cap:
            dev = torch.device(self.spec.device)
            ws = _workspace(dev)
            self._by_cap[key] = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD"),
                                 flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD"))
        return self._by_cap[key]

    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> FlashInferMetadata:
        spec = self.spec
        dev = torch.device(spec.device)
        pairs = self._pairs()
        fp8 = is_fp8(spec.kv_cache_dtype)
        ps = spec.block_size
        plain = [cap for cap, window in pairs if window is None]
        windowed = {}    # (cap, window) -> [(kind, window_left, plan inputs)], page ids still the cache's
        # The host table (no device sync where the step kept it) for the windows' pages and an fp8 plan's renumbering.
        host_table = common.table_on_host().to(torch.int64) if fp8 or len(pairs) > len(plain) else None
        for window in sorted({w for _, w in pairs if w is not None}):
            groups = window_groups(common, window, ps)
            inputs = [(kind, left, plan_inputs(vrs, host_table, ps), vrs)
                      for (kind, left), vrs in groups.by_plan.items()]
            for cap, w in pairs:
                if w == window:
                    windowed[(cap, window)] = inputs
        split, req_order, token_order, identity = self._plain_order(common) if plain else (None, None, None, True)
        if plain:
            lens = common.seq_lens_cpu.to(torch.int64)[req_order]
            num_pages = (lens + ps - 1) // ps
            indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
            indptr[1:] = torch.cumsum(num_pages, 0)
            last_page_len = (lens - 1) % ps + 1
        fp8_pages = None
        if fp8:   # the plans read the scratch's pages 0..U-1: renumbered on the host
            read = [plan[2] for inputs in windowed.values() for _, _, plan, _ in inputs]
            if plain:
                _, pages_read, _ = block_table_to_csr(host_table[req_order], lens, ps)
                read.append(pages_read)
            pages = torch.unique(torch.cat(read)) if read else torch.zeros(0, dtype=torch.int64)
            fp8_pages = pages.to(dev, non_blocking=True)
            on_device = lambda ids: torch.searchsorted(pages, ids).to(torch.int32).to(dev, non_blocking=True)
            indices = on_device(pages_read) if plain else None
        else:
            on_device = lambda ids: ids.to(torch.int32).to(dev, non_blocking=True)
            indices = None
            if plain:
                table = common.block_table_tensor.to(dev, non_blocking=True)[req_order.to(dev)]
                _, indices, _ = block_table_to_csr(table, lens.to(dev), ps)
                indices = indices.to(torch.int32)
        i32 = torch.int32

        nd, ndt = (split.num_decodes, split.num_decode_tokens) if plain else (0, 0)
        decodes, prefills = {}, {}
        for cap in plain:
            decode, prefill = self._wrappers(cap)
            common_kwargs = self._kwargs(cap)
            if nd:
                decode.plan(indptr[:nd + 1].to(i32), indices[:int(indptr[nd])], last_page_len[:nd].to(i32),
                            spec.num_q_heads, spec.num_kv_heads, spec.head_size, ps, **common_kwargs)
                decodes[cap] = decode
            if split.num_prefills:
                p_indptr = indptr[nd:] - indptr[nd]
                prefill.plan(split.prefill_qo_indptr.to(i32), p_indptr.to(i32), indices[int(indptr[nd]):],
                             last_page_len[nd:].to(i32), spec.num_q_heads, spec.num_kv_heads, spec.head_size, ps,
                             causal=common.causal, **common_kwargs)
                prefills[cap] = prefill
        window_plans = {key: self._plan_windows(key, inputs, common.causal, on_device, dev)
                        for key, inputs in windowed.items()}
        return FlashInferMetadata(
            num_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping.to(dev, non_blocking=True),
            token_order=None if identity else token_order.to(dev, non_blocking=True),
            num_decode_tokens=ndt, num_prefill_tokens=split.num_prefill_tokens if plain else 0,
            decode_wrapper=decodes, prefill_wrapper=prefills, fp8_pages=fp8_pages, window_plans=window_plans)

    @staticmethod
    def _plain_order(common: CommonAttentionMetadata):
        """The full layers' request and token order: requests with a key and a query, decodes first (batch_split);
        (split, request order, token order, whether that order is the step's own)."""
        qsl = common.query_start_loc_cpu.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        active = torch.nonzero((q_lens > 0) & (common.seq_lens_cpu.to(torch.int64) > 0)).flatten()
        act_qsl = torch.zeros(active.numel() + 1, dtype=torch.int64)
        act_qsl[1:] = torch.cumsum(q_lens[active], 0)
        split = split_decodes_and_prefills(act_qsl, decode_threshold=1)
        if active.numel():
            act_tokens = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in active.tolist()])
            token_order = act_tokens[split.token_order]
        else:
            token_order = torch.zeros(0, dtype=torch.int64)
        identity = token_order.numel() == common.num_actual_tokens and bool(
            (token_order == torch.arange(token_order.numel())).all())
        return split, active[split.request_order], token_order, identity

    def jit_variants(self, prefill: bool = True, sharded: bool = True) -> list:
        """One call per FlashInfer module a step of this spec can plan, each planning it once on a one-page request.
        FlashInfer JIT-compiles a module per variant on its first plan (on a fresh node: a prefill module 65-90 s, a
        decode one 10-14 s), so a first step compiles its variants one after another; kernel_warmup runs these calls
        side by side first. A module is (wrapper, soft cap, window on or off, custom mask or not): a windowed layer
        plans without window_left where its window starts on a page boundary, and with a custom mask where no
        window_left fits (flashinfer_windows: only a DCP shard's chunks, so only when ``sharded``), so it may use all
        of them. ``prefill=False``: a decode backend beside another prefill backend plans decodes only (layer_runner)."""
        variants = set()
        for cap, window in self._pairs():
            lefts = (-1,) if window is None else (-1, window - 1)
            variants |= {("decode", cap, left, False) for left in lefts}
            if prefill:
                variants |= {("prefill", cap, left, False) for left in lefts}
                variants |= {("prefill", cap, -1, True)} if window is not None and sharded else set()
        # Prefill modules first: the longest builds started first end the pool soonest.
        return [functools.partial(self._plan_once, *v) for v in sorted(variants, key=lambda v: (v[0], repr(v)),
                                                                        reverse=True)]

    def _plan_once(self, kind: str, cap, left: int, masked: bool) -> None:
        """Plans one variant on fresh wrappers and a workspace of their own (the calls run side by side)."""
        import flashinfer

        spec, dev = self.spec, torch.device(self.spec.device)
        ints = lambda *x: torch.tensor(x, dtype=torch.int32, device=dev)
        workspace = torch.zeros(WORKSPACE_BYTES // 8, dtype=torch.uint8, device=dev)   # a one-page plan needs little
        geometry = (spec.num_q_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
        kwargs = dict(self._kwargs(cap), window_left=left)
        if kind == "decode":
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD").plan(
                ints(0, 1), ints(0), ints(1), *geometry, **kwargs)
        else:
            mask = dict(packed_custom_mask=torch.ones(1, dtype=torch.uint8, device=dev)) if masked else {}
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD").plan(
                ints(0, 1), ints(0, 1), ints(0), ints(1), *geometry, causal=not masked, **kwargs, **mask)

    def _kwargs(self, cap) -> dict:
        spec = self.spec
        kwargs = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.scale)
        if cap is not None:
            kwargs["logits_soft_cap"] = cap         # s -> cap * tanh(s / cap), the scaled logits
        return kwargs

    def _plan_windows(self, key, inputs, causal, on_device, dev) -> list:
        """One windowed layer's plans (flashinfer_windows): [(wrapper, the step rows of its queries on the device)]."""
        spec, i32 = self.spec, torch.int32
        cap, window = key
        plans = []
        for ordinal, (kind, left, (qo, indptr, ids, last, rows), vrs) in enumerate(inputs):
            decode, prefill = self._wrappers((cap, window, kind, ordinal))
            geometry = (spec.num_q_heads, spec.num_kv_heads, spec.head_size, spec.block_size)
            if kind == "decode":
                decode.plan(indptr.to(i32), on_device(ids), last.to(i32), *geometry, window_left=left,
                            **self._kwargs(cap))
                wrapper = decode
            elif kind == "prefill":
                prefill.plan(qo.to(i32), indptr.to(i32), on_device(ids), last.to(i32), *geometry, causal=causal,
                             window_left=left, **self._kwargs(cap))
                wrapper = prefill
            else:   # one request, its custom mask (packed here: flashinfer_windows says why)
                prefill.plan(qo.to(i32), indptr.to(i32), on_device(ids), last.to(i32), *geometry, causal=False,
                             packed_custom_mask=packed_mask(vrs[0], dev), **self._kwargs(cap))
                wrapper = prefill
            plans.append((wrapper, rows.to(dev, non_blocking=True)))
        return plans


class FlashInferImpl(AttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        """``kv_scale`` [2, pages, Hk]: an fp8 cache's per-page scales; the step's pages are read dequantised (the
        module's docstring says why)."""
        md: FlashInferMetadata = attn_metadata
        write_kv_cache_fast(kv_cache, k_TKD, v_TKD, md.slot_mapping, kv_scale)
        if kv_scale is not None:
            kv_cache = dequantize_pages(kv_cache, kv_scale, md.fp8_pages, q_TQD.dtype)
        paged = (kv_cache[0], kv_cache[1])
        cap, window = self.spec.soft_cap(layer), self.spec.window(layer)
        if window is not None:
            return self._windowed(q_TQD, paged, md.window_plans[(cap, window)])
        q = q_TQD if md.token_order is None else q_TQD.index_select(0, md.token_order)
        ndt = md.num_decode_tokens
        outs, lses = [], []
        if md.decode_wrapper:
            o, l = md.decode_wrapper[cap].run(q[:ndt], paged, return_lse=True)
            outs.append(o)
            lses.append(l)
        if md.prefill_wrapper:
            o, l = md.prefill_wrapper[cap].run(q[ndt:], paged, return_lse=True)
            outs.append(o)
            lses.append(l)
        if md.token_order is None:
            if len(outs) == 1:
                return outs[0], lses[0].float()
            return torch.cat(outs), torch.cat(lses).float()
        t, hq, d = q_TQD.shape
        out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.full((t, hq), -math.inf, dtype=torch.float32, device=q_TQD.device)
        if outs:
            out.index_copy_(0, md.token_order, torch.cat(outs) if len(outs) > 1 else outs[0])
            lse.index_copy_(0, md.token_order, (torch.cat(lses) if len(lses) > 1 else lses[0]).float())
        return out, lse

    @staticmethod
    def _windowed(q_TQD, paged, plans):
        """A windowed layer: each plan's queries gathered, run, written back; rows in no plan keep out 0, lse -inf."""
        t, hq, d = q_TQD.shape
        out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.full((t, hq), -math.inf, dtype=torch.float32, device=q_TQD.device)
        for wrapper, rows in plans:
            o, l = wrapper.run(q_TQD.index_select(0, rows), paged, return_lse=True)
            out.index_copy_(0, rows, o)
            lse.index_copy_(0, rows, l.float())
        return out, lse

    def forward_new_tokens(self, q_TQD, k_TKD, v_TKD, pieces_P3, layer=0):
        # FlashInfer's ragged prefill would be one more JIT module; the Triton prefill kernel serves
        # the causal part among new tokens on CUDA (it ships with every CUDA torch).
        if q_TQD.is_cuda:
            try:
                from cpattn.attention.backends.triton_attn import triton_ragged_causal
            except ImportError:
                pass
            else:
                return triton_ragged_causal(q_TQD, k_TKD, v_TKD, pieces_P3, self.spec.scale, self.spec.head_size,
                                            self.spec.window(layer), self.spec.soft_cap(layer))
        return super().forward_new_tokens(q_TQD, k_TKD, v_TKD, pieces_P3, layer)


class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    impl_cls = FlashInferImpl
    builder_cls = FlashInferMetadataBuilder
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)
    supported_head_sizes = (64, 128, 256)
    min_capability = (8, 0)
    lse_base = LseBase.TWO
    can_return_lse = True
    supports_pcp = True
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_logits_soft_cap = True          # plan(logits_soft_cap=): one plan per cap some layer uses
    # fp8 pages are dequantised per layer into a scratch the wrappers read (the module's docstring says why).
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True           # window_left per plan, a shard's per-query windows as virtual requests
    # Timed on one GPU: a windowed chunk of 8K onto 512K (W 4,096 on every layer), 3.63 ms/layer vs TRITON's 3.81
    # (one H200, 2026-12-05, RESULTS.md "Session 22"); its masked plans under DCP are exact there, not yet timed on 2.
    auto_prefill_with_windows = True

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [16, 32, 64]

    @classmethod
    def kernel_version(cls) -> str:
        try:
            import flashinfer
        except ImportError:
            return "flashinfer (not installed)"
        return f"flashinfer {flashinfer.__version__}"

    @classmethod
    def availability(cls, config: AttentionSelectorConfig) -> list[str]:
        reasons = []
        try:
            import flashinfer  # noqa: F401
        except ImportError as exc:
            reasons.append(f"flashinfer is not installed (pip install 'cpattn[flashinfer]'): {exc}")
        if config.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available in this process")
        return reasons
