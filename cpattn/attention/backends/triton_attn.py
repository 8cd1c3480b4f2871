"""TRITON backend: the project's own paged attention kernels (``triton_decode``, ``triton_prefill``, ``triton_kv_write``), natural-log LSE.

Legend: T tokens, Q query heads, K kv heads, D head size, B requests, S KV splits.
The builder sorts requests into decodes (one query: flash-decoding, split-KV so a single long
sequence fills the GPU) and prefills (tiled, causal with context or, in a DCP context partial, no
mask); no reorder of q/k/v is needed because both kernels address tokens by index. Triton is
imported only when a plan is built or availability is checked, so CPU installs import this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, AttentionSelectorConfig, write_kv_cache)
from cpattn.attention.ops.lse import LseBase
from cpattn.attention.ops.partials import unattended_rows
from cpattn.attention.backends.triton_graph_hooks import TritonGraphHooks
from cpattn.attention.backends.triton_query_groups import (attend_query_groups, into_step_rows, max_queries,
                                                          plan_query_groups)
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.kvstore import MultipleOf


@dataclass
class TritonAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    """(T,) int64, device: cache slot of each new token's K/V, -1 = not written here."""
    has_writes: bool
    """Some new token's K/V lives on this rank (else the KV update is skipped: no launch)."""
    decode_only: bool
    """Every request is a decode: decode tokens are rows 0 .. T-1 in order."""
    block_table: torch.Tensor
    """(B, W) int64, device: page ids."""
    # decode part (requests with one query)
    dec_tok: torch.Tensor
    """(Td,) int32: token row of each decode."""
    dec_req: torch.Tensor
    """(Td,) int32: its request."""
    dec_kv_len: torch.Tensor
    """(Td,) int32: keys it sees."""
    num_splits: int
    """S: KV splits of every decode (each token cuts its own keys into S whole tiles, on the device)."""
    # prefill part
    tiles: tuple[torch.Tensor, ...]
    """Four (num_tiles,) int32 tensors: request, first token, rows, first query index in request."""
    req_seq: torch.Tensor
    """(B,) int32: keys of each request (seq_lens)."""
    req_qlen: torch.Tensor
    """(B,) int32: queries of each request."""
    req_kv0: torch.Tensor
    """(B,) int32 zeros (paged keys start at page 0)."""
    causal: bool
    window_starts: dict = dataclasses.field(default_factory=dict)
    """Sliding window W -> (key_start (T,) int32 by token row, key_start of each decode (Td,) int32, S of the
    decodes under that window): first visible local key per query (CommonAttentionMetadata.window_key_start)."""
    query_groups: list = dataclasses.field(default_factory=list)
    """A context pass's few-query requests, all of a request's queries per program (triton_query_groups.py)."""


CONTEXT_DECODE_MAX_QUERIES = 16
"""Under sliding windows, a context pass's requests with at most this many queries use the decode kernel, one
program per query (TritonMetadataBuilder.build)."""


class TritonMetadataBuilder(TritonGraphHooks, AttentionMetadataBuilder):
    """Plans once per step: decode token lists and split count, prefill tiles."""

    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        from cpattn.attention.backends.triton_decode import decode_num_splits
        from cpattn.attention.backends.triton_prefill import make_prefill_tiles, prefill_block_sizes

        dev = torch.device(self.spec.device)
        qsl = common.query_start_loc_cpu.tolist()
        seq = common.seq_lens_cpu.tolist()
        q_lens = [qsl[r + 1] - qsl[r] for r in range(common.num_reqs)]
        # Every query of a context pass (causal=False) sees the same keys, so a request with a few queries goes
        # through the split-KV decode kernel (the prefill kernel would run one unsplit program per head over all
        # its keys): a shared prefix's pass of N forks' queries over a long prefix (cascade_plan.py). Without
        # windows all its queries share each program (triton_query_groups.py: one read of each tile); with
        # windows (key ranges per query) one program per query.
        windows = any(w is not None for w in self.spec.sliding_windows)
        most = max_queries(self.spec.num_q_heads, self.spec.num_kv_heads) if not common.causal and not windows else 1
        grouped = [r for r in range(common.num_reqs) if 1 < q_lens[r] <= most]
        few = CONTEXT_DECODE_MAX_QUERIES if not common.causal and windows else 1
        dec = [r for r in range(common.num_reqs) if 1 <= q_lens[r] <= few]
        pre = [r for r in range(common.num_reqs) if q_lens[r] > max(few, most)]
        dec_toks = [t for r in dec for t in range(qsl[r], qsl[r + 1])]
        dec_reqs = [r for r in dec for _ in range(q_lens[r])]
        i32 = dict(dtype=torch.int32)
        dec_kv = [seq[r] for r in dec_reqs]
        splits = (decode_num_splits(len(dec_toks), self.spec.num_kv_heads, max(dec_kv), dev)
                  if dec and max(dec_kv) > 0 else 1)
        block_m = prefill_block_sizes(self.spec.head_size)[0]
        tiles = make_prefill_tiles(pre, [qsl[r] for r in pre], [q_lens[r] for r in pre], block_m, dev)
        window_starts = {}
        for w in sorted({w for w in self.spec.sliding_windows if w is not None}):
            starts = common.window_key_start(w)
            dec_starts = starts[dec_toks]
            in_window = [max(0, kv - int(st)) for kv, st in zip(dec_kv, dec_starts.tolist())]
            w_splits = (decode_num_splits(len(dec_toks), self.spec.num_kv_heads, max(in_window), dev)
                        if dec and max(in_window) > 0 else 1)
            window_starts[w] = (starts.to(torch.int32).to(dev, non_blocking=True),
                                dec_starts.to(torch.int32).to(dev, non_blocking=True), w_splits)
        return TritonAttentionMetadata(
            num_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping.to(dev, non_blocking=True),
            has_writes=bool((common.slots_on_host() >= 0).any()),     # one check per step, not per layer
            decode_only=all(n == 1 for n in q_lens),   # tokens 0..T-1 in order, one per request (graphs rely on it)
            block_table=common.block_table_tensor.to(dev, non_blocking=True),
            dec_tok=torch.tensor(dec_toks, **i32).to(dev, non_blocking=True),
            dec_req=torch.tensor(dec_reqs, **i32).to(dev, non_blocking=True),
            dec_kv_len=torch.tensor(dec_kv, **i32).to(dev, non_blocking=True),
            num_splits=splits, tiles=tiles,
            req_seq=torch.tensor(seq, **i32).to(dev, non_blocking=True),
            req_qlen=torch.tensor(q_lens, **i32).to(dev, non_blocking=True),
            req_kv0=torch.zeros(common.num_reqs, **i32, device=dev),
            causal=common.causal, window_starts=window_starts,
            query_groups=plan_query_groups(qsl, q_lens, seq, grouped, self.spec.num_kv_heads, dev) if grouped else [])

    def into_step_rows(self, md: TritonAttentionMetadata, rows_R: torch.Tensor) -> TritonAttentionMetadata | None:
        """A cascade's prefix pass (``md``, over the step's rows ``rows_R``, CPU) planned to merge into the suffix
        pass's rows itself (TritonAttentionImpl.attend_into_rows); None unless the pass is query groups only."""
        if not md.query_groups or md.dec_tok.numel() or md.tiles[0].numel() or md.window_starts or md.has_writes:
            return None
        return dataclasses.replace(md, query_groups=into_step_rows(md.query_groups, rows_R, md.block_table.device))


class TritonAttentionImpl(AttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        from cpattn.attention.backends.triton_decode import paged_decode
        from cpattn.attention.backends.triton_prefill import prefill

        md: TritonAttentionMetadata = attn_metadata
        if md.has_writes:
            write_kv_cache_fast(kv_cache, k_TKD, v_TKD, md.slot_mapping, kv_scale)
        t, hq, d = q_TQD.shape
        out = torch.empty(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.empty(t, hq, dtype=torch.float32, device=q_TQD.device)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        window, cap = self.spec.window(layer), self.spec.soft_cap(layer)
        tok_starts, dec_starts, splits = None, None, md.num_splits
        if window is not None:
            tok_starts, dec_starts, splits = md.window_starts[window]
        features = dict(kv_scale=kv_scale, soft_cap=cap)
        paged_decode(q_TQD, k_cache, v_cache, md.block_table, md.dec_tok, md.dec_req, md.dec_kv_len,
                     splits, self.spec.scale, out, lse, all_rows=md.decode_only, key_start=dec_starts, **features)
        prefill(q_TQD, k_cache, v_cache, md.block_table, md.tiles, md.req_seq, md.req_qlen, md.req_kv0,
                md.causal, self.spec.scale, out, lse, key_start=tok_starts, **features)
        attend_query_groups(md.query_groups, q_TQD, k_cache, v_cache, md.block_table, self.spec.scale, out, lse,
                            **features)
        return out, lse

    def attend_into_rows(self, layer, q_TQD, kv_cache, attn_metadata, rows_R, out_TQD, lse_TQ, kv_scale=None):
        """A prefix pass of ``TritonMetadataBuilder.into_step_rows`` over the step's q, merged into the step's rows
        ``rows_R`` of ``out_TQD`` / natural-log ``lse_TQ`` in place: per query group its kernel and one merge."""
        md: TritonAttentionMetadata = attn_metadata
        attend_query_groups(md.query_groups, q_TQD, kv_cache[0], kv_cache[1], md.block_table, self.spec.scale, out_TQD,
                            lse_TQ, rows_R=rows_R, kv_scale=kv_scale, soft_cap=self.spec.soft_cap(layer))

    def forward_new_tokens(self, q_TQD, k_TKD, v_TKD, pieces_P3, layer=0):
        if not q_TQD.is_cuda and not _interpreting():
            return super().forward_new_tokens(q_TQD, k_TKD, v_TKD, pieces_P3, layer)
        return triton_ragged_causal(q_TQD, k_TKD, v_TKD, pieces_P3, self.spec.scale, self.spec.head_size,
                                    self.spec.window(layer), self.spec.soft_cap(layer))


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run on the CPU (tests of the kernels without a GPU)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def write_kv_cache_fast(kv_cache: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                        slot_mapping_T: torch.Tensor, kv_scale_2NK: torch.Tensor | None = None) -> None:
    """The KV update before attention: a Triton scatter on CUDA (no host sync), torch elsewhere.
    An fp8 cache (``kv_scale_2NK`` [2, pages, Hk], its per-page scales) is quantised by the same rule on both
    paths (kvstore.fp8.quantize)."""
    # (Triton's interpreter rounds float32 -> fp8 differently from the GPU and torch: fp8 writes stay in torch there.)
    if kv_cache.is_cuda or (_interpreting() and kv_scale_2NK is None):
        try:
            from cpattn.attention.backends import triton_kv_write
        except ImportError:
            pass
        else:
            triton_kv_write.write_kv_cache(kv_cache, k_TKD, v_TKD, slot_mapping_T, kv_scale_2NK)
            return
    write_kv_cache(kv_cache, k_TKD, v_TKD, slot_mapping_T, kv_scale_2NK)


def triton_ragged_causal(q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, pieces_P3: torch.Tensor,
                         scale: float, head_size: int, window: int | None = None,
                         soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention among new tokens by pieces (q_start, q_end, k_start) with the prefill kernel;
    rows no piece covers get out 0, lse -inf. Natural-log LSE [T, Q] float32. A piece's tokens are consecutive
    positions, so a sliding window is relative: query i sees keys i - window < j <= i."""
    from cpattn.attention.backends.triton_prefill import make_prefill_tiles, prefill, prefill_block_sizes

    t, hq = q_TQD.shape[:2]
    if _each_token_alone(pieces_P3, t):
        # A decode-only step: each token sees only itself, softmax over one key.
        g = hq // k_TKD.shape[1]
        k_rep = k_TKD.repeat_interleave(g, dim=1)
        lse = (q_TQD.float() * k_rep.float()).sum(-1) * scale
        if soft_cap is not None:
            lse = soft_cap * torch.tanh(lse / soft_cap)
        return v_TKD.repeat_interleave(g, dim=1).to(q_TQD.dtype), lse
    out, lse, pieces = unattended_rows(q_TQD, pieces_P3)
    if not pieces:
        return out, lse
    dev = q_TQD.device
    block_m = prefill_block_sizes(head_size)[0]
    tiles = make_prefill_tiles(list(range(len(pieces))), [p[0] for p in pieces], [p[1] - p[0] for p in pieces],
                               block_m, dev)
    i32 = dict(dtype=torch.int32)
    req_seq = torch.tensor([qe - ks for _, qe, ks in pieces], **i32).to(dev, non_blocking=True)
    req_qlen = torch.tensor([qe - qs for qs, qe, _ in pieces], **i32).to(dev, non_blocking=True)
    req_kv0 = torch.tensor([ks for _, _, ks in pieces], **i32).to(dev, non_blocking=True)
    key_start = None
    if window is not None:
        starts = torch.zeros(t, dtype=torch.int64)
        for qs, qe, ks in pieces:                      # counted from the piece's first key
            starts[qs:qe] = (torch.arange(qs, qe) - window + 1 - ks).clamp(min=0)
        key_start = starts.to(torch.int32).to(dev, non_blocking=True)
    prefill(q_TQD, k_TKD, v_TKD, None, tiles, req_seq, req_qlen, req_kv0, True, scale, out, lse,
            key_start=key_start, soft_cap=soft_cap)
    return out, lse


def _each_token_alone(pieces_P3: torch.Tensor, num_tokens: int) -> bool:
    """Pieces are (i, i + 1, i) for i = 0 .. T-1: every token's only key is itself."""
    if pieces_P3.shape[0] != num_tokens or pieces_P3.is_cuda:
        return False
    idx = torch.arange(num_tokens)
    return bool((pieces_P3[:, 0] == idx).all() and (pieces_P3[:, 1] == idx + 1).all()
                and (pieces_P3[:, 2] == idx).all())


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"
    impl_cls = TritonAttentionImpl
    builder_cls = TritonMetadataBuilder
    supported_dtypes = ("float16", "bfloat16")
    supported_devices = ("cuda",)
    supported_head_sizes = None          # any multiple of 8 up to 256 (tiles pad D to a power of 2)
    min_capability = (8, 0)              # bf16 tensor-core dot
    lse_base = LseBase.E
    can_return_lse = True
    supports_pcp = True
    # Decode-only steps replay per-layer graphs (lengths on the device, S and table width bucketed);
    # prefill tiles are planned per step, so mixed steps run eagerly.
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # fp8 pages are dequantised in the kernels with their per-page scales; windows on global positions
    # (key starts planned per step); soft cap in the logits. Decode and prefill/causal alike.
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        # Keys are gathered row by row through the block table, so any page size works; 16 and up
        # keep a K/V tile within few pages.
        return [MultipleOf(16)]

    @classmethod
    def kernel_version(cls) -> str:
        try:
            import triton
        except ImportError:
            return "triton (not installed)"
        return f"cpattn triton kernels (triton {triton.__version__})"

    @classmethod
    def availability(cls, config: AttentionSelectorConfig) -> list[str]:
        reasons = []
        try:
            import triton  # noqa: F401
        except ImportError:
            reasons.append("triton is not installed (pip install 'cpattn[triton]')")
        if config.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("CUDA is not available in this process")
        if (config.kv_cache_dtype == "fp8_e4m3" and config.device_capability is not None
                and config.device_capability < (8, 9)):
            reasons.append(f"fp8_e4m3 KV needs compute capability 8.9 or newer in Triton (this GPU is "
                           f"{config.device_capability}): use kv_cache_dtype fp8_e5m2, or backend TORCH")
        return reasons
