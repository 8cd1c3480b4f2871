"""Cascade splits over a decode run's steps: the shard keeps a block table's analysis (attention/cascade_plan.py
PrefixSplitter) while the steps bring the same table, and its answers are a fresh split's, field for field; a
shard attending the run through it is exact against a float64 oracle read from its own cache."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.attention.cascade import find_shared_prefixes
from cpattn.attention.cascade_plan import PrefixSplitter, split_shared_prefixes
from cpattn.cluster.decode_run_plans import plan_decode_run
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import table_gatherer
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator
from tests.reference import attention_with_visibility

BLOCK = 4


def _page_by_page(table, visible, block_size, min_keys):
    """The groups as first written: by first page among requests that see keys, common pages compared one by one."""
    by_first = {}
    for r, n in enumerate(visible):
        if n > 0:
            by_first.setdefault(int(table[r, 0]), []).append(r)
    out = []
    for reqs in by_first.values():
        if len(reqs) < 2:
            continue
        cap = min(visible[r] for r in reqs)
        common = 0
        while common < -(-cap // block_size) and all(int(table[r, common]) == int(table[reqs[0], common]) for r in reqs):
            common += 1
        keys = min(common * block_size, cap)
        if keys >= min_keys:
            out.append((tuple(reqs), keys))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_groups_match_a_page_by_page_reference(seed):
    rng = random.Random(seed)
    width, num_reqs = rng.randint(1, 12), rng.randint(1, 7)
    roots = [[rng.randrange(100) for _ in range(width)] for _ in range(rng.randint(1, 3))]
    rows = []
    for _ in range(num_reqs):   # a fork of a random root up to a random page, then pages of its own
        root, cut = rng.choice(roots), rng.randint(0, width)
        rows.append(root[:cut] + [rng.randrange(100, 200) for _ in range(width - cut)])
    table = torch.tensor(rows, dtype=torch.int64)
    visible = [rng.choice([0, rng.randint(1, width * BLOCK)]) for _ in range(num_reqs)]
    min_keys = rng.choice([1, BLOCK, 2 * BLOCK])
    got = find_shared_prefixes(table, torch.tensor(visible), BLOCK, min_keys=min_keys)
    assert [(g.requests, g.num_keys) for g in got] == _page_by_page(table, visible, BLOCK, min_keys)


def _forked_run(num_shards, interleave, lengths, steps, replicas=1, block=BLOCK):
    """A source sequence, forks of it at ``lengths`` (the first one the source itself), and a decode run's plans."""
    alloc = ShardedKVAllocator(num_shards, 256, block, interleave, max_rows=16, replicas=replicas)
    source = alloc.add_rows()
    alloc.finish(alloc.grow([(source, max(lengths))], [0]))
    rows = [source] + [alloc.fork_rows(source, n) for n in lengths[1:]]
    growths = grow_decode_run(alloc, rows, lengths, steps, first_step=0)
    assert len(growths) == steps
    gather = table_gatherer(alloc, rows, {})
    first = dataclasses.replace(growths[0], copies=[c for g in growths for c in g.copies])
    return plan_decode_run(alloc, rows, lengths, list(range(steps)), gather, 0, None, None, first, False, 8)


def assert_rows_match_float64(plan, cache, q, out, lse, block=BLOCK):
    """Each row a step's plan computes (its decode query, after its KV was written) equals float64 attention over
    every key its block table holds, read page by page from ``cache`` [2, pages, block, Hk, D]."""
    md = plan.metadata
    rows = list(range(plan.num_tokens)) if plan.rows is None else plan.rows.tolist()
    for i, r in enumerate(rows):
        n = int(md.seq_lens_cpu[r])
        pages = md.block_table_tensor[r, torch.arange(n) // block]
        keys, values = cache[0, pages, torch.arange(n) % block], cache[1, pages, torch.arange(n) % block]
        ref_out, ref_lse = attention_with_visibility(q[r:r + 1], keys, values, torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(out[i:i + 1], ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[i:i + 1], ref_lse, atol=1e-12, rtol=1e-12)


def _same_metadata(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f.name


@pytest.mark.parametrize("num_shards,interleave", [(3, 1), (2, 4), (5, 1)])
def test_a_kept_split_is_a_fresh_split_at_every_step(num_shards, interleave):
    lengths = [45, 45, 45, 30, 13, 45]
    runs = _forked_run(num_shards, interleave, lengths, 6)
    for rank_run in runs.ranks:
        splitter = PrefixSplitter(BLOCK)
        for j in range(6):
            md = rank_run.plan(j).metadata
            if j == 3:   # a table changed in place is analysed again (its version moved)
                md.block_table_tensor[1, 0] = 255
            kept, fresh = splitter.split(md), split_shared_prefixes(md, BLOCK)
            assert (kept is None) == (fresh is None)
            if fresh is not None:
                _same_metadata(kept.suffix, fresh.suffix)
                _same_metadata(kept.prefix, fresh.prefix)
                assert torch.equal(kept.rows, fresh.rows)
        assert splitter._kept[0] is rank_run.table   # the run's one table was kept


@pytest.mark.parametrize("num_shards,interleave,replicas", [(3, 1, 1), (2, 4, 2), (3, 4, 2)])
def test_a_shard_attending_a_run_of_forks_is_exact(num_shards, interleave, replicas):
    """Every step of the run through one runner (its kept split and device tables), the new K/V written, each
    request's partial equal to float64 attention over the keys its block-table row holds in the cache."""
    from conftest import service_config

    lengths, steps = [45, 45, 45, 30, 13, 45], 5
    cfg = service_config(num_shards=num_shards, dcp_interleave=interleave, num_layers=1, block_size=BLOCK,
                         kv_replicas=replicas, num_blocks_per_shard=256)
    runs = _forked_run(num_shards, interleave, lengths, steps, replicas)
    g = torch.Generator().manual_seed(num_shards * 10 + interleave)
    for rank_run in runs.ranks:
        cache = torch.randn(2, 256, BLOCK, cfg.num_kv_heads, cfg.head_size, generator=g, dtype=torch.float64)
        runner = ShardLayerRunner(cfg, TorchReferenceBackend, [cache], torch.device("cpu"))
        runner.split_prefixes = True   # the split block-table kernels get (TORCH would read prefixes in its loop)
        split_steps = 0
        for j in range(steps):
            plan = rank_run.plan(j)
            planned = runner.plan(plan)
            split_steps += planned.prefix_pass is not None
            t = plan.num_tokens
            q, k, v = (torch.randn(t, h, cfg.head_size, generator=g, dtype=torch.float64)
                       for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads))
            out, lse = runner.run_layer(planned, 0, q, k, v)
            assert_rows_match_float64(plan, cache, q, out, lse)
        assert split_steps == steps   # every step read the forks' prefix once


def test_a_kept_table_whose_visible_keys_grow_past_a_page_splits_again():
    """Rows sharing every page while their keys grow (the cap binds): each step's prefix is a fresh split's."""
    from cpattn.attention.metadata import make_dcp_context_metadata

    table = torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 6, 10], [3, 4, 9, 8, 11]])
    splitter = PrefixSplitter(BLOCK)
    for context in ([5, 6, 5], [9, 10, 9], [13, 14, 9], [13, 14, 16]):
        md = make_dcp_context_metadata([1, 1, 1], context, table, BLOCK, 1, 0, 1)
        md.block_table_tensor = table   # one table object over the steps, as a decode run's
        kept, fresh = splitter.split(md), split_shared_prefixes(md, BLOCK)
        assert splitter._kept[0] is table
        _same_metadata(kept.suffix, fresh.suffix)
        _same_metadata(kept.prefix, fresh.prefix)
    assert kept.prefix.seq_lens_cpu.tolist() == [2 * BLOCK]   # rows 0-2 share pages 3, 4 only
