"""Cascade attention in the TORCH backend: requests sharing a prefix's pages (forks) read those pages once per
layer, and the outputs match the independent float64 oracle (tests/reference.py) exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import cpattn.attention.backends.torch_ref as torch_ref
from cpattn.attention.ops import reference
from cpattn.attention import AttentionSpec, make_causal_metadata
from cpattn.attention.cascade import find_shared_prefixes
from cpattn.attention.metadata import make_dcp_context_metadata
from cpattn.kvstore import PAD_BLOCK_ID
from tests.reference import attention_with_visibility, causal_visibility

BLOCK = 4


class ForkedBatch:
    """Requests forked from one root history: request i shares the root's pages holding its first ``cuts[i]``
    keys (whole pages only; a partly covered page is its own copy, as copy on write leaves it), then has keys
    of its own. Pages are a random permutation; pages nobody holds are NaN."""

    def __init__(self, cuts, own, query_lens, hk, hq, d, seed):
        g = torch.Generator().manual_seed(seed)
        root_len = max(cuts)
        root_k, root_v = (torch.randn(root_len, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
        self.keys, self.values, self.context_lens = [], [], []
        for cut, n, ql in zip(cuts, own, query_lens):
            extra_k, extra_v = (torch.randn(n + ql, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
            self.keys.append(torch.cat([root_k[:cut], extra_k]))
            self.values.append(torch.cat([root_v[:cut], extra_v]))
            self.context_lens.append(cut + n)
        self.query_lens = query_lens
        self.q = torch.randn(sum(query_lens), hq, d, generator=g, dtype=torch.float64)
        num_blocks = 200
        perm = torch.randperm(num_blocks, generator=g).tolist()
        root_pages = [perm.pop() for _ in range(-(-root_len // BLOCK))]
        width = max(-(-len(k) // BLOCK) for k in self.keys) + 1
        self.table = torch.full((len(cuts), width), PAD_BLOCK_ID, dtype=torch.int64)
        for r, (cut, k) in enumerate(zip(cuts, self.keys)):
            shared = cut // BLOCK
            pages = root_pages[:shared] + [perm.pop() for _ in range(-(-len(k) // BLOCK) - shared)]
            self.table[r, :len(pages)] = torch.tensor(pages)
        self.cache = torch.full((2, num_blocks, BLOCK, hk, d), math.nan, dtype=torch.float64)
        for r, c in enumerate(self.context_lens):
            for p in range(c):
                page = int(self.table[r, p // BLOCK])
                self.cache[0, page, p % BLOCK], self.cache[1, page, p % BLOCK] = self.keys[r][p], self.values[r][p]

    def new_kv(self):
        return (torch.cat([k[c:] for k, c in zip(self.keys, self.context_lens)]),
                torch.cat([v[c:] for v, c in zip(self.values, self.context_lens)]))


def _impl(hq, hk, d, soft_cap=None):
    spec = AttentionSpec(hq, hk, d, torch.float64, BLOCK, logits_soft_caps=(soft_cap,))
    return torch_ref.TorchMetadataBuilder(spec), torch_ref.TorchAttentionImpl(spec)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hk,soft_cap,seed", [(4, 2, None, 0), (3, 1, 2.5, 1), (2, 2, None, 2)])
def test_cascade_matches_the_oracle_and_reads_the_prefix_once(monkeypatch, causal, hq, hk, soft_cap, seed):
    cuts, own, qlens = [37, 37, 22, 30, 9], [0, 3, 5, 1, 2], [1, 1, 4, 1, 2]
    batch = ForkedBatch(cuts, own, qlens, hk, hq, 8, seed)
    builder, impl = _impl(hq, hk, 8, soft_cap)
    if causal:
        md = make_causal_metadata(qlens, batch.context_lens, batch.table, BLOCK)
    else:
        md = make_dcp_context_metadata(qlens, batch.context_lens, batch.table, BLOCK, 1, 0, 1)
    plan = builder.build(0, md)
    # Requests 0-3 share at least the root's first 5 pages; request 4 (9 root keys) shares its 2 whole pages, so the
    # group's prefix is the 2 pages all five share (8 keys), and everything after is read per request.
    assert plan.shared_prefixes == find_shared_prefixes(batch.table, torch.tensor(batch.context_lens), BLOCK)
    assert [(p.requests, p.num_keys) for p in plan.shared_prefixes] == [((0, 1, 2, 3, 4), 8)]
    reads = []
    real_gather = reference.gather_request_kv

    def counting_gather(cache, row, seq_len, first_key=0, *args):
        first_page = min(first_key // BLOCK, -(-seq_len // BLOCK))
        reads.extend(row[first_page:-(-seq_len // BLOCK)].tolist())
        return real_gather(cache, row, seq_len, first_key, *args)

    monkeypatch.setattr(reference, "gather_request_kv", counting_gather)   # torch_ref reads it there
    k_new, v_new = batch.new_kv()
    out, lse = impl.forward(0, batch.q, k_new, v_new, batch.cache.clone(), plan)
    root_pages = batch.table[0, :2].tolist()
    assert [reads.count(p) for p in root_pages] == [1, 1]          # the shared prefix, once for five requests
    start = 0
    for r, ql in enumerate(qlens):
        keys, values = batch.keys[r], batch.values[r]
        if causal:
            visible = causal_visibility(ql, len(keys))
        else:   # a shard's context partial: every query sees the keys held before the step
            keys, values = keys[:batch.context_lens[r]], values[:batch.context_lens[r]]
            visible = torch.ones(ql, len(keys), dtype=torch.bool)
        ref_out, ref_lse = attention_with_visibility(batch.q[start:start + ql], keys, values, visible,
                                                     soft_cap=soft_cap)
        torch.testing.assert_close(out[start:start + ql], ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[start:start + ql], ref_lse, atol=1e-12, rtol=1e-12)
        start += ql


def test_groups_are_the_common_pages_within_the_keys_every_member_sees():
    table = torch.tensor([[5, 6, 7], [5, 8, 9], [1, 2, 3]])
    assert [(g.requests, g.num_keys) for g in find_shared_prefixes(table, torch.tensor([12, 12, 12]), BLOCK)] == [
        ((0, 1), 4)]
    groups = find_shared_prefixes(table, torch.tensor([12, 3, 12]), BLOCK)
    assert [(g.requests, g.num_keys) for g in groups] == [((0, 1), 3)]   # only the keys both see
    assert find_shared_prefixes(table, torch.tensor([12, 3, 12]), BLOCK, min_keys=4) == ()
    assert find_shared_prefixes(table[[0, 2]], torch.tensor([12, 12]), BLOCK) == ()


@pytest.mark.parametrize("hq,hk,seed", [(4, 2, 3), (2, 1, 4)])
def test_split_for_block_table_kernels_matches_the_oracle(hq, hk, seed):
    """The split every block-table backend runs (attention/cascade_plan.py), checked with the TORCH kernel on
    plain metadata (no internal cascade): suffix pass (writes the new K/V) + prefix pass, merged, is exact."""
    from cpattn.attention.cascade_plan import merge_prefix_rows, split_shared_prefixes

    cuts, own, qlens = [37, 37, 22, 30, 9, 0], [0, 3, 5, 1, 2, 6], [1, 1, 4, 1, 2, 1]
    batch = ForkedBatch(cuts, own, qlens, hk, hq, 8, seed)
    _, impl = _impl(hq, hk, 8)
    md = make_dcp_context_metadata(qlens, batch.context_lens, batch.table, BLOCK, 1, 0, 1, fold_decodes=True)
    split = split_shared_prefixes(md, BLOCK)
    assert split.prefix.num_reqs == 1 and split.prefix.seq_lens_cpu.tolist() == [8]
    assert split.rows.tolist() == list(range(sum(qlens[:5])))       # every query of the five forks
    assert split_shared_prefixes(make_causal_metadata(qlens, batch.context_lens, batch.table, BLOCK), BLOCK) is None
    k_new, v_new = batch.new_kv()
    cache = batch.cache.clone()
    out, lse = impl.forward(0, batch.q, k_new, v_new, cache, split.suffix)
    p_out, p_lse = impl.forward(0, batch.q[split.rows], k_new[split.rows], v_new[split.rows], cache, split.prefix)
    out, lse = merge_prefix_rows(out, lse, split.rows, p_out, p_lse)
    ref_cache = batch.cache.clone()
    ref_out, ref_lse = impl.forward(0, batch.q, k_new, v_new, ref_cache, md)   # plain metadata: no cascade
    assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))       # same KV written, nothing else
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    start = 0
    for r, ql in enumerate(qlens):   # and the oracle: decodes see their own new key (fold_decodes)
        n = batch.context_lens[r] + (1 if ql == 1 else 0)
        visible = torch.ones(ql, n, dtype=torch.bool)
        o, l = attention_with_visibility(batch.q[start:start + ql], batch.keys[r][:n], batch.values[r][:n], visible)
        torch.testing.assert_close(out[start:start + ql], o, atol=1e-12, rtol=1e-12)
        start += ql


@pytest.mark.parametrize("num_shards,interleave", [(3, 1), (2, 4)])
def test_shard_runner_split_equals_the_plain_context_pass(num_shards, interleave):
    """A shard's step over forks (copy on write included), run with the split that block-table kernels get and
    without it: same outputs and LSEs (float64), same KV written, on every rank."""
    from conftest import service_config
    from cpattn.attention.backends.torch_ref import TorchReferenceBackend
    from cpattn.cluster.layer_runner import ShardLayerRunner
    from cpattn.cluster.step_planner import StepRequest, plan_step
    from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

    cfg = service_config(num_shards=num_shards, dcp_interleave=interleave, num_layers=1, block_size=4)
    alloc = ShardedKVAllocator(num_shards, 64, 4, interleave, max_rows=8)
    source = alloc.add_rows()
    alloc.finish(alloc.grow([(source, 45)], [0]))
    forks = [alloc.fork_rows(source, n) for n in (45, 45, 30)]
    rows, lengths, new = [source] + forks, [45, 45, 45, 30], [1, 1, 3, 1]
    growth = alloc.grow([(r, n + m) for r, n, m in zip(rows, lengths, new)], lengths)
    assert growth.copies                                        # the forks' first writes copy shared pages
    plans = plan_step(alloc, [StepRequest(r, n, m) for r, n, m in zip(rows, lengths, new)], 1, False, 8,
                      growth=growth)
    g = torch.Generator().manual_seed(num_shards)
    q, k, v = (torch.randn(sum(new), h, cfg.head_size, generator=g, dtype=torch.float64)
               for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads))
    for rank, plan in enumerate(plans):
        cache = torch.randn(2, 64, 4, cfg.num_kv_heads, cfg.head_size, generator=g, dtype=torch.float64)
        results = []
        for split in (True, False):
            caches = [cache.clone()]
            runner = ShardLayerRunner(cfg, TorchReferenceBackend, caches, torch.device("cpu"))
            runner.split_prefixes = split
            planned = runner.plan(copy.deepcopy(plan))
            assert (planned.prefix_pass is not None) == split
            results.append((*runner.run_layer(planned, 0, q, k, v), caches[0]))
        (out_a, lse_a, cache_a), (out_b, lse_b, cache_b) = results
        torch.testing.assert_close(out_a, out_b, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse_a, lse_b, atol=1e-12, rtol=1e-12)
        assert torch.equal(cache_a, cache_b)
