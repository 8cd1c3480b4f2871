"""Decode context parallelism in one process: N shards, merged by LSE, equal full attention.

Each shard has its own block pool, block table and paged cache (pages placed by a random permutation of
block ids, unused pages NaN). Two steps run: a prefill of every sequence's context, then a mixed step.
K/V reach the caches only through each shard's slot mapping. Every shard's partial is checked against
the oracle restricted to the keys that shard owns, and the merge against full attention.
"""

import math

import pytest
import torch

from cpattn.attention import AttentionSpec, merge_attn_states, make_dcp_context_metadata
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.kvstore import BlockPool, BlockTable, dcp_local_seq_lens
from tests.reference import attention_with_visibility, causal_visibility

BLOCK_SIZE = 32
HQ, HK, D = 4, 2, 16
# Short sequences leave most shards empty for N up to 8; one long one spans many pages on every shard.
CONTEXT_LENS = [0, 1, 3, 70, 200]
QUERY_LENS = [5, 1, 2, 1, 40]


def _owner(p, n, i):
    return (p // i) % n


class Shard:
    def __init__(self, rank, world, interleave, num_blocks, num_reqs, dtype, g):
        self.rank, self.world, self.interleave = rank, world, interleave
        self.pool = BlockPool(num_blocks, shard=rank)
        self.perm = torch.randperm(num_blocks, generator=g).tolist()     # pool id -> physical page
        self.table = BlockTable(num_reqs, 64)
        self.rows = [self.table.add_row() for _ in range(num_reqs)]
        self.cache = torch.full(TorchReferenceBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, HK, D),
                                math.nan, dtype=dtype)
        spec = AttentionSpec(HQ, HK, D, dtype, BLOCK_SIZE)
        self.builder = TorchReferenceBackend.get_builder_cls()(spec)
        self.impl = TorchReferenceBackend.get_impl_cls()(spec)

    def allocate_for(self, seq_lens_after):
        """Pages for the tokens this shard owns once the step's tokens are in."""
        local = dcp_local_seq_lens(seq_lens_after, self.world, self.rank, self.interleave).tolist()
        for row, n in zip(self.rows, local):
            need = -(-n // BLOCK_SIZE) - self.table.num_blocks[row]
            self.table.append(row, [self.perm[b] for b in self.pool.allocate(need)])

    def context_partial(self, q, k, v, query_lens, context_lens):
        md = make_dcp_context_metadata(query_lens, context_lens, self.table.gather(self.rows), BLOCK_SIZE,
                                       self.world, self.rank, self.interleave)
        assert not md.causal
        return self.impl.forward(0, q, k, v, self.cache, self.builder.build(0, md))


def _causal_pieces(query_lens, world, split):
    """(q_start, q_end, k_start) per rank. split: head-tail pairing of 2N chunks per request (PCP)."""
    per_rank = [[] for _ in range(world)]
    start = 0
    for ql in query_lens:
        if not split:
            if ql:
                per_rank[0].append((start, start + ql, start))
        else:
            bounds = [start + (ql * c) // (2 * world) for c in range(2 * world + 1)]
            for r in range(world):
                for c in (r, 2 * world - 1 - r):
                    if bounds[c + 1] > bounds[c]:
                        per_rank[r].append((bounds[c], bounds[c + 1], start))
        start += ql
    return [torch.tensor(p, dtype=torch.int64).view(-1, 3) for p in per_rank]


def _step(shards, q, keys, values, context_lens, query_lens, split_causal, check_partials):
    """One step across all shards; returns merged (out, lse) and asserts per-shard partials."""
    world, interleave = shards[0].world, shards[0].interleave
    seq_after = [c + n for c, n in zip(context_lens, query_lens)]
    k_new = torch.cat([k[c:c + n] for k, c, n in zip(keys, context_lens, query_lens)])
    v_new = torch.cat([v[c:c + n] for v, c, n in zip(values, context_lens, query_lens)])
    for s in shards:
        s.allocate_for(seq_after)
    outs, lses = [], []
    pieces = _causal_pieces(query_lens, world, split_causal)
    for s in shards:
        o, l = s.context_partial(q, k_new, v_new, query_lens, context_lens)
        if check_partials:
            # The shard's partial = attention over exactly the context keys it owns.
            start = 0
            for r, (c, n) in enumerate(zip(context_lens, query_lens)):
                mine = torch.tensor([_owner(p, world, interleave) == s.rank for p in range(c)], dtype=torch.bool)
                eo, el = attention_with_visibility(q[start:start + n], keys[r][:c], values[r][:c],
                                                   mine[None, :].expand(n, c))
                torch.testing.assert_close(o[start:start + n].double(), eo, atol=1e-10, rtol=1e-10)
                torch.testing.assert_close(l[start:start + n].double(), el, atol=1e-10, rtol=1e-10)
                start += n
        if pieces[s.rank].numel():
            o2, l2 = s.impl.forward_new_tokens(q, k_new, v_new, pieces[s.rank])
            if split_causal:
                outs.append(o2)
                lses.append(l2)
            else:                           # merge locally first, as a shard would before sending
                o, l = merge_attn_states([o, o2], [l, l2])
        outs.append(o)
        lses.append(l)
    return merge_attn_states(outs, lses)


def _full_reference(q, keys, values, context_lens, query_lens):
    outs, lses, start = [], [], 0
    for k, v, c, n in zip(keys, values, context_lens, query_lens):
        o, l = attention_with_visibility(q[start:start + n], k[:c + n], v[:c + n], causal_visibility(n, c + n))
        outs.append(o)
        lses.append(l)
        start += n
    return torch.cat(outs), torch.cat(lses)


def _assert_caches_hold_history(shards, keys, values):
    """Brute force: token p of request r is at its owner's local index (count of earlier owned tokens)."""
    world, interleave = shards[0].world, shards[0].interleave
    for r, (k, v) in enumerate(zip(keys, values)):
        seen = [0] * world
        for p in range(k.shape[0]):
            s = shards[_owner(p, world, interleave)]
            local = seen[s.rank]
            seen[s.rank] += 1
            page = s.table.row(s.rows[r])[local // BLOCK_SIZE]
            assert torch.equal(s.cache[0, page, local % BLOCK_SIZE], k[p])
            assert torch.equal(s.cache[1, page, local % BLOCK_SIZE], v[p])


def _run(world, interleave, split_causal, dtype, seed, check_partials=True):
    g = torch.Generator().manual_seed(seed)
    total = [c + n for c, n in zip(CONTEXT_LENS, QUERY_LENS)]
    keys = [torch.randn(n, HK, D, generator=g, dtype=torch.float64).to(dtype) for n in total]
    values = [torch.randn(n, HK, D, generator=g, dtype=torch.float64).to(dtype) for n in total]
    shards = [Shard(r, world, interleave, 40, len(total), dtype, g) for r in range(world)]
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=3e-5, rtol=3e-5)

    # Step 1: prefill each context (no context yet: shard partials are all empty, -inf).
    q1 = torch.randn(sum(CONTEXT_LENS), HQ, D, generator=g, dtype=torch.float64).to(dtype)
    zeros = [0] * len(total)
    out1, lse1 = _step(shards, q1, keys, values, zeros, CONTEXT_LENS, split_causal, check_partials)
    ref1 = _full_reference(q1, keys, values, zeros, CONTEXT_LENS)
    torch.testing.assert_close(out1.double(), ref1[0], **tol)
    torch.testing.assert_close(lse1.double(), ref1[1], **tol)

    # Step 2: decodes and prefill chunks against the sharded context.
    q2 = torch.randn(sum(QUERY_LENS), HQ, D, generator=g, dtype=torch.float64).to(dtype)
    out2, lse2 = _step(shards, q2, keys, values, CONTEXT_LENS, QUERY_LENS, split_causal, check_partials)
    ref2 = _full_reference(q2, keys, values, CONTEXT_LENS, QUERY_LENS)
    torch.testing.assert_close(out2.double(), ref2[0], **tol)
    torch.testing.assert_close(lse2.double(), ref2[1], **tol)
    _assert_caches_hold_history(shards, keys, values)


@pytest.mark.parametrize("split_causal", [False, True], ids=["causal-once", "causal-split"])
@pytest.mark.parametrize("interleave", [1, 16, BLOCK_SIZE])
@pytest.mark.parametrize("world", range(1, 9))
def test_dcp_merge_equals_full_attention(world, interleave, split_causal):
    _run(world, interleave, split_causal, torch.float64, seed=1000 * world + 10 * interleave + split_causal,
         check_partials=split_causal)


@pytest.mark.parametrize("world, interleave", [(3, 1), (5, 16)])
def test_dcp_float32(world, interleave):
    _run(world, interleave, True, torch.float32, seed=77 + world, check_partials=False)


def test_dcp_more_shards_than_tokens():
    """One 3-token sequence over 8 shards: five shards hold nothing and must contribute nothing."""
    world, interleave = 8, 1
    g = torch.Generator().manual_seed(3)
    k = torch.randn(4, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(4, HK, D, generator=g, dtype=torch.float64)
    shards = [Shard(r, world, interleave, 4, 1, torch.float64, g) for r in range(world)]
    q1 = torch.randn(3, HQ, D, generator=g, dtype=torch.float64)
    _step(shards, q1, [k], [v], [0], [3], False, True)
    q2 = torch.randn(1, HQ, D, generator=g, dtype=torch.float64)
    partials = []
    for s in shards:
        s.allocate_for([4])
        partials.append(s.context_partial(q2, k[3:], v[3:], [1], [3]))
    for s, (o, l) in zip(shards, partials):
        if s.rank >= 3:                 # holds no context token: out 0, lse -inf
            assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(l).all())
    o2, l2 = shards[0].impl.forward_new_tokens(q2, k[3:], v[3:], torch.tensor([[0, 1, 0]]))
    out, lse = merge_attn_states([o for o, _ in partials] + [o2], [l for _, l in partials] + [l2])
    eo, el = attention_with_visibility(q2, k, v, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out, eo, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, el, atol=1e-12, rtol=1e-12)
    assert sum(s.pool.num_used_blocks for s in shards) == 4        # one page per token-holding shard
