"""Named batches, random paged caches and the float64 oracle for the GPU backend tests.

Legend: T tokens, Q query heads, K kv heads, D head size, B requests, N shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpattn.attention import AttentionSpec, make_causal_metadata, make_dcp_context_metadata
from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchMetadataBuilder
from cpattn.kvstore import MultipleOf, dcp_local_position, dcp_owner_rank

# (query_lens, context_lens): decodes have one query; context = keys before the step.
SHAPES = {
    "small_decode": ([1, 1, 1, 1], [17, 64, 100, 3]),
    "mixed": ([1, 7, 1, 33, 5, 1], [40, 0, 5000, 10, 250, 0]),   # the 5000 decode splits KV
    "long_prefill": ([1000, 300], [0, 700]),
    "long_decode": ([1, 1], [20000, 5000]),
}


def page_sizes(backend_cls) -> list[int]:
    """Page sizes to test: each declared size; two per MultipleOf(b) (b and 4b, or 2b from 256)."""
    sizes = []
    for s in backend_cls.get_supported_kernel_block_sizes():
        if isinstance(s, MultipleOf):
            sizes += [s.base, s.base * (4 if s.base < 128 else 2 if s.base < 256 else 1)]
        else:
            sizes.append(s)
    return sorted(set(sizes))


@dataclass
class PagedBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_size: int


def random_batch(query_lens, context_lens, hq, hk, d, block_size, dtype, device, seed=0, spare_blocks=7):
    """Random q/k/v for the new tokens, a cache holding the context, pages placed by a random permutation."""
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for q, c in zip(query_lens, context_lens)]
    pages = [-(-s // block_size) for s in seq]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(max(pages), 1)
    table = torch.full((len(seq), width), -1, dtype=torch.int64)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used:used + p]
        used += p
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hk, d, generator=g).to(dtype)
    v = torch.randn(t, hk, d, generator=g).to(dtype)
    kv = torch.randn(2, num_blocks, block_size, hk, d, generator=g).to(dtype)   # finite everywhere
    return PagedBatch(q.to(device), k.to(device), v.to(device), kv.to(device), table.to(device),
                      list(query_lens), list(context_lens), block_size)


def spec_for(b: PagedBatch, dtype, device) -> AttentionSpec:
    return AttentionSpec(num_q_heads=b.q.shape[1], num_kv_heads=b.k.shape[1], head_size=b.q.shape[2],
                         dtype=dtype, block_size=b.block_size, device=str(device))


def run_backend(backend_cls, spec: AttentionSpec, md, q, k, v, kv_cache):
    builder = backend_cls.get_builder_cls()(spec)
    impl = backend_cls.get_impl_cls()(spec)
    plan = builder.build(0, md)
    return impl.forward(0, q, k, v, kv_cache, plan)


def oracle(b: PagedBatch, causal_md) -> tuple[torch.Tensor, torch.Tensor]:
    """TORCH backend in float64 on float64 copies of the same values."""
    spec = AttentionSpec(num_q_heads=b.q.shape[1], num_kv_heads=b.k.shape[1], head_size=b.q.shape[2],
                         dtype=torch.float64, block_size=b.block_size, device=str(b.q.device))
    md = TorchMetadataBuilder(spec).build(0, causal_md)
    return TorchAttentionImpl(spec).forward(0, b.q.double(), b.k.double(), b.v.double(), b.kv_cache.double(), md)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def lse_err(lse_nat: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference of natural-log LSEs; -inf must match -inf exactly."""
    a, r = lse_nat.double(), ref.double()
    inf_a, inf_r = torch.isneginf(a), torch.isneginf(r)
    if not torch.equal(inf_a, inf_r):
        return math.inf
    finite = ~inf_r
    return float((a[finite] - r[finite]).abs().max()) if bool(finite.any()) else 0.0


@dataclass
class DcpShard:
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    md: object


def dcp_shards(b: PagedBatch, world: int, interleave: int, device, seed=1) -> list[DcpShard]:
    """Deal the batch's context over ``world`` shards (tokens [k*I, (k+1)*I) to rank k mod N): each
    shard gets its own cache holding its tokens' K/V at local positions, pages placed at random,
    plus pages for the new tokens it owns; metadata in context-partial mode (causal=False)."""
    g = torch.Generator().manual_seed(seed)
    ps = b.block_size
    hk, d = b.k.shape[1], b.k.shape[2]
    shards = []
    for rank in range(world):
        local_total = []
        for q, c in zip(b.query_lens, b.context_lens):
            pos = torch.arange(c + q)
            local_total.append(int((dcp_owner_rank(pos, world, interleave) == rank).sum()))
        pages = [-(-n // ps) for n in local_total]
        num_blocks = sum(pages) + 3
        perm = torch.randperm(num_blocks, generator=g)
        table = torch.full((len(pages), max(max(pages), 1)), -1, dtype=torch.int64)
        used = 0
        for r, p in enumerate(pages):
            table[r, :p] = perm[used:used + p]
            used += p
        kv = torch.randn(2, num_blocks, ps, hk, d, generator=g).to(b.kv_cache.dtype).to(device)
        flat = kv.view(2, num_blocks * ps, hk, d)
        gflat = b.kv_cache.view(2, -1, hk, d)
        for r, c in enumerate(b.context_lens):
            pos = torch.arange(c)
            mine = pos[dcp_owner_rank(pos, world, interleave) == rank]
            if mine.numel() == 0:
                continue
            lpos = dcp_local_position(mine, world, interleave)
            lslot = table[r, lpos // ps] * ps + lpos % ps
            gslot = b.block_table[r].cpu()[mine // ps] * ps + mine % ps
            flat[:, lslot.to(device)] = gflat[:, gslot.to(device)]
        md = make_dcp_context_metadata(b.query_lens, b.context_lens, table, ps, world, rank, interleave)
        shards.append(DcpShard(kv, table.to(device), md.to(device)))
    return shards


def new_token_pieces(query_lens) -> torch.Tensor:
    """(q_start, q_end, k_start) per request: its new tokens attend causally to each other."""
    rows, start = [], 0
    for q in query_lens:
        rows.append((start, start + q, start))
        start += q
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def causal_md(b: PagedBatch, device):
    return make_causal_metadata(b.query_lens, b.context_lens, b.block_table.cpu(), b.block_size).to(device)
