"""TORCH reference backend: paged attention in plain torch, any device, float32 and float64.

The oracle every other backend is tested against; returns natural-log LSE [T, Hq]. It loops over
requests in Python, which is clear rather than fast; the math is in ops/reference.py.
Legend: T tokens, Q query heads, K kv heads, D head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from cpattn.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                      AttentionMetadataBuilder, write_kv_cache)
from cpattn.attention.cascade import SharedPrefix, cascade_forward, find_shared_prefixes
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.attention.ops import reference
from cpattn.attention.ops.lse import LseBase
from cpattn.errors import InvalidRequestError
from cpattn.kvstore import MultipleOf
from cpattn.kvstore.fp8 import fp8_format_of


@dataclass
class TorchAttentionMetadata(CommonAttentionMetadata):
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    """Requests reading the same first pages (forked sequences): attended as a cascade (attention/cascade.py)."""


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        md = common.to(self.spec.device)
        visible = md.seq_lens_cpu - md.query_lens_cpu if md.causal else md.context_lens_cpu
        block_size = self.spec.block_size
        prefixes = find_shared_prefixes(md.block_table_tensor, visible, block_size, min_keys=block_size)
        return TorchAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, shared_prefixes=prefixes)


class TorchAttentionImpl(AttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        md: CommonAttentionMetadata = attn_metadata
        fp8 = fp8_format_of(kv_cache.dtype) is not None
        if fp8 and kv_scale is None:
            raise InvalidRequestError(f"layer {layer}: the KV cache is {kv_cache.dtype}; pass its scales (kv_scale)")
        write_kv_cache(kv_cache, k_TKD, v_TKD, md.slot_mapping, kv_scale)
        t, hq, d = q_TQD.shape
        compute = torch.float64 if q_TQD.dtype == torch.float64 else torch.float32
        out = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
        lse = torch.full((t, hq), -math.inf, dtype=compute, device=q_TQD.device)
        qsl = md.query_start_loc_cpu.tolist()
        lens = md.seq_lens_cpu.tolist()
        key_start_T = md.window_key_start(self.spec.window(layer))
        block_size = kv_cache.shape[2]
        done = set()
        if key_start_T is None and getattr(md, "shared_prefixes", ()):   # windows read their own pages anyway
            done = cascade_forward(
                q_TQD, kv_cache, md.block_table_tensor, qsl, lens, md.causal, md.shared_prefixes,
                lambda row, n, first: reference.gather_request_kv(kv_cache, row, n, first, kv_scale if fp8 else None, compute),
                lambda q, k, v, offset: reference.dense_attention(q, k, v, self.spec.scale, offset, self.spec.soft_cap(layer)),
                out, lse)
        for r in range(md.num_reqs):
            qs, qe, seq_len = qsl[r], qsl[r + 1], lens[r]
            if qe == qs or seq_len == 0 or r in done:
                continue
            first = 0
            if key_start_T is not None:
                first = int(key_start_T[qs:qe].min())
                if first >= seq_len:
                    continue          # this rank holds none of these queries' window: empty partial, no kernel
            k, v = reference.gather_request_kv(kv_cache, md.block_table_tensor[r], seq_len, first,
                                     kv_scale if fp8 else None, compute)
            offset_keys = (first // block_size) * block_size            # index of k[0] among the local keys
            starts = None if key_start_T is None else (key_start_T[qs:qe] - offset_keys).clamp(min=0)
            offset = seq_len - offset_keys - (qe - qs) if md.causal else None
            out[qs:qe], lse[qs:qe] = reference.dense_attention(q_TQD[qs:qe], k, v, self.spec.scale, offset,
                                                     self.spec.soft_cap(layer), starts)
        return out, lse


class TorchReferenceBackend(AttentionBackend):
    name = "TORCH"
    impl_cls = TorchAttentionImpl
    builder_cls = TorchMetadataBuilder
    supported_dtypes = ("float16", "bfloat16", "float32", "float64")
    supported_devices = ("cpu", "cuda")
    supported_head_sizes = None
    lse_base = LseBase.E
    can_return_lse = True
    supports_pcp = True
    cudagraph_support = AttentionCGSupport.NEVER
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")   # dequantised before float32/64 math
    supports_sliding_window = True
    supports_logits_soft_cap = True
    reads_shared_prefix_once = True   # cascade inside forward (attention/cascade.py): no split by the shard

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [MultipleOf(1)]

    @classmethod
    def kernel_version(cls) -> str:
        return f"torch {torch.__version__}"

    @classmethod
    def validate(cls, config):
        reasons = super().validate(config)
        # Beyond the declarations: any head size works here (no kernel constraints).
        return [r for r in reasons if not r.startswith("head_size")]
