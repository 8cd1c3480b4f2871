"""Forks on a GPU shard: the cascade split of block-table kernels (attention/cascade_plan.py: suffix pass, then
one prefix pass per group of forks, merged by LSE) against the same kernel's plain context pass, copy on write
included. Run on the GPU machine: ``python3 -m pytest -q tests/gpu/test_prefix_cascade_gpu.py``."""

from __future__ import annotations

import copy

import pytest
import torch

import cpattn
from cpattn.attention.selector import get_attn_backend
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.errors import BackendUnavailableError
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

pytestmark = pytest.mark.gpu
HQ, HK, D, BLOCK = 32, 8, 128, 16


@pytest.mark.parametrize("name", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
@pytest.mark.parametrize("num_shards,interleave", [(2, 1), (3, 16)])
def test_split_equals_the_plain_context_pass(name, num_shards, interleave):
    try:
        cls = get_attn_backend(name, head_size=D, dtype=torch.bfloat16, block_size=BLOCK, num_q_heads=HQ,
                               num_kv_heads=HK, device="cuda")
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} unavailable here: {exc.reasons}")
    cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=1, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
                               block_size=BLOCK, dtype="bfloat16", backend=name, device="cuda",
                               dcp_interleave=interleave, num_blocks_per_shard=4096)
    alloc = ShardedKVAllocator(num_shards, 4096, BLOCK, interleave, max_rows=32)
    source = alloc.add_rows()
    alloc.finish(alloc.grow([(source, 20000)], [0]))
    forks = [alloc.fork_rows(source, n) for n in [20000] * 14 + [12345]]
    rows, lengths = [source] + forks, [20000] * 15 + [12345]
    growth = alloc.grow([(r, n + 1) for r, n in zip(rows, lengths)], lengths)
    plans = plan_step(alloc, [StepRequest(r, n, 1) for r, n in zip(rows, lengths)], 1, False, 2048, growth=growth)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(len(rows), h, D, generator=g, device="cuda").to(torch.bfloat16) for h in (HQ, HK, HK))
    for plan in plans:
        cache = torch.randn(cls.get_kv_cache_shape(4096, BLOCK, HK, D), generator=g, device="cuda").to(torch.bfloat16)
        results = []
        for split in (True, False):
            caches = [cache.clone()]
            runner = ShardLayerRunner(cfg, cls, caches, torch.device("cuda"))
            runner.split_prefixes = split
            planned = runner.plan(copy.deepcopy(plan))
            assert (planned.prefix_pass is not None) == split
            out, lse = runner.run_layer(planned, 0, q, k, v)
            torch.cuda.synchronize()
            results.append((out.float(), lse.float(), caches[0]))
        (out_a, lse_a, cache_a), (out_b, lse_b, cache_b) = results
        assert (out_a - out_b).abs().max().item() < 2e-2
        assert (lse_a - lse_b).abs().max().item() < 2e-2
        assert torch.equal(cache_a, cache_b)


@pytest.mark.parametrize("num_shards,interleave", [(2, 1), (3, 16)])
def test_cascade_decode_steps_replay_captured_graphs(num_shards, interleave):
    """A decode run over forks (TRITON): every step without copies replays the shard's captured graphs, the prefix
    pass inside them (cluster/decode_graphs.py), captured once for the run; outputs equal the eager step's."""
    from tests.test_cascade_decode_runs import _forked_run

    try:
        cls = get_attn_backend("TRITON", head_size=D, dtype=torch.bfloat16, block_size=BLOCK, num_q_heads=HQ,
                               num_kv_heads=HK, device="cuda")
    except BackendUnavailableError as exc:
        pytest.skip(f"TRITON unavailable here: {exc.reasons}")
    cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=2, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
                               block_size=BLOCK, dtype="bfloat16", backend="TRITON", device="cuda",
                               dcp_interleave=interleave, num_blocks_per_shard=256)
    steps = 6
    runs = _forked_run(num_shards, interleave, [2000] * 12 + [1234], steps, block=BLOCK)
    g = torch.Generator(device="cuda").manual_seed(1)
    for rank_run in runs.ranks:
        cache = torch.randn(cls.get_kv_cache_shape(256, BLOCK, HK, D), generator=g, device="cuda").to(torch.bfloat16)
        eager = ShardLayerRunner(cfg, cls, [cache.clone(), cache.clone()], torch.device("cuda"))
        graphed = ShardLayerRunner(cfg, cls, [cache.clone(), cache.clone()], torch.device("cuda"))
        graphs = graphed.new_graphs()
        assert graphs is not None
        replayed, keys = 0, set()
        for j in range(steps):
            plan = rank_run.plan(j)
            a, b = eager.plan(copy.deepcopy(plan)), graphed.plan(copy.deepcopy(plan), graphs)
            assert a.prefix_pass is not None and a.graphs is None
            replayed += b.graphs is not None
            if b.graphs is not None:
                keys.add(b.graphs.key)
                assert b.graphs.key[4] is not None   # the prefix pass is in the bucket
            for layer in range(2):
                q, k, v = (torch.randn(plan.num_tokens, h, D, generator=g, device="cuda").to(torch.bfloat16)
                           for h in (HQ, HK, HK))
                out_a, lse_a = eager.run_layer(a, layer, q, k, v)
                out_b, lse_b = graphed.run_layer(b, layer, q, k, v)
                assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
        torch.cuda.synchronize()
        assert replayed >= steps - 1 and len(keys) == 1   # the first step may copy on write (eager)
        for layer in range(2):
            assert torch.equal(eager.kv_caches[layer], graphed.kv_caches[layer])


def test_runs_of_forks_keep_one_prefix_pass_and_equal_fresh_plans():
    """Three decode runs over forks (TRITON, graphed): the prefix pass is planned once and its graph buffers filled
    once for all of them (issue 24: ~25 device copies per step before), and every step's outputs equal an eager
    runner's that plans each step afresh (a new runner per step: nothing kept), bit for bit, KV included."""
    from tests.test_prefix_pass_kept import _runs

    try:
        cls = get_attn_backend("TRITON", head_size=D, dtype=torch.bfloat16, block_size=BLOCK, num_q_heads=HQ,
                               num_kv_heads=HK, device="cuda")
    except BackendUnavailableError as exc:
        pytest.skip(f"TRITON unavailable here: {exc.reasons}")
    cfg = cpattn.ServiceConfig(num_shards=1, num_layers=2, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
                               block_size=BLOCK, dtype="bfloat16", backend="TRITON", device="cuda",
                               num_blocks_per_shard=256)
    runs = _runs(1, 1, [1500] * 16, 4, 3, block=BLOCK, num_blocks=256)
    g = torch.Generator(device="cuda").manual_seed(3)
    cache = torch.randn(cls.get_kv_cache_shape(256, BLOCK, HK, D), generator=g, device="cuda").to(torch.bfloat16)
    kept = ShardLayerRunner(cfg, cls, [cache.clone(), cache.clone()], torch.device("cuda"))
    fresh_caches = [cache.clone(), cache.clone()]
    graphs = kept.new_graphs()
    built, build = [], kept._build_prefix
    kept._build_prefix = lambda split: built.append(split) or build(split)
    passes, replayed = set(), 0
    for run in runs:
        for j in range(len(run)):
            plan = run.ranks[0].plan(j)
            a = kept.plan(copy.deepcopy(plan), graphs)
            fresh = ShardLayerRunner(cfg, cls, fresh_caches, torch.device("cuda"))
            b = fresh.plan(copy.deepcopy(plan))
            passes.add(id(a.prefix_pass))
            replayed += a.graphs is not None
            for layer in range(2):
                q, k, v = (torch.randn(plan.num_tokens, h, D, generator=g, device="cuda").to(torch.bfloat16)
                           for h in (HQ, HK, HK))
                out_a, lse_a = kept.run_layer(a, layer, q, k, v)
                out_b, lse_b = fresh.run_layer(b, layer, q, k, v)
                assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    torch.cuda.synchronize()
    assert len(built) == 1 and len(passes) == 1 and replayed >= 12 - 3   # each run's first step may copy on write
    assert graphs.prefix_source is a.prefix_pass
    for layer in range(2):
        assert torch.equal(kept.kv_caches[layer], fresh_caches[layer])


@pytest.mark.parametrize("n", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_into_rows_on_the_gpu(n, dtype):
    """merge_triton's INTO mode on the GPU (bf16 is not in the interpreter): N split partials (unrolled up to 16,
    looped past) into random rows that hold the suffix partial, empty partials and rows included, vs float64."""
    import math

    from cpattn.attention import merge_attn_states
    from cpattn.attention.merge_triton import merge_into_rows_triton

    g = torch.Generator(device="cuda").manual_seed(n)
    t, r = 40, 16
    outs = torch.randn(n, r, HQ, D, generator=g, device="cuda")
    lses = torch.randn(n, r, HQ, generator=g, device="cuda") * 4
    lses[0, :3] = -math.inf
    out = torch.randn(t, HQ, D, generator=g, device="cuda").to(dtype)
    lse = torch.randn(t, HQ, generator=g, device="cuda") * 4
    rows = torch.randperm(t, generator=g, device="cuda")[:r]
    lse[rows[1]] = -math.inf
    ref_out, ref_lse = merge_attn_states(torch.cat([out[rows][None].double(), outs.double()]),
                                         torch.cat([lse[rows][None].double(), lses.double()]))
    untouched = out.clone()
    merge_into_rows_triton(outs, lses, out, lse, rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[rows].double(), ref_lse, atol=1e-5, rtol=1e-5)
    others = torch.ones(t, dtype=torch.bool, device="cuda")
    others[rows] = False
    assert torch.equal(out[others], untouched[others])
