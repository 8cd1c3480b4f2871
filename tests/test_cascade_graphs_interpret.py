"""A TRITON shard's decode step over forks from its graph buffers (cluster/decode_graphs.py: the suffix pass, the
prefix pass of query groups, their merge, all from buffers refilled per step) equals the eager step, and both
equal float64 attention over the keys each request's row holds; through Triton's interpreter on the CPU.

    TRITON_INTERPRET=1 PYTHONPATH=. <a python with torch and triton> -m pytest tests/test_cascade_graphs_interpret.py
Skipped where triton is missing (the CPU suite's venv) or a GPU is present (tests/gpu/test_prefix_cascade_gpu.py
replays the captured graphs there).
"""

from __future__ import annotations

import os

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

import cpattn                                                                            # noqa: E402
from cpattn.attention.backends.triton_attn import TritonAttentionBackend                # noqa: E402
from cpattn.cluster.decode_graphs import DecodeGraphs                                    # noqa: E402
from cpattn.cluster.layer_runner import ShardLayerRunner                                 # noqa: E402
from tests.reference import attention_with_visibility                                    # noqa: E402
from tests.test_cascade_decode_runs import _forked_run                                   # noqa: E402

BLOCK = 16


@pytest.mark.parametrize("num_shards,interleave", [(3, 1), (2, 16)])
def test_graph_buffers_replay_the_eager_cascade_step(num_shards, interleave):
    hq, hk, d, steps = 8, 2, 16, 4
    lengths = [130, 130, 130, 97, 130]   # four forks share the source's pages, one copies its last page on write
    cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=1, num_q_heads=hq, num_kv_heads=hk, head_size=d,
                               block_size=BLOCK, dtype="float16", device="cpu", dcp_interleave=interleave,
                               num_blocks_per_shard=256)
    runs = _forked_run(num_shards, interleave, lengths, steps, block=BLOCK)
    g = torch.Generator().manual_seed(num_shards)
    graphed_steps = 0
    for rank_run in runs.ranks:
        cache = torch.randn(2, 256, BLOCK, hk, d, generator=g).to(torch.float16)
        eager = ShardLayerRunner(cfg, TritonAttentionBackend, [cache.clone()], torch.device("cpu"))
        graphed = ShardLayerRunner(cfg, TritonAttentionBackend, [cache.clone()], torch.device("cpu"))
        graphs = DecodeGraphs(graphed)
        for j in range(steps):
            plan = rank_run.plan(j)
            q, k, v = (torch.randn(plan.num_tokens, h, d, generator=g).to(torch.float16) for h in (hq, hk, hk))
            step = eager.plan(plan)
            out, lse = eager.run_layer(step, 0, q, k, v)
            mine = graphed.plan(plan)
            if mine.copies is not None or mine.rows is not None:   # copy on write, row subsets: eager (as on a GPU)
                graphed.run_layer(mine, 0, q, k, v)
                continue
            key = graphs.bucket(mine.attn_metadata, mine.replica_slots, mine.prefix_pass)
            assert key is not None and key[4] is not None   # the prefix pass has a bucket too
            if graphs.key is None:   # buffers made once, from this step's plan, as a capture makes them
                graphs.make_buffers(mine.attn_metadata, key, mine.prefix_pass)
                graphs.key = key
            assert graphs.key == key   # a decode loop over the same forks stays in its bucket
            assert graphs.prepare(mine.attn_metadata, mine.replica_slots, mine.pieces, mine.rows, mine.prefix_pass)
            graphs.q.copy_(q)
            graphs.k.copy_(k)
            graphs.v.copy_(v)
            g_out, g_lse = graphs._layer(0)
            graphed_steps += 1
            torch.testing.assert_close(g_out, out, atol=0, rtol=0)
            torch.testing.assert_close(g_lse, lse, atol=0, rtol=0)
            assert torch.equal(graphed.kv_caches[0], eager.kv_caches[0])
            md = plan.metadata   # and float64 attention over each request's keys in the cache
            for r in range(plan.num_tokens):
                n = int(md.seq_lens_cpu[r])
                pos = torch.arange(n)
                pages = md.block_table_tensor[r, pos // BLOCK]
                keys, values = (eager.kv_caches[0][i, pages, pos % BLOCK].double() for i in (0, 1))
                ref_out, ref_lse = attention_with_visibility(q[r:r + 1].double(), keys, values,
                                                             torch.ones(1, n, dtype=torch.bool))
                torch.testing.assert_close(out[r:r + 1].double(), ref_out, atol=2e-3, rtol=2e-3)
                torch.testing.assert_close(lse[r:r + 1].double(), ref_lse, atol=2e-3, rtol=2e-3)
    assert graphed_steps >= num_shards * (steps - 1)
