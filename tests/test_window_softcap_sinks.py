"""Sliding window, logit soft cap and attention sinks under DCP in one process, against float64.

Each shard has its own pool, table and paged cache (pages at permuted ids, unused pages NaN) and attends
through the library's ShardLayerRunner (tests/dcp_shards.py). The window is measured on global positions:
each shard's partial must equal the oracle restricted to the keys that shard owns (context and causal
pieces) *and* that fall in each query's global window. A shard with none of a request's window skips its
kernel (gather_request_kv is not called for it) and returns out 0 / lse -inf; a shard whose window starts
mid-context reads only the pages from the window's first page on. Sinks enter once, after the merge.
"""

import math

import pytest
import torch

from cpattn.attention import AttentionSpec, apply_sinks, make_causal_metadata, make_dcp_context_metadata
from cpattn.attention import merge_attn_states
from cpattn.attention.ops import reference as ref_ops
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from tests.dcp_shards import LocalShard, expected_partial, owner, shard_config
from tests.reference import attention_with_visibility, window_visibility
from tests.test_dcp_single_process import _causal_pieces

BLOCK = 8
HQ, HK, D = 6, 2, 16                    # GQA, 3 query heads per kv head
CONTEXT_LENS = [0, 1, 9, 57, 190]
QUERY_LENS = [5, 1, 2, 1, 30]


def _expected_reads(world, interleave, rank, context_lens, query_lens, window):
    """Per request: None when no query has an owned key in its window (kernel skipped), else the number of
    local keys read (from the page holding the first in-window local key to the end of the local context)."""
    reads = []
    for c, n in zip(context_lens, query_lens):
        owned = [p for p in range(c) if owner(p, world, interleave) == rank]
        if not owned or n == 0:
            reads.append(None)
            continue
        first_visible = [sum(1 for p in owned if p <= qp - window) for qp in range(c, c + n)]
        first = min(first_visible)
        reads.append(None if first >= len(owned) else len(owned) - (first // BLOCK) * BLOCK)
    return reads


def _step(shards, q, keys, values, context_lens, query_lens, window, cap, sinks, split, check_partials):
    world, interleave = shards[0].world, shards[0].interleave
    seq_after = [c + n for c, n in zip(context_lens, query_lens)]
    k_new = torch.cat([k[c:c + n] for k, c, n in zip(keys, context_lens, query_lens)])
    v_new = torch.cat([v[c:c + n] for v, c, n in zip(values, context_lens, query_lens)])
    for s in shards:
        s.allocate_for(seq_after)
    pieces = _causal_pieces(query_lens, world, split)
    outs, lses = [], []
    for s in shards:
        reads = []
        real = ref_ops.gather_request_kv

        def counting(cache, row, seq_len, first_key=0, *args, **kwargs):
            k, v = real(cache, row, seq_len, first_key, *args, **kwargs)
            reads.append(k.shape[0])
            return k, v

        ref_ops.gather_request_kv = counting
        try:
            o, l = s.attend(q, k_new, v_new, query_lens, context_lens, pieces[s.rank])
        finally:
            ref_ops.gather_request_kv = real
        if window is not None:
            # Skipped requests read nothing; the others read from the window's first page on, never before.
            expected = [r for r in _expected_reads(world, interleave, s.rank, context_lens, query_lens, window)
                        if r is not None]
            assert reads == expected, (s.rank, reads, expected)
        if check_partials:
            eo, el = expected_partial(q, keys, values, context_lens, query_lens, s.rank, world, interleave,
                                      pieces[s.rank], window, cap)
            torch.testing.assert_close(o.double(), eo, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(l.double(), el, atol=1e-10, rtol=1e-10)
        outs.append(o)
        lses.append(l)
    out, lse = merge_attn_states(outs, lses)
    return apply_sinks(out, lse, sinks)


def _reference(q, keys, values, context_lens, query_lens, window, cap, sinks):
    outs, lses, start = [], [], 0
    for k, v, c, n in zip(keys, values, context_lens, query_lens):
        vis = window_visibility(torch.arange(c, c + n), torch.arange(c + n), window)
        o, l = attention_with_visibility(q[start:start + n], k[:c + n], v[:c + n], vis, soft_cap=cap, sinks_Q=sinks)
        outs.append(o)
        lses.append(l)
        start += n
    return torch.cat(outs), torch.cat(lses)


def _run(world, interleave, window, cap, use_sinks, split, seed):
    g = torch.Generator().manual_seed(seed)
    config = shard_config(world, interleave, BLOCK, HQ, HK, D, torch.float64, 40, window, cap)
    total = [c + n for c, n in zip(CONTEXT_LENS, QUERY_LENS)]
    keys = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) for n in total]
    values = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) for n in total]
    if cap is not None:
        for k in keys:
            k.mul_(3.0)                  # logits well beyond the cap, so tanh bends them
    sinks = torch.randn(HQ, generator=g, dtype=torch.float64) * 2 if use_sinks else None
    shards = [LocalShard(r, config, len(total), g) for r in range(world)]
    zeros = [0] * len(total)
    for context, queries in ((zeros, CONTEXT_LENS), (CONTEXT_LENS, QUERY_LENS)):
        q = torch.randn(sum(queries), HQ, D, generator=g, dtype=torch.float64)
        out, lse = _step(shards, q, keys, values, context, queries, window, cap, sinks, split, check_partials=True)
        ref_out, ref_lse = _reference(q, keys, values, context, queries, window, cap, sinks)
        torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def _window(kind, world):
    share = -(-190 // world)             # one shard's share of the longest context
    return {"one": 1, "lt_share": 13, "eq_share": share, "gt_share": 2 * share + 5, "huge": 10_000}[kind]


@pytest.mark.parametrize("kind", ["one", "lt_share", "eq_share", "gt_share", "huge"])
@pytest.mark.parametrize("world, interleave", [(1, 1), (3, 1), (3, BLOCK), (4, 1), (5, BLOCK)])
def test_window_on_global_positions(world, interleave, kind):
    """Windows smaller than, equal to and larger than one shard's share; crossing page and shard boundaries
    (block 8, interleave 1 and the block size, odd shard counts), GQA, split causal part on even worlds."""
    _run(world, interleave, _window(kind, world), None, False, split=world % 2 == 0,
         seed=100 * world + interleave + len(kind))


@pytest.mark.parametrize("world, interleave", [(1, 1), (3, 1), (4, BLOCK)])
def test_window_softcap_and_sinks_together(world, interleave):
    _run(world, interleave, 13, 5.0, True, split=world == 4, seed=7 + world)


@pytest.mark.parametrize("world", [1, 3])
def test_softcap_alone_and_sinks_alone(world):
    _run(world, 1, None, 4.0, False, split=False, seed=11 + world)
    _run(world, 1, None, None, True, split=False, seed=13 + world)


def test_window_single_rank_causal_metadata():
    """The single-rank path (causal metadata: context and new tokens read from one cache) applies the window
    and soft cap the same way, reading only the window's pages."""
    g = torch.Generator().manual_seed(5)
    window, cap = 11, 6.0
    spec = AttentionSpec(HQ, HK, D, torch.float64, BLOCK, sliding_windows=(window,), logits_soft_caps=(cap,))
    ctx, ql = [0, 30, 70], [4, 1, 9]
    total = [c + n for c, n in zip(ctx, ql)]
    keys = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) * 3 for n in total]
    values = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) for n in total]
    cache = torch.full(TorchReferenceBackend.get_kv_cache_shape(30, BLOCK, HK, D), math.nan, dtype=torch.float64)
    perm = torch.randperm(30, generator=g).tolist()
    table = torch.full((3, 12), -1, dtype=torch.int64)
    used = 0
    for r, (c, n) in enumerate(zip(ctx, total)):
        pages = perm[used:used + -(-n // BLOCK)]
        used += len(pages)
        table[r, :len(pages)] = torch.tensor(pages)
        for p in range(c):                                    # context written by index arithmetic here
            cache[0, pages[p // BLOCK], p % BLOCK] = keys[r][p]
            cache[1, pages[p // BLOCK], p % BLOCK] = values[r][p]
    md = make_causal_metadata(ql, ctx, table, BLOCK)
    q = torch.randn(sum(ql), HQ, D, generator=g, dtype=torch.float64)
    k_new = torch.cat([k[c:] for k, c in zip(keys, ctx)])
    v_new = torch.cat([v[c:] for v, c in zip(values, ctx)])
    impl = TorchReferenceBackend.get_impl_cls()(spec)
    out, lse = impl.forward(0, q, k_new, v_new, cache, TorchReferenceBackend.get_builder_cls()(spec).build(0, md))
    ref_out, ref_lse = _reference(q, keys, values, ctx, ql, window, cap, None)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_sink_enters_once_and_empty_rows():
    """Merging N shard partials then applying the sink equals attention with the sink once; rows without keys
    get out 0 and lse = sink (never NaN), and -inf partials merge to 0 / -inf before the sink."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(12, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(12, HK, D, generator=g, dtype=torch.float64)
    q = torch.randn(3, HQ, D, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 3.0, 10.0, -20.0, 0.0], dtype=torch.float64)
    parts = [attention_with_visibility(q, k, v, (torch.arange(12) % 3 == r)[None, :].expand(3, 12))
             for r in range(3)]
    out, lse = apply_sinks(*merge_attn_states([p[0] for p in parts], [p[1] for p in parts]), sinks)
    eo, el = attention_with_visibility(q, k, v, torch.ones(3, 12, dtype=torch.bool), sinks_Q=sinks)
    torch.testing.assert_close(out, eo, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, el, atol=1e-12, rtol=1e-12)
    empty_out, empty_lse = merge_attn_states(torch.zeros(2, 3, HQ, D), torch.full((2, 3, HQ), -math.inf))
    o, l = apply_sinks(empty_out, empty_lse, sinks.float())
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(l, sinks.float().expand(3, HQ))


def test_window_metadata_counts_local_keys_on_global_positions():
    """window_key_start: for each query, this rank's tokens among global positions before the window."""
    for world, interleave in ((4, 1), (3, 8), (2, 4)):
        for rank in range(world):
            md = make_dcp_context_metadata([3], [100], torch.zeros(1, 64, dtype=torch.int64), BLOCK, world, rank,
                                           interleave)
            for window in (1, 7, 33, 200):
                got = md.window_key_start(window).tolist()
                want = [sum(1 for p in range(max(0, qp - window + 1)) if owner(p, world, interleave) == rank)
                        for qp in (100, 101, 102)]
                assert got == want, (world, interleave, rank, window)
