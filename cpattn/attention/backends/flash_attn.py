"""FLASH_ATTN backend: whichever FlashAttention generation is installed and valid, natural-log LSE.

Legend: T tokens, Q query heads, K kv heads, D head size, B requests, W block-table width.
Generations, newest first (the first valid one runs; the choice is logged by the selector):
- FA4  flash-attn-4: ``flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=,
       seqused_k=, page_table=, causal=, return_lse=True)``; SM90 / SM100; LSE [Q, T].
- FA3  flash-attn hopper build: ``flash_attn_interface.flash_attn_varlen_func(..., seqused_k=,
       page_table=, return_attn_probs=True)``; SM90 only; LSE [Q, T].
- FA2  flash-attn 2: ``flash_attn.flash_attn_varlen_func(..., block_table=, return_attn_probs=True)``;
       SM80+; paged KV needs pages that are a multiple of 256; LSE [Q, T].
One varlen call serves the whole step (decodes and prefills alike). Causal in both metadata modes:
causal=True asks FlashAttention for its causal mask, which every generation aligns bottom-right
(query j of a request with L keys and n queries sees keys [0, L - n + j]) - exactly our rule;
causal=False (a DCP context partial) is a plain non-causal call. Requests with no key get out 0,
lse -inf, fixed up after the call since generations disagree on that corner.

Layers with a sliding window run on TRITON's kernels (planned beside, once per step, on the same cache): a window on
global positions covers a different number of a DCP shard's interleaved local keys for every query, and
FlashAttention's ``window_size`` is one count per call (no per-query start, no mask), while TRITON's kernels take
each query's first key. So a model with windowed and full layers (Gemma-2/3, Mistral's) keeps FlashAttention for
its full layers; TRITON reads an fp8 cache's pages itself and skips pages wholly before a window.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, AttentionSelectorConfig)
from cpattn.attention.backends.triton_attn import TritonAttentionBackend, write_kv_cache_fast
from cpattn.attention.ops.head_size import HEAD_SIZE_RULE, head_size_ok
from cpattn.attention.ops.lse import LseBase
from cpattn.attention.ops.partials import unattended_rows
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.kvstore import MultipleOf
from cpattn.kvstore.fp8 import dequantize_pages

logger = logging.getLogger("cpattn.attention")

GENERATIONS = ("FA4", "FA3", "FA2")
PAGE_MULTIPLE = {"FA4": 16, "FA3": 16, "FA2": 256}


def _import_generation(gen: str):
    """The varlen function of ``gen`` or raise ImportError."""
    if gen == "FA4":
        return importlib.import_module("flash_attn.cute").flash_attn_varlen_func
    if gen == "FA3":
        return importlib.import_module("flash_attn_interface").flash_attn_varlen_func
    module = importlib.import_module("flash_attn")
    if not hasattr(module, "flash_attn_varlen_func"):
        raise ImportError("flash_attn has no flash_attn_varlen_func (only flash-attn-4's cute package?)")
    return module.flash_attn_varlen_func


def _package_version(gen: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in {"FA4": ("flash-attn-4", "fa4"), "FA3": ("flash-attn-3", "flash_attn_3", "flash-attn"),
                 "FA2": ("flash-attn", "flash_attn")}[gen]:
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown version"


def generation_reasons(gen: str, config: AttentionSelectorConfig) -> list[str]:
    """Why ``gen`` cannot serve ``config`` ([] when it can)."""
    reasons = []
    try:
        fn = _import_generation(gen)
    except Exception as exc:   # a broken install raises more than ImportError
        reasons.append(f"not installed ({type(exc).__name__}: {exc})")
    else:
        if config.logits_soft_cap and not _takes(fn, "softcap"):
            reasons.append(f"{_package_version(gen)} has no softcap argument (flash-attn >= 2.6 has)")
    cap = config.device_capability
    if cap is not None:
        if gen == "FA4" and cap[0] not in (9, 10, 11):
            reasons.append(f"needs SM90/SM100 (compute capability 9.x/10.x), device has {cap}")
        if gen == "FA3" and cap[0] != 9:
            reasons.append(f"needs SM90 (Hopper), device has {cap}")
        if gen == "FA2" and cap < (8, 0):
            reasons.append(f"needs compute capability >= 8.0, device has {cap}")
    if config.block_size % PAGE_MULTIPLE[gen]:
        reasons.append(f"page size {config.block_size} is not a multiple of {PAGE_MULTIPLE[gen]}")
    if not head_size_ok(config.head_size):
        reasons.append(f"head_size {config.head_size} not supported (must be {HEAD_SIZE_RULE})")
    return reasons


def _takes(fn, argument: str) -> bool:
    """``fn`` accepts ``argument`` by name (or its signature cannot be read: let the call decide)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return argument in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def select_generation(config: AttentionSelectorConfig) -> tuple[str | None, dict[str, list[str]]]:
    """The first valid generation, and every generation's reasons."""
    rejected = {}
    for gen in GENERATIONS:
        reasons = generation_reasons(gen, config)
        if not reasons:
            return gen, rejected
        rejected[gen] = reasons
    return None, rejected


def _config_of(spec) -> AttentionSelectorConfig:
    from cpattn.attention.backend import DTYPE_NAMES

    dev = torch.device(spec.device)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
    return AttentionSelectorConfig(head_size=spec.head_size, dtype=DTYPE_NAMES.get(spec.dtype, str(spec.dtype)),
                                   kv_cache_dtype="auto", block_size=spec.block_size,
                                   num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
                                   device_type=dev.type, device_capability=cap,
                                   logits_soft_cap=any(c is not None for c in spec.logits_soft_caps))


@dataclass
class FlashAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    """(T,) int64, device."""
    has_writes: bool
    """Some new token's K/V lives on this rank (else the KV update launches nothing)."""
    cu_seqlens_q: torch.Tensor
    """(B + 1,) int32, device."""
    seqused_k: torch.Tensor
    """(B,) int32, device: keys per request."""
    cu_seqlens_k: torch.Tensor
    """(B + 1,) int32, device: cumsum of seqused_k (FA2 takes lengths this way)."""
    page_table: torch.Tensor
    """(B, W) int32, device; padding clamped to page 0 (never read past seqused_k)."""
    max_query_len: int
    max_seq_len: int
    causal: bool
    empty_rows: torch.Tensor | None
    """(T,) bool, device: tokens of requests with no key; None when there are none."""
    windowed: object | None = None
    """The step's TRITON metadata for the windowed layers (None without windows)."""
    page_table_cpu: torch.Tensor | None = None
    """(B, W) int64, host, -1 beyond a request's pages: for an fp8 cache's dequantised pages (planned once per
    step without a device sync); None only where the metadata was built on the device."""
    fp8_pages: tuple[torch.Tensor, torch.Tensor] | None = None
    """An fp8 cache: (the step's distinct pages [U] int64, the page table renumbered into them [B, W] int32), both
    on the device; made by the step's first layer, reused by the others."""


def _has_windows(spec) -> bool:
    return any(w is not None for w in spec.sliding_windows)


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, spec):
        super().__init__(spec)
        self._windows = None   # TRITON's builder, for the windowed layers (the module's docstring says why)
        if _has_windows(spec):
            self._windows = TritonAttentionBackend.get_builder_cls()(spec)

    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        dev = torch.device(self.spec.device)
        seq = common.seq_lens_cpu.to(torch.int64)
        q_lens = common.query_lens_cpu.to(torch.int64)
        cu_k = torch.zeros(seq.numel() + 1, dtype=torch.int64)
        cu_k[1:] = torch.cumsum(seq, 0)
        empty_req = (seq == 0) & (q_lens > 0)
        empty_rows = (torch.repeat_interleave(empty_req, q_lens).to(dev, non_blocking=True)
                      if bool(empty_req.any()) else None)
        i32 = torch.int32
        table = common.block_table_tensor.clamp(min=0)
        return FlashAttentionMetadata(
            num_tokens=common.num_actual_tokens, slot_mapping=common.slot_mapping.to(dev, non_blocking=True),
            has_writes=bool((common.slots_on_host() >= 0).any()),
            cu_seqlens_q=common.query_start_loc_cpu.to(i32).to(dev, non_blocking=True),
            seqused_k=seq.to(i32).to(dev, non_blocking=True), cu_seqlens_k=cu_k.to(i32).to(dev, non_blocking=True),
            page_table=table.to(dev, non_blocking=True).to(i32).contiguous(),
            max_query_len=max(common.max_query_len, 1), max_seq_len=max(common.max_seq_len, 1),
            causal=common.causal, empty_rows=empty_rows,
            windowed=None if self._windows is None else self._windows.build(common_prefix_len, common),
            page_table_cpu=common.block_table_tensor if table.device.type == "cpu" else common.block_table_cpu)


class FlashAttentionImpl(AttentionImpl):
    """Resolves its generation once, at construction, from the spec's device, page size and head size."""

    def __init__(self, spec):
        super().__init__(spec)
        gen, rejected = select_generation(_config_of(spec))
        if gen is None:
            from cpattn.errors import BackendUnavailableError

            raise BackendUnavailableError("no FlashAttention generation can serve this layer",
                                          {f"FLASH_ATTN/{g}": r for g, r in rejected.items()})
        self.generation = gen
        self._fn = _import_generation(gen)
        logger.info("FLASH_ATTN runs %s (%s)", gen, _package_version(gen))
        self._windows = None   # TRITON's impl, for the windowed layers (the module's docstring says why)
        if _has_windows(spec):
            self._windows = TritonAttentionBackend.get_impl_cls()(spec)
            logger.info("FLASH_ATTN's windowed layers run on TRITON's kernels")

    def _call(self, q, k, v, *, cu_seqlens_q, max_q, causal, seqused_k=None, cu_seqlens_k=None, max_k=None,
              page_table=None, soft_cap=None):
        """One varlen call in whatever form this generation takes; returns (out [T,Q,D], lse [Q,T]).
        ``soft_cap``: every generation's ``softcap`` (scaled logits s -> cap * tanh(s / cap))."""
        scale = self.spec.scale
        cap = {} if soft_cap is None else {"softcap": soft_cap}
        if self.generation == "FA4":
            res = self._fn(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q,
                           max_seqlen_k=max_k, seqused_k=seqused_k, page_table=page_table, softmax_scale=scale,
                           causal=causal, return_lse=True, **cap)
        elif self.generation == "FA3":
            res = self._fn(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q,
                           max_seqlen_k=max_k, seqused_k=seqused_k, page_table=page_table, softmax_scale=scale,
                           causal=causal, return_attn_probs=True, **cap)
        else:
            res = self._fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale, causal=causal,
                           return_attn_probs=True, block_table=page_table, **cap)
        return res[0], res[1]

    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        """``kv_scale`` [2, pages, Hk]: an fp8 cache's per-page scales. No generation reads fp8 pages with a scale
        each, so the step's pages are dequantised into a scratch in q's dtype (exact: kvstore.fp8.dequantize_pages)
        and the kernel reads that: the price is one read of the step's fp8 pages and one write in q's dtype per
        layer, small beside a prefill's attention (a chunk of 8K onto 512K keys: ~1 ms of ~120) but not beside a
        decode's (TRITON reads fp8 pages itself; auto keeps decode there)."""
        md: FlashAttentionMetadata = attn_metadata
        if self.spec.window(layer) is not None:
            return self._windows.forward(layer, q_TQD, k_TKD, v_TKD, kv_cache, md.windowed, kv_scale)
        if md.has_writes:
            write_kv_cache_fast(kv_cache, k_TKD, v_TKD, md.slot_mapping, kv_scale)
        page_table = md.page_table
        if kv_scale is not None:
            kv_cache, page_table = self._dequantized(kv_cache, kv_scale, md, q_TQD.dtype)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        cap = self.spec.soft_cap(layer)
        if self.generation == "FA2":
            out, lse_QT = self._call(q_TQD, k_cache, v_cache, cu_seqlens_q=md.cu_seqlens_q, max_q=md.max_query_len,
                                     causal=md.causal, cu_seqlens_k=md.cu_seqlens_k, max_k=md.max_seq_len,
                                     page_table=page_table, soft_cap=cap)
        else:
            out, lse_QT = self._call(q_TQD, k_cache, v_cache, cu_seqlens_q=md.cu_seqlens_q, max_q=md.max_query_len,
                                     causal=md.causal, seqused_k=md.seqused_k, max_k=md.max_seq_len,
                                     page_table=page_table, soft_cap=cap)
        lse = _to_TQ(lse_QT, q_TQD.shape[0])
        if md.empty_rows is not None:
            out = out.masked_fill(md.empty_rows[:, None, None], 0.0)
            lse = lse.masked_fill(md.empty_rows[:, None], -math.inf)
        return out, lse

    @staticmethod
    def _dequantized(kv_cache, kv_scale, md: FlashAttentionMetadata, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp8 cache's pages this step reads, as ``dtype`` pages, and the page table renumbered into them."""
        if md.fp8_pages is None:   # the step's first layer: the distinct pages, on the host (no device sync)
            table = md.page_table_cpu if md.page_table_cpu is not None else md.page_table.cpu()
            table = table.to(torch.int64).clamp(min=0)   # padding reads page 0, as the kernel's table does
            pages, renumbered = torch.unique(table, return_inverse=True)
            dev = kv_cache.device
            md.fp8_pages = (pages.to(dev, non_blocking=True),
                            renumbered.to(torch.int32).to(dev, non_blocking=True).contiguous())
        pages, table = md.fp8_pages
        return dequantize_pages(kv_cache, kv_scale, pages, dtype), table

    def forward_new_tokens(self, q_TQD, k_TKD, v_TKD, pieces_P3, layer=0):
        """Pieces as one varlen call over gathered (q, k) segments: queries [qs, qe) vs keys [ks, qe),
        causal bottom-right, so query qs + i sees keys [ks, qs + i]. A windowed layer: TRITON's."""
        if self.spec.window(layer) is not None:
            return self._windows.forward_new_tokens(q_TQD, k_TKD, v_TKD, pieces_P3, layer)
        if not q_TQD.is_cuda:
            return super().forward_new_tokens(q_TQD, k_TKD, v_TKD, pieces_P3, layer)
        t = q_TQD.shape[0]
        out, lse, pieces = unattended_rows(q_TQD, pieces_P3)
        if not pieces:
            return out, lse
        dev = q_TQD.device
        q_rows = torch.cat([torch.arange(qs, qe) for qs, qe, _ in pieces]).to(dev, non_blocking=True)
        k_rows = torch.cat([torch.arange(ks, qe) for _, qe, ks in pieces]).to(dev, non_blocking=True)
        q_lens = torch.tensor([qe - qs for qs, qe, _ in pieces])
        k_lens = torch.tensor([qe - ks for _, qe, ks in pieces])
        cu_q = torch.zeros(len(pieces) + 1, dtype=torch.int32)
        cu_q[1:] = torch.cumsum(q_lens, 0)
        cu_k = torch.zeros(len(pieces) + 1, dtype=torch.int32)
        cu_k[1:] = torch.cumsum(k_lens, 0)
        contiguous = len(pieces) == 1 and pieces[0][2] == 0 and pieces[0][0] == 0 and pieces[0][1] == t
        q = q_TQD if contiguous else q_TQD.index_select(0, q_rows)
        k = k_TKD if contiguous else k_TKD.index_select(0, k_rows)
        v = v_TKD if contiguous else v_TKD.index_select(0, k_rows)
        o, l_QT = self._call(q, k, v, cu_seqlens_q=cu_q.to(dev, non_blocking=True), max_q=int(q_lens.max()), causal=True,
                             cu_seqlens_k=cu_k.to(dev, non_blocking=True), max_k=int(k_lens.max()),
                             soft_cap=self.spec.soft_cap(layer))
        if contiguous:
            return o, _to_TQ(l_QT, t)
        out.index_copy_(0, q_rows, o)
        lse.index_copy_(0, q_rows, _to_TQ(l_QT, q_rows.numel()))
        return out, lse

    def forward_causal_pieces(self, q_RQD, k_SKD, v_SKD, pieces_P4, layer=0):
        """A few pieces (a prefill rank's share): one kernel call each, straight on slices of q and k (views: no
        gather, no full-size output; a remote rank's compact message as it arrived). Many: the default. A windowed
        layer: TRITON's."""
        if self.spec.window(layer) is not None:
            return self._windows.forward_causal_pieces(q_RQD, k_SKD, v_SKD, pieces_P4, layer)
        pieces = [p for p in pieces_P4.tolist() if p[1] > p[0]]
        if not q_RQD.is_cuda or not pieces or len(pieces) > MAX_PIECE_CALLS:
            return super().forward_causal_pieces(q_RQD, k_SKD, v_SKD, pieces_P4, layer)
        outs, lses = [], []
        for qs, qe, ks, ke in pieces:
            o, l_QT = self._call(q_RQD[qs:qe], k_SKD[ks:ke], v_SKD[ks:ke], cu_seqlens_q=_cu_seqlens(qe - qs, q_RQD),
                                 max_q=qe - qs, causal=True, cu_seqlens_k=_cu_seqlens(ke - ks, q_RQD), max_k=ke - ks,
                                 soft_cap=self.spec.soft_cap(layer))
            outs.append(o)
            lses.append(_to_TQ(l_QT, qe - qs))
        return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))


MAX_PIECE_CALLS = 4
"""forward_causal_pieces makes one call per piece up to this many pieces (large ones: a rank's causal share)."""


def _cu_seqlens(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([0, n], dtype=torch.int32).to(like.device, non_blocking=True)


def _to_TQ(lse: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """FlashAttention's varlen LSE is [Q, T] (FA2 may pad T); ours is [T, Q] float32."""
    if lse.dim() == 3:                       # [1, Q, T] from some builds
        lse = lse[0]
    if lse.shape[-1] != num_tokens and lse.shape[0] == num_tokens:
        return lse.float().contiguous()
    return lse[:, :num_tokens].t().float().contiguous()


class FlashAttentionBackend(AttentionBackend):
    name = "FLASH_ATTN"
    impl_cls = FlashAttentionImpl
    builder_cls = FlashAttentionMetadataBuilder
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)
    supported_head_sizes = None
    min_capability = (8, 0)
    lse_base = LseBase.E
    can_return_lse = True
    supports_pcp = True
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    supports_logits_soft_cap = True          # every generation's softcap argument
    # fp8 pages are dequantised per layer into a scratch the kernel reads (forward): no generation takes a scale
    # per page (FA4 has no fp8 KV; FA3's takes one descale per sequence and kv head).
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    # Windowed layers run on TRITON's kernels (the module's docstring says why); availability needs them then.
    supports_sliding_window = True
    # Timed: a chunk of 8K onto 512K of a model whose every other layer has a 4,096 window, 75.2 ms/layer with
    # FLASH_ATTN prefilling vs 140.0 with TRITON (one H200, 2026-12-05, RESULTS.md "Session 22").
    auto_prefill_with_windows = True

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        installed = [g for g in GENERATIONS if _installed(g)]
        return [MultipleOf(min((PAGE_MULTIPLE[g] for g in installed), default=16))]

    @classmethod
    def kernel_version(cls) -> str:
        installed = [g for g in GENERATIONS if _installed(g)]
        if not installed:
            return "no FlashAttention generation installed"
        return ", ".join(f"{g} ({_package_version(g)})" for g in installed) + " installed; first valid runs"

    @classmethod
    def availability(cls, config: AttentionSelectorConfig) -> list[str]:
        reasons = []
        if config.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available in this process")
        gen, rejected = select_generation(config)
        if gen is None:
            reasons.extend(f"{g}: {'; '.join(r)}" for g, r in rejected.items())
        if config.sliding_window:
            reasons.extend(f"sliding_window layers run on TRITON's kernels, which cannot run here: {r}"
                           for r in TritonAttentionBackend.availability(config))
        return reasons


def _installed(gen: str) -> bool:
    try:
        _import_generation(gen)
    except Exception:
        return False
    return True
