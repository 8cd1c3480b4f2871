"""Cascade attention in the TORCH backend: requests sharing a prefix's pages (forks) read those pages once per
layer, and the outputs match the independent float64 oracle (tests/reference.py) exactly."""

from __future__ import annotations

import math

import pytest
import torch

import cpattn.attention.backends.torch_ref as torch_ref
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
    real_gather = torch_ref.gather_request_kv

    def counting_gather(cache, row, seq_len, first_key=0, *args):
        first_page = min(first_key // BLOCK, -(-seq_len // BLOCK))
        reads.extend(row[first_page:-(-seq_len // BLOCK)].tolist())
        return real_gather(cache, row, seq_len, first_key, *args)

    monkeypatch.setattr(torch_ref, "gather_request_kv", counting_gather)
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
