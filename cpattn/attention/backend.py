"""The backend layer: AttentionBackend (class factory + declarations), builder, impl.

A backend is a class, not an instance: what it can serve does not depend on any layer or batch.
``validate`` returns reasons instead of raising, so the selector can report every rejected
backend and why. The builder plans once per step; the impl runs one layer with that plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.attention.ops.head_size import HEAD_SIZE_RULE, head_size_ok
from cpattn.attention.ops.lse import LseBase
from cpattn.attention.ops.reference import ragged_causal_attention, ragged_causal_pieces
from cpattn.errors import InvalidRequestError
from cpattn.kvstore import MultipleOf
from cpattn.kvstore.fp8 import fp8_format_of, quantize, token_scales

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}


class AttentionCGSupport(enum.IntEnum):
    """How much of a step a backend can replay from a captured CUDA graph (higher = more)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """Every factor that changes which backend is chosen; also the selector's cache key."""

    head_size: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    device_type: str = "cpu"
    device_capability: tuple[int, int] | None = None
    needs_lse: bool = True
    use_pcp: bool = False
    sliding_window: bool = False
    """Some layer uses a sliding window (measured on global positions under DCP)."""
    logits_soft_cap: bool = False
    """Some layer caps its logits (s -> cap * tanh(s / cap))."""


@dataclass(frozen=True)
class AttentionSpec:
    """What a builder/impl pair is created for: one layer group's geometry on one device."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int            # kernel page size (after negotiation)
    device: str = "cpu"
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer: window W (a query at p sees keys p - W < j <= p) or None; () = no layer has one."""
    logits_soft_caps: tuple[float | None, ...] = ()
    """Per layer: soft cap of the scaled logits or None; () = no layer has one."""
    kv_cache_dtype: str = "auto"
    """The cache's elements: "auto" (the activation dtype), "fp8_e4m3" or "fp8_e5m2" (per-page scales beside it)."""

    @property
    def scale(self) -> float:
        return self.head_size ** -0.5

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if layer < len(self.sliding_windows) else None

    def soft_cap(self, layer: int) -> float | None:
        return self.logits_soft_caps[layer] if layer < len(self.logits_soft_caps) else None


def write_kv_cache(kv_cache_2NBKD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                   slot_mapping_T: torch.Tensor, kv_scale_2NK: torch.Tensor | None = None) -> None:
    """Write new K/V into the paged cache at their slots; slots of -1 (other ranks' tokens) are skipped.

    Runs before attention so the kernel reads a cache that already holds the step's tokens. An fp8 cache
    needs ``kv_scale_2NK`` ([2, num_pages, Hk] float32: K and V scale per page and kv head, already grown
    for this step's values: kvstore.fp8.PageScaleWrites); values are stored as x / their page's scale.
    The scale pages may be larger than the cache view's pages (a kernel view): a multiple of them.
    """
    keep = slot_mapping_T >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping_T[keep]
    _, num_blocks, block_size, hk, d = kv_cache_2NBKD.shape
    flat = kv_cache_2NBKD.view(2, num_blocks * block_size, hk, d)
    if fp8_format_of(kv_cache_2NBKD.dtype) is not None:
        if kv_scale_2NK is None:
            raise InvalidRequestError("an fp8 KV cache needs its scales to be written: pass kv_scale_2NK "
                                      "[2, num_pages, Hk]")
        scale = token_scales(kv_scale_2NK, slots, block_size * (num_blocks // kv_scale_2NK.shape[1]))
        k_new = quantize(k_TKD[keep], scale[0][:, :, None], kv_cache_2NBKD.dtype)
        v_new = quantize(v_TKD[keep], scale[1][:, :, None], kv_cache_2NBKD.dtype)
    else:
        k_new, v_new = k_TKD[keep].to(kv_cache_2NBKD.dtype), v_TKD[keep].to(kv_cache_2NBKD.dtype)
    # index_copy_ has no fp8 kernel on CPU: copy the bytes (same element size) through a uint8 view.
    as_bytes = fp8_format_of(kv_cache_2NBKD.dtype) is not None
    for dst, src in ((flat[0], k_new), (flat[1], v_new)):
        if as_bytes:
            dst.view(torch.uint8).index_copy_(0, slots, src.view(torch.uint8))
        else:
            dst.index_copy_(0, slots, src)


class AttentionMetadataBuilder:
    """Turns CommonAttentionMetadata into the backend's plan; called once per step, reused by every layer."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def build(self, common_prefix_len: int, common: CommonAttentionMetadata) -> Any:
        raise NotImplementedError


class AttentionImpl:
    """Runs one layer: write new K/V by slot mapping, then attention returning (out, lse)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def forward(self, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any,
                kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns out [T, Hq, D] (q's dtype) and lse [T, Hq] float32 in the backend's LSE base.

        ``kv_scale`` [2, num_pages, Hk] float32: the layer's per-page fp8 scales when the cache is fp8 (None
        otherwise); kernel page p uses scale page p // (kernel pages / scale pages).
        The layer's sliding window and soft cap come from the spec (``spec.window(layer)``).
        """
        raise NotImplementedError

    def forward_new_tokens(self, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                           pieces_P3: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention among a step's new tokens, straight from q/k/v (no cache).

        ``pieces_P3`` rows are (q_start, q_end, k_start) in step token indices: queries
        [q_start, q_end) attend causally to keys [k_start, q_end). Returns out [T, Hq, D] and lse
        [T, Hq] in natural log, lse -inf on rows no piece covers. Backends with a faster ragged
        kernel override this; the default is the torch reference.
        """
        return ragged_causal_attention(q_TQD, k_TKD, v_TKD, pieces_P3, self.spec.scale,
                                       window=self.spec.window(layer), soft_cap=self.spec.soft_cap(layer))

    def forward_causal_pieces(self, q_RQD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                              pieces_P4: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of pieces (q_start, q_end, k_start, k_end) whose queries and keys are rows of their own
        tensors (a rank's compact message: q its rows, k/v the new tokens it needs; or both the step's T rows):
        queries q[qs:qe] attend to keys k[ks:ke] aligned at the end (ops.reference.ragged_causal_pieces).
        Returns out [R, Hq, D], natural-log lse [R, Hq] of the pieces' query rows in order (R their sum).

        The default: the reference on the host; on a GPU the backend's forward_new_tokens on one token space
        (q's rows placed at their keys' positions: no copy where q and k already share one, a scatter of q
        otherwise). Backends that can attend q and k of separate spaces override it."""
        if not q_RQD.is_cuda:
            return ragged_causal_pieces(q_RQD, k_SKD, v_SKD, pieces_P4, self.spec.scale,
                                        window=self.spec.window(layer), soft_cap=self.spec.soft_cap(layer))
        return self.causal_pieces_on_keys(q_RQD, k_SKD, v_SKD, pieces_P4, layer)

    def causal_pieces_on_keys(self, q_RQD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                              pieces_P4: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_causal_pieces through forward_new_tokens in k's rows: each query placed at its position among
        its keys (a scatter of q, unless q already is in k's rows), its output rows gathered back."""
        pieces = [p for p in pieces_P4.tolist() if p[1] > p[0]]
        dev = q_RQD.device
        if not pieces:
            return (q_RQD.new_zeros((0,) + tuple(q_RQD.shape[1:])),
                    torch.zeros(0, q_RQD.shape[1], dtype=torch.float32, device=dev))
        at = torch.cat([torch.arange(ke - (qe - qs), ke) for qs, qe, _, ke in pieces])   # queries among the keys
        pieces_P3 = torch.tensor([(ke - (qe - qs), ke, ks) for qs, qe, ks, ke in pieces], dtype=torch.int64)
        q_at = q_RQD
        if q_RQD.shape[0] != k_SKD.shape[0] or any(ke != qe for _, qe, _, ke in pieces):
            q_rows = torch.cat([torch.arange(qs, qe) for qs, qe, _, _ in pieces]).to(dev)
            q_at = q_RQD.new_zeros((k_SKD.shape[0],) + tuple(q_RQD.shape[1:]))
            q_at.index_copy_(0, at.to(dev), q_RQD.index_select(0, q_rows))
        out, lse = self.forward_new_tokens(q_at, k_SKD, v_SKD, pieces_P3, layer)
        if at.numel() == out.shape[0] and bool((at == torch.arange(at.numel())).all()):
            return out, lse
        at = at.to(dev)
        return out.index_select(0, at), lse.index_select(0, at)


class AttentionBackend:
    """Declarations plus factories. Subclasses set the ClassVars and the two classes."""

    name: ClassVar[str] = "ABSTRACT"
    impl_cls: ClassVar[type[AttentionImpl]] = AttentionImpl
    builder_cls: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder
    supported_dtypes: ClassVar[tuple[str, ...]] = ()
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None   # None: ops.head_size rule
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = None
    lse_base: ClassVar[LseBase] = LseBase.E
    can_return_lse: ClassVar[bool] = True
    supports_pcp: ClassVar[bool] = True
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    auto_prefill_with_windows: ClassVar[bool] = True
    """Whether prefill_backend auto may take it for a config with windows (False: served when named, not yet timed)."""
    # Why a feature is not served, when a backend can say more than "not implemented yet" (validate's reasons).
    fp8_unsupported_why: ClassVar[str | None] = None
    sliding_window_unsupported_why: ClassVar[str | None] = None
    logits_soft_cap_unsupported_why: ClassVar[str | None] = None

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return cls.builder_cls

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """[2, num_blocks, block_size, Hk, D]: K and V lead so kernel-page views are plain reshapes."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def kernel_version(cls) -> str:
        """Which kernel generation/package version would run (logged by the selector)."""
        return cls.name

    @classmethod
    def availability(cls, config: AttentionSelectorConfig) -> list[str]:
        """Reasons the backend cannot run here at all (missing package, device); [] when it can."""
        return []

    @classmethod
    def validate(cls, config: AttentionSelectorConfig) -> list[str]:
        """Every reason this backend cannot serve ``config``; empty when it can."""
        reasons = []
        if config.device_type not in cls.supported_devices:
            reasons.append(f"device {config.device_type} not supported (supports {', '.join(cls.supported_devices)})")
        if config.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {config.dtype} not supported (supports {', '.join(cls.supported_dtypes)})")
        elsewhere = "use backend TRITON (CUDA) or TORCH"
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            if config.kv_cache_dtype.startswith("fp8"):
                why = cls.fp8_unsupported_why or f"not implemented for {cls.name} yet"
                reasons.append(f"fp8 KV cache ({config.kv_cache_dtype}) {why} ({elsewhere}, or kv_cache_dtype auto)")
            else:
                reasons.append(f"kv_cache_dtype {config.kv_cache_dtype} not supported "
                               f"(supports {', '.join(cls.supported_kv_cache_dtypes)})")
        if config.sliding_window and not cls.supports_sliding_window:
            why = cls.sliding_window_unsupported_why or f"not implemented for {cls.name} yet"
            reasons.append(f"sliding_window {why} ({elsewhere}, or no window)")
        if config.logits_soft_cap and not cls.supports_logits_soft_cap:
            why = cls.logits_soft_cap_unsupported_why or f"not implemented for {cls.name} yet"
            reasons.append(f"logits_soft_cap {why} ({elsewhere}, or no soft cap)")
        sizes = cls.supported_head_sizes
        if sizes is None:
            if not head_size_ok(config.head_size):
                reasons.append(f"head_size {config.head_size} not supported (must be {HEAD_SIZE_RULE})")
        elif config.head_size not in sizes:
            reasons.append(f"head_size {config.head_size} not supported (supports {list(sizes)})")
        if config.num_q_heads % config.num_kv_heads:
            reasons.append(f"num_q_heads {config.num_q_heads} not a multiple of num_kv_heads {config.num_kv_heads}")
        kernel_sizes = cls.get_supported_kernel_block_sizes()
        if not any(_divides_some(s, config.block_size) for s in kernel_sizes):
            reasons.append(f"block_size {config.block_size} cannot be split into a kernel page size "
                           f"it supports ({kernel_sizes})")
        if config.needs_lse and not cls.can_return_lse:
            reasons.append("cannot return the LSE that context-parallel merging needs")
        if config.use_pcp and not cls.supports_pcp:
            reasons.append("does not support prefill context parallelism")
        if (cls.min_capability is not None and config.device_type == "cuda"
                and config.device_capability is not None and config.device_capability < cls.min_capability):
            reasons.append(f"compute capability {config.device_capability} below {cls.min_capability}")
        return reasons + cls.availability(config)


def _divides_some(spec: int | MultipleOf, block_size: int) -> bool:
    if isinstance(spec, MultipleOf):
        return any(block_size % k == 0 and spec.accepts(k) for k in range(1, block_size + 1))
    return block_size % spec == 0
