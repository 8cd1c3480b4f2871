"""svc.decode_graph on the GPU: a toy model's whole decode forward (attend + a matmul between layers, TRITON, bf16)
captured in one CUDA graph and replayed per token. Every layer's output vs float64 attention on the same q/k/v,
the final hidden state vs the same forward run eagerly through the public API on twin sequences, a replayed step
with NaN rolled back, and a graph that does not fit (gloo, cuda_graphs off) refused with every reason.
Shards: on one GPU in this process (one shard; two shards merged here), and two GPUs (one in-process, one over
NCCL replaying its own step graph)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_data_plane_gpu import _config  # noqa: E402

pytestmark = pytest.mark.gpu

M = 64   # the toy model's width


class GpuToy:
    """L layers of q/k/v projections, attention and a small matmul back, bf16 on CUDA. ``forward`` returns the final
    hidden state and, per layer, q, k, v and attention's output (so each layer is checked against float64)."""

    def __init__(self, cfg, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        hq, hk, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=g) / rows ** 0.5).to("cuda", torch.bfloat16)

        self.w = [(w(M, hq * d), w(M, hk * d), w(M, hk * d), w(hq * d, M)) for _ in range(cfg.num_layers)]

    def forward(self, x, attend):
        cfg, t = self.cfg, x.shape[0]
        seen = []
        for layer, (wq, wk, wv, wo) in enumerate(self.w):
            q = (x @ wq).view(t, cfg.num_q_heads, cfg.head_size)
            k = (x @ wk).view(t, cfg.num_kv_heads, cfg.head_size)
            v = (x @ wv).view(t, cfg.num_kv_heads, cfg.head_size)
            out = attend(layer, q, k, v)
            seen.append(torch.cat([q, k, v, out], dim=1))
            x = x + torch.tanh(out.reshape(t, -1) @ wo)
        return x, torch.stack(seen)


def _check_layers(cfg, oracle, request: dict[str, int], seen):
    """Each layer's attention output vs float64 attention on its q/k/v over the oracle's history; commits."""
    hq, hk = cfg.num_q_heads, cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        q, k, v, out = seen[layer].cpu().split([hq, hk, hk, hq], dim=1)
        ref, new_kv = oracle.reference(request, layer, q, k, v)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"{request} layer {layer}: relative error {rel:.2e}"
        oracle.commit(new_kv)


def _run(cfg, tokens: int = 10):
    import cpattn
    from cpattn.errors import InvalidRequestError
    from service_oracle import Oracle

    svc = cpattn.start(cfg)
    try:
        model, oracle = GpuToy(cfg, seed=3), Oracle(cfg, seed=5)
        graphed, twins = [svc.add_sequence(), svc.add_sequence()], [svc.add_sequence(), svc.add_sequence()]
        prompt = torch.randn(300, M, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
        for ids in (graphed, twins):   # the same prompt: the twins' KV is the graphed sequences' KV
            with svc.step({ids[0]: 200, ids[1]: 100}) as step:
                _, seen = model.forward(prompt, step.attend)
            if ids is graphed:
                _check_layers(cfg, oracle, {ids[0]: 200, ids[1]: 100}, seen)
        x = torch.zeros(2, M, dtype=torch.bfloat16, device="cuda")
        graph = svc.decode_graph(graphed, lambda step: model.forward(x, step.attend))
        assert graph.mode == "cuda_graph", graph.reasons
        gen = torch.Generator().manual_seed(9)
        hows = []
        for i in range(tokens):
            x.copy_(torch.randn(2, M, generator=gen).to("cuda", torch.bfloat16))
            final, seen = graph.step()
            hows.append(graph.last)
            with svc.step({s: 1 for s in twins}) as step:   # the same forward, eagerly, through the public API
                eager_final, eager_seen = model.forward(x, step.attend)
            rel = ((final.double() - eager_final.double()).norm() / eager_final.double().norm()).item()
            assert rel < 5e-3, f"token {i} ({graph.last}): graph vs eager relative difference {rel:.2e}"
            _check_layers(cfg, oracle, {s: 1 for s in graphed}, seen)
            if i == tokens // 2:   # a replayed step whose q|k|v hold NaN: rolled back on the device's flag
                assert graph.last == "replayed", hows
                x[0, 0] = float("nan")
                lengths = svc.sequences()
                with pytest.raises(InvalidRequestError, match="NaN or inf"):
                    graph.step()
                assert svc.sequences() == lengths
        assert hows[0] == "eager" and "captured" in hows and hows.count("replayed") >= tokens // 2, hows
        assert graph.counts["replayed"] >= tokens // 2
        assert [svc.sequence_length(s) for s in graphed] == [200 + tokens, 100 + tokens]
        graph.close()
    finally:
        svc.shutdown()


def test_decode_graph_one_gpu_one_shard(ray_session):
    _run(_config(num_shards=1, num_gpus_per_shard=0.5, backend="TRITON", num_layers=4))


def test_decode_graph_one_gpu_two_shards_merged_here(ray_session):
    _run(_config(num_shards=2, num_gpus_per_shard=0.25, backend="TRITON", num_layers=4, dcp_interleave=16))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_decode_graph_two_gpus_nccl(ray_session):
    _run(_config(num_shards=2, num_gpus_per_shard=1, backend="TRITON", num_layers=4))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_decode_graph_refused_with_every_reason(ray_session):
    import cpattn
    from cpattn.errors import BackendUnavailableError

    cfg = _config(num_shards=4, num_gpus_per_shard=0.5, backend="TRITON", cuda_graphs="off")
    svc = cpattn.start(cfg)
    try:
        a = svc.add_sequence()
        with pytest.raises(BackendUnavailableError, match="reached over gloo") as caught:
            svc.decode_graph([a], lambda step: None)
        assert any("cuda_graphs is 'off'" in r for r in caught.value.reasons["service"]), caught.value.reasons
        graph = svc.decode_graph([a], lambda step: torch.zeros(1, device="cuda"), allow_eager=True)
        assert graph.mode == "eager"
    finally:
        svc.shutdown()
