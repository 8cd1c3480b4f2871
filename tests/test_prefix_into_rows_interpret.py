"""Issue 24's prefix pass with one merge per layer, through Triton's interpreter on the CPU: the merge kernel's INTO
mode (merge_triton.merge_into_rows_triton: N split partials into indexed rows that hold one more partial) and a TRITON
shard's forked decode steps whose forks sit anywhere in the batch (q read in place or gathered, several groups),
eager and from graph buffers, against float64.

    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch and triton> -m pytest tests/test_prefix_into_rows_interpret.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

import cpattn                                                                            # noqa: E402
from cpattn.attention import LseBase, merge_attn_states                                 # noqa: E402
from cpattn.attention.backends import triton_decode                                      # noqa: E402
from cpattn.attention.backends.triton_attn import TritonAttentionBackend                # noqa: E402
from cpattn.attention.merge_triton import merge_into_rows_triton                         # noqa: E402
from cpattn.cluster.decode_graphs import DecodeGraphs                                    # noqa: E402
from cpattn.cluster.layer_runner import ShardLayerRunner                                 # noqa: E402
from cpattn.errors import InvalidRequestError                                            # noqa: E402
from tests.reference import attention_with_visibility                                    # noqa: E402
from tests.test_prefix_merge_once import forked_step                                     # noqa: E402

BLOCK, HQ, HK, D = 16, 8, 2, 16


@pytest.mark.parametrize("n,base,dtype,seed", [(1, LseBase.E, torch.float32, 0), (3, LseBase.TWO, torch.float16, 1),
                                               (17, LseBase.E, torch.float32, 2), (40, LseBase.TWO, torch.float32, 3)])
def test_merge_into_rows_equals_the_float64_merge(n, base, dtype, seed):
    """N partials (unrolled up to 16, looped past) merged into random distinct rows that hold one more partial;
    empty partials and empty rows included; rows not named are untouched."""
    g = torch.Generator().manual_seed(seed)
    t, r, h = 11, 7, 5
    outs = torch.randn(n, r, h, D, generator=g).to(dtype)
    lses = torch.randn(n, r, h, generator=g) * 4
    lses[:, 0] = -math.inf                              # row 0: only the base partial
    lses[0, 1:3, :2] = -math.inf                        # some empty partials
    outs[0, 1:3, :2] = float("nan")                     # whose outputs must not leak
    out = torch.randn(t, h, D, generator=g).to(dtype)
    lse = torch.randn(t, h, generator=g) * 4
    rows = torch.randperm(t, generator=g)[:r]
    lse[rows[1]] = -math.inf                            # an empty suffix: the row is the partials' alone
    lse[rows[0], :1] = -math.inf                        # row 0, head 0: nothing anywhere -> 0, -inf
    before_out, before_lse = out.clone(), lse.clone()
    natural = lses.double() * (math.log(2.0) if base is LseBase.TWO else 1.0)
    ref_out, ref_lse = merge_attn_states(torch.cat([before_out[rows][None].double(), outs.double()]),
                                         torch.cat([before_lse[rows][None].double(), natural]))
    merge_into_rows_triton(outs, lses, out, lse, rows, base)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out[rows].double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[rows].double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert out[rows[0], 0].abs().max() == 0 and lse[rows[0], 0] == -math.inf
    others = torch.ones(t, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(out[others], before_out[others]) and torch.equal(lse[others], before_lse[others])
    with pytest.raises(InvalidRequestError, match="needs rows"):
        merge_into_rows_triton(outs, lses, out, lse, rows[:-1], base)


@pytest.mark.parametrize("num_shards,interleave,order,split_kv", [
    (3, 1, "axaabbxa", False),     # forks scattered: q gathered for a, read in place for the b pair; two groups
    (2, 16, "aaaabb", True),       # forks together: q read in place; the prefix pass split into several partials
    (5, 1, "xbbbaa", True),        # odd shard counts, groups after a lone sequence
])
def test_forked_steps_merge_once_and_match_float64(num_shards, interleave, order, split_kv, monkeypatch):
    if split_kv:   # short prefixes still split into several partials: the merge takes S of them and the suffix
        monkeypatch.setattr(triton_decode, "DECODE_CONFIG", dict(triton_decode.DECODE_CONFIG, block_n=16, min_tiles=1))
    cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=1, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
                               block_size=BLOCK, dtype="float16", device="cpu", dcp_interleave=interleave,
                               num_blocks_per_shard=512)
    g = torch.Generator().manual_seed(num_shards * 7 + interleave)
    fused, modes = 0, set()
    for plan in forked_step(num_shards, interleave, order, BLOCK, seed=num_shards):
        cache = torch.randn(2, 512, BLOCK, HK, D, generator=g).to(torch.float16)
        eager = ShardLayerRunner(cfg, TritonAttentionBackend, [cache.clone()], torch.device("cpu"))
        step = eager.plan(plan)
        if step.prefix_pass is None:
            continue
        q, k, v = (torch.randn(plan.num_tokens, h, D, generator=g).to(torch.float16) for h in (HQ, HK, HK))
        out, lse = eager.run_layer(step, 0, q, k, v)
        fused += step.prefix_pass.into_rows
        modes |= {grp.q_step_rows for grp in step.prefix_pass.plan.query_groups}
        if step.copies is None and step.rows is None:   # the graph's buffers give the same bits
            graphed = ShardLayerRunner(cfg, TritonAttentionBackend, [cache.clone()], torch.device("cpu"))
            mine, graphs = graphed.plan(plan), DecodeGraphs(graphed)
            key = graphs.bucket(mine.attn_metadata, mine.replica_slots, mine.prefix_pass)
            graphs.make_buffers(mine.attn_metadata, key, mine.prefix_pass)
            assert graphs.prepare(mine.attn_metadata, mine.replica_slots, mine.pieces, mine.rows, mine.prefix_pass)
            for buffer, x in ((graphs.q, q), (graphs.k, k), (graphs.v, v)):
                buffer.copy_(x)
            g_out, g_lse = graphs._layer(0)
            assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
        md, cache = plan.metadata, eager.kv_caches[0]
        rows = list(range(plan.num_tokens)) if plan.rows is None else plan.rows.tolist()
        for i, r in enumerate(rows):   # float64 attention over the keys the request's row holds on this shard
            n = int(md.seq_lens_cpu[r])
            pos = torch.arange(n)
            pages = md.block_table_tensor[r, pos // BLOCK]
            keys, values = (cache[j, pages, pos % BLOCK].double() for j in (0, 1))
            ref_out, ref_lse = attention_with_visibility(q[r:r + 1].double(), keys, values,
                                                         torch.ones(1, n, dtype=torch.bool))
            torch.testing.assert_close(out[i:i + 1].double(), ref_out, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, atol=2e-3, rtol=2e-3)
    assert fused >= 1   # some shard's step took the one-merge path
    assert modes == ({False, True} if order == "axaabbxa" else {True})   # q gathered only for scattered forks


def test_a_fork_layer_launches_one_kernel_more_than_one_question(tmp_path):
    """benchmarks/prefix_pass_launches.py's counts: 16 questions' layer is one question's plus the prefix pass (KV
    write, suffix decode, query-groups pass, one merge; no torch op), eager and from graph buffers alike."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_pass_launches.py"
    spec = importlib.util.spec_from_file_location("prefix_pass_launches", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--prefix-tokens", "4096", "--repeats", "2", "--json", str(tmp_path / "c.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    one, forks = json.loads((tmp_path / "c.json").read_text())["rows"]
    for way in ("eager", "graphed"):
        assert forks[way]["torch_ops"] == {} and forks[way]["launches"] == one[way]["launches"] + 1 == 4
        assert forks[way]["allocations"] == one[way]["allocations"]
