"""A TRITON shard's decode steps over a dynamic-scale fp8 cache from its graph buffers (cluster/decode_graphs.py:
the written pages derived once per step, each layer's scales grown from them inside the layer's graph) equal the
eager steps (PageScaleWrites planned per step) byte for byte, caches and scales included, over several layers and
steps with replica writes; through Triton's interpreter on the CPU.

    TRITON_INTERPRET=1 PYTHONPATH=. <a python with torch and triton> -m pytest tests/test_fp8_graphs_interpret.py
Skipped where triton is missing (the CPU suite's venv) or a GPU is present (tests/gpu/test_decode_graphs_gpu.py
replays the captured graphs there).
"""

from __future__ import annotations

import os
import random

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
from cpattn.kvstore.fp8 import fp8_dtype, page_scales_of, quantize                       # noqa: E402
from tests.test_cascade_decode_runs import _forked_run                                   # noqa: E402

BLOCK, LAYERS = 16, 2


def _fp8_state(gen, hk, d, fmt):
    values = torch.randn(2, 256, BLOCK, hk, d, generator=gen, dtype=torch.float64)
    scales = page_scales_of(values, fmt)
    return quantize(values, scales[:, :, None, :, None], fp8_dtype(fmt)), scales.float()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_graph_buffers_grow_fp8_scales_as_the_eager_steps_do(fmt, replicas):
    seed = int(os.environ.get("SEED", random.randrange(1 << 30)))
    hq, hk, d, steps, shards = 8, 2, 16, 4, 3
    cfg = cpattn.ServiceConfig(num_shards=shards, num_layers=LAYERS, num_q_heads=hq, num_kv_heads=hk, head_size=d,
                               block_size=BLOCK, dtype="float16", device="cpu", kv_cache_dtype=fmt,
                               num_blocks_per_shard=256, kv_replicas=replicas)
    runs = _forked_run(shards, 1, [47, 47, 30, 47], steps, replicas=replicas, block=BLOCK)
    g = torch.Generator().manual_seed(seed)
    graphed_steps = 0
    for rank_run in runs.ranks:
        state = [_fp8_state(g, hk, d, fmt) for _ in range(LAYERS)]
        eager = ShardLayerRunner(cfg, TritonAttentionBackend, [c.clone() for c, _ in state], torch.device("cpu"),
                                 kv_scales=[s.clone() for _, s in state])
        graphed = ShardLayerRunner(cfg, TritonAttentionBackend, [c.clone() for c, _ in state], torch.device("cpu"),
                                   kv_scales=[s.clone() for _, s in state])
        graphs = DecodeGraphs(graphed)
        for j in range(steps):
            plan = rank_run.plan(j)
            step, mine = eager.plan(plan), graphed.plan(plan)
            key = graphs.bucket(mine.attn_metadata, mine.replica_slots, mine.prefix_pass)
            eager_only = mine.copies is not None or mine.rows is not None or key is None
            if not eager_only and graphs.key is None:   # buffers made once, as a capture makes them
                graphs.make_buffers(mine.attn_metadata, key, mine.prefix_pass)
                graphs.key = key
            if not eager_only:
                assert graphs.key == key and graphs.written is not None
                assert graphs.prepare(mine.attn_metadata, mine.replica_slots, mine.pieces, mine.rows, mine.prefix_pass)
            for layer in range(LAYERS):
                t = plan.num_tokens
                q, k, v = (torch.randn(t, h, d, generator=g).to(torch.float16) for h in (hq, hk, hk))
                k[0, 0] *= 2.0 ** (4 * layer + j)            # outliers that grow this layer's page scales
                out, lse = eager.run_layer(step, layer, q, k, v)
                if eager_only:
                    graphed.run_layer(mine, layer, q, k, v)
                    continue
                graphs.q.copy_(q)
                graphs.k.copy_(k)
                graphs.v.copy_(v)
                g_out, g_lse = graphs._layer(layer)
                torch.testing.assert_close(g_out, out, atol=0, rtol=0, msg=f"seed {seed}")
                torch.testing.assert_close(g_lse, lse, atol=0, rtol=0, msg=f"seed {seed}")
            graphed_steps += not eager_only
            for layer in range(LAYERS):
                assert torch.equal(graphed.kv_scales[layer], eager.kv_scales[layer]), seed
                assert torch.equal(graphed.kv_caches[layer].view(torch.uint8), eager.kv_caches[layer].view(torch.uint8)), seed
    assert graphed_steps >= shards * (steps - 1)
