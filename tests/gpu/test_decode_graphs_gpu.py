"""CUDA-graphed decode (cluster.decode_graphs) on the GPU: the same outputs as eager launches and as the
float64 oracle, across growing contexts that change the split count and the block-table width bucket,
kv_replicas=2 writes, sequences whose context lives on one shard only, and a mixed step in between
(which runs eagerly and must leave the graphs valid); fp8 caches with dynamic page scales, grown inside the
graphs (kvstore/fp8_graphed.py), bit for bit as the eager steps grow them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _service(graphs: str, replicas: int, windows: bool = False, kv: str = "auto"):
    from cpattn.config import ServiceConfig
    from test_fp8_kv_cache import InProcessService

    cfg = ServiceConfig(num_shards=3, num_layers=3, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                        dtype="bfloat16", backend="TRITON", device="cuda", num_gpus_per_shard=0.25,
                        num_blocks_per_shard=512, dcp_interleave=16, kv_replicas=replicas, cuda_graphs=graphs,
                        pcp_min_tokens=64, kv_cache_dtype=kv,
                        # windows (global positions, planned per step into the graphs' buffers) and a soft cap
                        sliding_window=[None, 300, 64] if windows else None,
                        logits_soft_cap=[None, 20.0, None] if windows else None)

    class Graphed(InProcessService):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.graphs = [w.runner.new_graphs() for w in self.workers]
            self.graphed_steps = 0

        def step(self, request, layers_qkv, sinks):
            from cpattn.attention.ops.merge import merge_rows
            from cpattn.cluster.step_planner import StepRequest, plan_step

            reqs = [StepRequest(self.rows[s], self.lens[s], n) for s, n in request.items()]
            self.alloc.grow([(self.rows[s], self.lens[s] + n) for s, n in request.items()])
            self.step_id += 1
            plans = plan_step(self.alloc, reqs, self.step_id, cfg.pcp_enabled, cfg.pcp_min_tokens)
            planned = [w.runner.plan(p, g) for w, p, g in zip(self.workers, plans, self.graphs)]
            self.graphed_steps += planned[0].graphs is not None   # shard 0 holds every sequence's first tokens
            outs = []
            for layer, (q, k, v) in enumerate(layers_qkv):
                parts = [(pl.rows, *w.runner.run_layer(pl, layer, q, k, v)) for w, pl in zip(self.workers, planned)]
                parts = [p for p, pl in zip(parts, plans) if pl.num_rows]
                outs.append(merge_rows(parts, q.shape[0], sinks[layer]).clone())
            for s, n in request.items():
                self.lens[s] += n
            return outs

    return cfg, Graphed(cfg)


@pytest.mark.parametrize("replicas, windows, kv", [(1, False, "auto"), (2, False, "auto"), (1, True, "auto"),
                                                   (1, False, "fp8_e4m3"), (2, True, "fp8_e5m2")])
def test_graphed_decode_matches_eager_and_float64(replicas, windows, kv):
    from test_fp8_kv_cache import _oracle

    g = torch.Generator().manual_seed(7 + replicas)
    cfg, graphed = _service("auto", replicas, windows, kv)
    _, eager = _service("off", replicas, windows, kv)
    bound = {"auto": 1e-2, "fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}[kv]
    assert graphed.graphs[0] is not None and eager.graphs[0] is None
    seqs = [graphed.add() for _ in range(3)]
    for _ in seqs:
        eager.add()
    history, sinks = {}, [None] * cfg.num_layers
    # Prefill (eager), then decodes; one sequence short (context on one shard only), growth across buckets.
    steps = [{seqs[0]: 40, seqs[1]: 5, seqs[2]: 700}] + [{s: 1 for s in seqs}] * 3
    steps += [{seqs[0]: 1, seqs[1]: 20, seqs[2]: 1}] + [{s: 1 for s in seqs}] * 2
    steps += [{seqs[0]: 1500, seqs[2]: 900}] + [{s: 1 for s in seqs}] * 3
    worst = 0.0
    for request in steps:
        t = sum(request.values())
        layers = [tuple(torch.randn(t, h, cfg.head_size, generator=g, dtype=torch.float64)
                        for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads)) for _ in range(cfg.num_layers)]
        expected = _oracle(cfg, history, request, layers, sinks)
        dev = [tuple(x.to("cuda", torch.bfloat16) for x in qkv) for qkv in layers]
        got, ref = graphed.step(request, dev, sinks), eager.step(request, dev, sinks)
        for o, r, e in zip(got, ref, expected):
            torch.testing.assert_close(o, r, atol=0, rtol=0)     # the same kernels, replayed
            rel = float((o.double().cpu() - e).norm() / e.norm())
            worst = max(worst, rel)
            assert rel < bound, (request, rel)
    assert graphed.graphed_steps == 8, graphed.graphed_steps     # every decode-only step replayed graphs
    assert len({g.key for g in graphed.graphs if g is not None}) >= 1
