"""Issue 24's prefix pass with one merge per layer, on the CPU: ops.merge.merge_into_rows (partials merged in place
into indexed rows that hold one more partial) and a shard's split steps whose forks sit anywhere in the batch (the
pass's q read as a view or gathered, its k / v never gathered), exact against float64.
The Triton paths of the same: tests/test_prefix_into_rows_interpret.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cpattn.attention import LseBase, merge_attn_states
from cpattn.attention.cascade_plan import consecutive_start
from cpattn.attention.ops.merge import merge_into_rows
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator
from tests.reference import attention_with_visibility


def forked_step(num_shards, interleave, order, block, seed):
    """One decode step's plans over a batch mixing two documents' forks and lone sequences in ``order`` ("a"/"b": a
    fork of document a/b, of all of it or a part, "x": a lone sequence), pages placed among another sequence's."""
    rng = random.Random(seed)
    alloc = ShardedKVAllocator(num_shards, 512, block, interleave, max_rows=32)
    junk = alloc.add_rows()
    grown = 0

    def scatter():   # another sequence's pages in between: the documents' pages are not consecutive
        nonlocal grown
        grown += rng.randint(1, 3) * block * num_shards
        alloc.finish(alloc.grow([(junk, grown)], [grown]))

    docs, rows, lengths = {}, [], []
    for name, n in (("a", rng.randint(150, 260)), ("b", rng.randint(100, 200))):
        scatter()
        docs[name] = (alloc.add_rows(), n)
        alloc.finish(alloc.grow([(docs[name][0], n)], [0]))
    for kind in order:
        scatter()
        if kind == "x":
            row, n = alloc.add_rows(), rng.randint(20, 90)
            alloc.finish(alloc.grow([(row, n)], [0]))
        else:
            source, full = docs[kind]
            n = rng.choice([full, full - rng.randint(1, 40)])
            row = alloc.fork_rows(source, n)
        rows.append(row)
        lengths.append(n)
    growth = alloc.grow([(r, n + 1) for r, n in zip(rows, lengths)], lengths)
    return plan_step(alloc, [StepRequest(r, n, 1) for r, n in zip(rows, lengths)], 1, False, 1 << 20, growth=growth)


@pytest.mark.parametrize("n,base,seed", [(1, LseBase.E, 0), (2, LseBase.TWO, 1), (5, LseBase.E, 2)])
def test_merge_into_rows_equals_the_float64_merge(n, base, seed):
    """Random distinct rows in random order; empty partials, an empty base row and a row empty everywhere."""
    g = torch.Generator().manual_seed(seed)
    t, r, h, d = 9, 5, 3, 8
    outs = torch.randn(n, r, h, d, generator=g, dtype=torch.float64)
    lses = torch.randn(n, r, h, generator=g, dtype=torch.float64) * 4
    lses[:, 0] = -math.inf
    outs[0, 1, :] = float("nan")      # an empty partial's output never leaks
    lses[0, 1, :] = -math.inf
    out = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    lse = torch.randn(t, h, generator=g, dtype=torch.float64) * 4
    rows = torch.randperm(t, generator=g)[:r]
    lse[rows[2]] = -math.inf
    lse[rows[0], 0] = -math.inf
    before_out, before_lse = out.clone(), lse.clone()
    natural = lses * (math.log(2.0) if base is LseBase.TWO else 1.0)
    ref_out, ref_lse = merge_attn_states(torch.cat([before_out[rows][None], outs]),
                                         torch.cat([before_lse[rows][None], natural]))
    got_out, got_lse = merge_into_rows(out, lse, rows, outs, lses, base)
    assert got_out is out and got_lse is lse   # in place
    torch.testing.assert_close(out[rows], ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[rows], ref_lse, atol=1e-12, rtol=1e-12)
    assert out[rows[0], 0].abs().max() == 0 and lse[rows[0], 0] == -math.inf
    others = torch.ones(t, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], before_out[others]) and torch.equal(lse[others], before_lse[others])


def test_consecutive_start():
    assert consecutive_start(torch.tensor([3, 4, 5])) == 3
    assert consecutive_start(torch.tensor([3, 5, 6])) is None
    assert consecutive_start(torch.tensor([4, 3])) is None


@pytest.mark.parametrize("num_shards,interleave,order,heads", [
    (3, 1, "axaabbxa", (4, 2)),      # a's forks scattered (q gathered), b's together (q a view)
    (2, 16, "aaaabb", (8, 2)),       # forks together
    (5, 1, "xbbbaa", (4, 1)),        # odd shard count, MQA
    (3, 16, "babxab", (6, 3)),
])
def test_split_steps_over_scattered_forks_are_exact(num_shards, interleave, order, heads):
    """A shard's split step (TORCH's kernel on the block-table split every block-table backend gets: suffix pass, one
    prefix pass per group, merged into the suffix rows in place) equals float64 attention over each row's keys."""
    from conftest import service_config
    from cpattn.attention.backends.torch_ref import TorchReferenceBackend
    from cpattn.cluster.layer_runner import ShardLayerRunner

    block, (hq, hk) = 16, heads
    cfg = service_config(num_shards=num_shards, dcp_interleave=interleave, num_layers=1, block_size=block,
                         num_q_heads=hq, num_kv_heads=hk, num_blocks_per_shard=512)
    g = torch.Generator().manual_seed(num_shards * 31 + interleave)
    starts, split_steps = set(), 0
    for plan in forked_step(num_shards, interleave, order, block, seed=num_shards + interleave):
        cache = torch.randn(2, 512, block, hk, cfg.head_size, generator=g, dtype=torch.float64)
        runner = ShardLayerRunner(cfg, TorchReferenceBackend, [cache], torch.device("cpu"))
        runner.split_prefixes = True   # the block-table kernels' split (TORCH reads prefixes in its own loop)
        step = runner.plan(plan)
        if step.prefix_pass is None:
            continue
        split_steps += 1
        starts.add(step.prefix_pass.q_start is not None)
        assert not step.prefix_pass.into_rows   # TORCH has no attend_into_rows: the generic pass and merge
        q, k, v = (torch.randn(plan.num_tokens, h, cfg.head_size, generator=g, dtype=torch.float64)
                   for h in (hq, hk, hk))
        out, lse = runner.run_layer(step, 0, q, k, v)
        md = plan.metadata
        rows = list(range(plan.num_tokens)) if plan.rows is None else plan.rows.tolist()
        for i, r in enumerate(rows):
            n = int(md.seq_lens_cpu[r])
            pos = torch.arange(n)
            pages = md.block_table_tensor[r, pos // block]
            ref_out, ref_lse = attention_with_visibility(q[r:r + 1], cache[0, pages, pos % block],
                                                         cache[1, pages, pos % block], torch.ones(1, n, dtype=torch.bool))
            torch.testing.assert_close(out[i:i + 1], ref_out, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(lse[i:i + 1], ref_lse, atol=1e-12, rtol=1e-12)
    assert split_steps >= 1
    assert starts == ({False} if order in ("axaabbxa", "babxab") else {True})
