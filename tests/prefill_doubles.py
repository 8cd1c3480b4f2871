"""Test doubles of the prefill backend tests (tests/test_prefill_backend.py), imported by shard processes by path.

All wrap the TORCH reference, so their outputs are exact in float64; each differs from TORCH in one declaration
a prefill backend beside a decode backend must respect: its LSE base, the kernel page sizes it accepts, or the
layout of its KV cache.
"""

from __future__ import annotations

from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from tests.reliability_plugins import Base2TorchBackend


class Pages16Base2Backend(Base2TorchBackend):
    """Base-2 LSE (converted per backend) and kernel pages of exactly 16 tokens (so a runner beside TORCH views
    pages of 32 as two of 16, for decode steps too)."""

    name = "PAGES16_BASE2"

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [16]


class Pages32Backend(TorchReferenceBackend):
    """Kernel pages of exactly 32 tokens: no page size it shares with Pages16Base2Backend."""

    name = "PAGES32"

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [32]


class PagesFirstBackend(TorchReferenceBackend):
    """A cache laid out page-major, [num_blocks, 2, block_size, Hk, D]: not the layout TORCH's kernels read."""

    name = "PAGES_FIRST"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


DOUBLES = {cls.name: f"tests.prefill_doubles:{cls.__name__}"
           for cls in (Pages16Base2Backend, Pages32Backend, PagesFirstBackend)}
