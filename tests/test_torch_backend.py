"""TORCH backend vs the independent float64 oracle over named batch shapes.

KV pages are placed by a random permutation of block ids; context K/V is written into the paged cache
by index arithmetic done here (not cpattn), the step's new K/V by the backend itself via slot mapping.
"""

import math
import zlib

import pytest
import torch

from cpattn.attention import AttentionSpec, make_causal_metadata
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.kvstore import PAD_BLOCK_ID
from tests.reference import causal_visibility, attention_with_visibility, reference_attention

# (context_lens, query_lens) per request.
BATCH_SHAPES = {
    "small_decode": ([13, 40, 1, 77, 16], [1, 1, 1, 1, 1]),
    "mixed": ([127, 0, 32, 5, 64], [1, 4, 3, 17, 1]),
    "long_prefill": ([0, 40], [150, 33]),
}
TOLERANCES = {   # (atol, rtol) for out and for lse
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=3e-5, rtol=3e-5),
}
HK = 2
BLOCK_SIZE = 16


class PagedBatch:
    """A batch's full K/V histories, and a paged cache holding their contexts at permuted pages."""

    def __init__(self, context_lens, query_lens, hq, hk, d, dtype, block_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.context_lens, self.query_lens = context_lens, query_lens
        self.seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        self.keys = [torch.randn(n, hk, d, generator=g, dtype=torch.float64).to(dtype) for n in self.seq_lens]
        self.values = [torch.randn(n, hk, d, generator=g, dtype=torch.float64).to(dtype) for n in self.seq_lens]
        self.q = torch.randn(sum(query_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
        pages = [-(-n // block_size) for n in self.seq_lens]
        self.num_blocks = sum(pages) + 7                          # some pages stay unused
        perm = torch.randperm(self.num_blocks, generator=g).tolist()
        width = max(pages) + 2
        self.block_table = torch.full((len(pages), width), PAD_BLOCK_ID, dtype=torch.int64)
        for r, p in enumerate(pages):
            self.block_table[r, :p] = torch.tensor([perm.pop() for _ in range(p)], dtype=torch.int64)
        # Unused pages hold garbage that must never be read.
        self.cache = torch.full((2, self.num_blocks, block_size, hk, d), math.nan, dtype=dtype)
        for r, c in enumerate(context_lens):
            for p in range(c):
                blk = int(self.block_table[r, p // block_size])
                self.cache[0, blk, p % block_size] = self.keys[r][p]
                self.cache[1, blk, p % block_size] = self.values[r][p]
        self.block_size = block_size

    def new_kv(self):
        k = torch.cat([k[c:] for k, c in zip(self.keys, self.context_lens)])
        v = torch.cat([v[c:] for v, c in zip(self.values, self.context_lens)])
        return k, v

    def assert_cache_holds_history(self):
        for r, n in enumerate(self.seq_lens):
            for p in range(n):
                blk = int(self.block_table[r, p // self.block_size])
                assert torch.equal(self.cache[0, blk, p % self.block_size], self.keys[r][p])
                assert torch.equal(self.cache[1, blk, p % self.block_size], self.values[r][p])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", list(BATCH_SHAPES))
def test_torch_backend_matches_oracle(shape, gqa, head_size, dtype):
    context_lens, query_lens = BATCH_SHAPES[shape]
    hq = HK * gqa
    seed = zlib.crc32(f"{shape}-{gqa}-{head_size}-{dtype}".encode())
    batch = PagedBatch(context_lens, query_lens, hq, HK, head_size, dtype, BLOCK_SIZE, seed)
    spec = AttentionSpec(hq, HK, head_size, dtype, BLOCK_SIZE)
    md = make_causal_metadata(query_lens, context_lens, batch.block_table, BLOCK_SIZE)
    plan = TorchReferenceBackend.get_builder_cls()(spec).build(0, md)
    impl = TorchReferenceBackend.get_impl_cls()(spec)
    k_new, v_new = batch.new_kv()
    out, lse = impl.forward(0, batch.q, k_new, v_new, batch.cache, plan)

    ref_out, ref_lse = reference_attention(batch.q, batch.keys, batch.values, query_lens)
    assert out.shape == (sum(query_lens), hq, head_size) and out.dtype == dtype
    assert lse.shape == (sum(query_lens), hq)
    torch.testing.assert_close(out.double(), ref_out, **TOLERANCES[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, **TOLERANCES[dtype])
    batch.assert_cache_holds_history()           # KV update happened, at the right slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_new_tokens_matches_oracle(dtype):
    """Ragged causal attention among new tokens: pieces (q_start, q_end, k_start), uncovered rows -inf."""
    g = torch.Generator().manual_seed(1234)
    hq, hk, d = 8, 2, 64
    t = 20
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(t, hk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(t, hk, d, generator=g, dtype=torch.float64).to(dtype)
    # Request A = tokens 0..6, request B = 7..19; B's queries split in two pieces, token 6 uncovered.
    pieces = torch.tensor([[0, 6, 0], [7, 12, 7], [12, 20, 7]])
    spec = AttentionSpec(hq, hk, d, dtype, 16)
    out, lse = TorchReferenceBackend.get_impl_cls()(spec).forward_new_tokens(q, k, v, pieces)
    exp_out = torch.zeros(t, hq, d, dtype=torch.float64)
    exp_lse = torch.full((t, hq), -math.inf, dtype=torch.float64)
    o, l = attention_with_visibility(q[0:6], k[0:7], v[0:7], causal_visibility(7, 7)[:6])
    exp_out[0:6], exp_lse[0:6] = o, l
    o, l = attention_with_visibility(q[7:20], k[7:20], v[7:20], causal_visibility(13, 13))
    exp_out[7:20], exp_lse[7:20] = o, l
    torch.testing.assert_close(out.double(), exp_out, **TOLERANCES[dtype])
    torch.testing.assert_close(lse.double(), exp_lse, **TOLERANCES[dtype])


def test_kv_cache_shape_and_declarations():
    assert TorchReferenceBackend.get_kv_cache_shape(10, 16, 4, 128) == (2, 10, 16, 4, 128)
    assert TorchReferenceBackend.get_name() == "TORCH"
    assert TorchReferenceBackend.lse_base.name == "E" and TorchReferenceBackend.can_return_lse
