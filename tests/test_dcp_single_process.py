"""Decode context parallelism in one process: N shards, merged by LSE, equal full attention.

Each shard has its own block pool, block table and paged cache (pages placed by a random permutation of
block ids, unused pages NaN) and attends through the library's ShardLayerRunner (tests/dcp_shards.py).
Two steps run: a prefill of every sequence's context, then a mixed step. K/V reach the caches only through
each shard's slot mapping. Every shard's partial is checked against the oracle restricted to the keys that
shard owns (context and causal pieces), and the merge against full attention.
"""

import pytest
import torch

from cpattn.attention import merge_attn_states
from tests.dcp_shards import LocalShard, expected_partial, owner, shard_config
from tests.reference import attention_with_visibility, causal_visibility

BLOCK_SIZE = 32
HQ, HK, D = 4, 2, 16
# Short sequences leave most shards empty for N up to 8; one long one spans many pages on every shard.
CONTEXT_LENS = [0, 1, 3, 70, 200]
QUERY_LENS = [5, 1, 2, 1, 40]


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
        o, l = s.attend(q, k_new, v_new, query_lens, context_lens, pieces[s.rank])
        if check_partials:
            # The shard's partial = attention over exactly the context keys it owns and its causal pieces.
            eo, el = expected_partial(q, keys, values, context_lens, query_lens, s.rank, world, interleave,
                                      pieces[s.rank])
            torch.testing.assert_close(o.double(), eo, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(l.double(), el, atol=1e-10, rtol=1e-10)
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
            s = shards[owner(p, world, interleave)]
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
    config = shard_config(world, interleave, BLOCK_SIZE, HQ, HK, D, dtype, num_blocks=40)
    shards = [LocalShard(r, config, len(total), g) for r in range(world)]
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
    config = shard_config(world, interleave, BLOCK_SIZE, HQ, HK, D, torch.float64, num_blocks=4)
    shards = [LocalShard(r, config, 1, g) for r in range(world)]
    q1 = torch.randn(3, HQ, D, generator=g, dtype=torch.float64)
    _step(shards, q1, [k], [v], [0], [3], False, True)
    q2 = torch.randn(1, HQ, D, generator=g, dtype=torch.float64)
    partials = []
    for s in shards:
        s.allocate_for([4])
        pieces = torch.tensor([[0, 1, 0]]) if s.rank == 0 else torch.zeros(0, 3, dtype=torch.int64)
        partials.append(s.attend(q2, k[3:], v[3:], [1], [3], pieces))
    for s, (o, l) in zip(shards, partials):
        if s.rank >= 3:                 # holds no context token: out 0, lse -inf
            assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(l).all())
    out, lse = merge_attn_states([o for o, _ in partials], [l for _, l in partials])
    eo, el = attention_with_visibility(q2, k, v, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out, eo, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, el, atol=1e-12, rtol=1e-12)
    assert sum(s.pool.num_used_blocks for s in shards) == 4        # one page per token-holding shard
