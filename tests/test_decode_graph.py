"""svc.decode_graph: a model's decode forward with its attend calls, captured once and replayed per token.

On CPU nothing is captured: every step runs the forward eagerly with the same contract (the same output tensors
every step, commit and rollback as any step), checked here against a float64 model built from the oracle's
attention. Which step records, replays or runs eagerly is checked with fakes (no Ray, no CUDA); why a service's
steps cannot be captured, from the backends' declared CUDA-graph support levels. The CUDA path:
tests/gpu/test_decode_graph_gpu.py. examples/long_context_job.py's decode loop (CpattnLM(decode_graph=True), its
default on CUDA) is checked here on the CPU against transformers' eager attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from service_oracle import causal_attention

M = 12   # the toy model's width


class ToyModel:
    """N layers of q/k/v projections, attention and a small matmul back (float64 weights, seeded); the same
    forward runs on cpattn (``attend`` = step.attend) and on the float64 reference (``Reference.attend``)."""

    def __init__(self, cfg, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        hq, hk, d, n = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.num_layers
        self.cfg = cfg
        self.wq = [torch.randn(M, hq * d, generator=g, dtype=torch.float64) / M ** 0.5 for _ in range(n)]
        self.wk = [torch.randn(M, hk * d, generator=g, dtype=torch.float64) / M ** 0.5 for _ in range(n)]
        self.wv = [torch.randn(M, hk * d, generator=g, dtype=torch.float64) / M ** 0.5 for _ in range(n)]
        self.wo = [torch.randn(hq * d, M, generator=g, dtype=torch.float64) / (hq * d) ** 0.5 for _ in range(n)]

    def forward(self, x_TM: torch.Tensor, attend) -> torch.Tensor:
        cfg, t = self.cfg, x_TM.shape[0]
        for layer in range(cfg.num_layers):
            q = (x_TM @ self.wq[layer]).view(t, cfg.num_q_heads, cfg.head_size)
            k = (x_TM @ self.wk[layer]).view(t, cfg.num_kv_heads, cfg.head_size)
            v = (x_TM @ self.wv[layer]).view(t, cfg.num_kv_heads, cfg.head_size)
            out = attend(layer, q, k, v)
            x_TM = x_TM + torch.tanh(out.reshape(t, -1) @ self.wo[layer])
        return x_TM


class Reference:
    """Float64 attention over each sequence's committed K/V (one new token per sequence per step)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: dict = {}

    def attend(self, layer, q, k, v, counts: list[int]):
        outs, start = [], 0
        for b, n in enumerate(counts):
            empty = torch.zeros(0, self.cfg.num_kv_heads, self.cfg.head_size, dtype=torch.float64)
            k0, v0 = self.kv.get((b, layer), (empty, empty))
            kk, vv = torch.cat([k0, k[start:start + n]]), torch.cat([v0, v[start:start + n]])
            outs.append(causal_attention(q[start:start + n], kk, vv))
            self.pending[(b, layer)] = (kk, vv)
            start += n
        return torch.cat(outs)

    def step(self, model: ToyModel, x_TM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        self.pending = {}
        out = model.forward(x_TM, lambda layer, q, k, v: self.attend(layer, q, k, v, counts))
        self.kv.update(self.pending)
        return out


@pytest.fixture(scope="module")
def svc(ray_session):
    import cpattn

    from conftest import service_config

    # The tiny Llama's geometry (examples/job_models.py), so the job's decode loop runs on it too.
    svc = cpattn.start(service_config(num_shards=2, num_layers=3, head_size=16, decode_run_steps=4))
    yield svc
    svc.shutdown()


def test_eager_decode_graph_exact_and_same_tensors(svc):
    cfg = svc.config
    model, ref = ToyModel(cfg, seed=1), Reference(cfg)
    a, b = svc.add_sequence(), svc.add_sequence()
    prompt = torch.randn(8, M, dtype=torch.float64)   # a: 5 tokens, b: 3, through the ordinary step API
    with svc.step({a: 5, b: 3}) as step:
        got = model.forward(prompt, step.attend)
    assert torch.allclose(got, ref.step(model, prompt, [5, 3]), atol=1e-10)
    x = torch.zeros(2, M, dtype=torch.float64)   # the graph's static input, refilled per token
    graph = svc.decode_graph([a, b], lambda step: model.forward(x, step.attend))
    assert graph.mode == "eager" and "service" in graph.reasons and "TORCH" in graph.reasons
    first = None
    for i in range(6):
        x.copy_(torch.randn(2, M, dtype=torch.float64))
        out = graph.step()
        first = out if first is None else first
        assert out is first   # one output tensor, refilled every step
        assert torch.allclose(out, ref.step(model, x, [1, 1]), atol=1e-10), f"step {i}"
        assert lengths(svc, a, b) == [6 + i, 4 + i]
    assert graph.counts == {"eager": 6, "captured": 0, "replayed": 0} and graph.last == "eager"
    graph.close()
    with pytest.raises(cpattn_errors().InvalidRequestError, match="was closed"):
        graph.step()


def lengths(svc, *seq_ids):
    held = svc.sequences()
    return [held[s] for s in seq_ids]


def cpattn_errors():
    import cpattn.errors

    return cpattn.errors


def test_failed_steps_roll_back_and_the_graph_goes_on(svc):
    errors = cpattn_errors()
    cfg = svc.config
    model, ref = ToyModel(cfg, seed=2), Reference(cfg)
    a, b = svc.add_sequence(), svc.add_sequence()
    x = torch.zeros(2, M, dtype=torch.float64)
    graph = svc.decode_graph([a, b], lambda step: model.forward(x, step.attend))
    x.copy_(torch.randn(2, M, dtype=torch.float64))
    out = graph.step().clone()
    assert torch.allclose(out, ref.step(model, x, [1, 1]), atol=1e-10)
    x[1, 0] = float("nan")   # NaN reaches q|k|v: the step is refused and nothing of it is kept
    with pytest.raises(errors.InvalidRequestError, match="NaN or inf"):
        graph.step()
    assert lengths(svc, a, b) == [1, 1]
    partial = svc.decode_graph([a, b], lambda step: step.attend(0, *[t[:2] for t in _qkv(cfg)]))
    with pytest.raises(errors.IncompleteStepError, match=r"layers \[1, 2\] never attended"):
        partial.step()
    wrong = svc.decode_graph([a, b], lambda step: (model.forward(x.nan_to_num(), step.attend), "not a tensor"))
    with pytest.raises(errors.InvalidRequestError, match="a tensor or a tuple of tensors"):
        wrong.step()
    assert lengths(svc, a, b) == [1, 1]
    for _ in range(3):   # the graph goes on where it was
        x.copy_(torch.randn(2, M, dtype=torch.float64))
        assert torch.allclose(graph.step(), ref.step(model, x, [1, 1]), atol=1e-10)
    assert lengths(svc, a, b) == [4, 4]


def _qkv(cfg):
    return (torch.randn(4, cfg.num_q_heads, cfg.head_size, dtype=torch.float64),
            torch.randn(4, cfg.num_kv_heads, cfg.head_size, dtype=torch.float64),
            torch.randn(4, cfg.num_kv_heads, cfg.head_size, dtype=torch.float64))


def test_rejected_requests_change_nothing(svc):
    errors = cpattn_errors()
    a = svc.add_sequence()
    before = lengths(svc, a)
    for seq_ids, match in (([], "non-empty list"), (a, "non-empty list"), ([a, a], "distinct"),
                           ([a, 3], "distinct")):
        with pytest.raises(errors.InvalidRequestError, match=match):
            svc.decode_graph(seq_ids, lambda step: None)
    with pytest.raises(errors.InvalidRequestError, match="forward must be callable"):
        svc.decode_graph([a], "forward")
    graph = svc.decode_graph([a, "no-such-sequence"], lambda step: torch.zeros(1))
    with pytest.raises(errors.InvalidRequestError, match="no-such-sequence"):
        graph.step()
    assert lengths(svc, a) == before


# Which step records, replays or runs eagerly: fakes for the service, its steps and the CUDA graph ------------
class FakeRun:
    def __init__(self, log):
        self.wire = SimpleNamespace(bucket=log.bucket)
        self.log = log

    def graph_replayed(self):
        self.log.events.append("replayed_all_layers")


class FakeStep:
    def __init__(self, log):
        self._run = FakeRun(log)
        self.log = log
        self.seq_ids, self.num_tokens = ["a"], 1

    def attend(self, layer, q, k, v):
        return q.clone()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.log.events.append("rolled_back" if exc_type else "committed")


class FakeLayers:
    """CapturedLayers without CUDA: a recording is valid while the step's bucket is the one it was made in."""

    def __init__(self, gw, wire):
        self.gw, self.bucket = gw, wire.bucket

    def matches(self, wire):
        return wire.bucket == self.bucket

    def record(self, layer, q, k, v):
        return q.clone()


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.events.append("graph_replay")


def _fake_service(monkeypatch, log):
    from cpattn import decode_graph

    cfg = SimpleNamespace(num_layers=2, num_q_heads=1, num_kv_heads=1, head_size=2, torch_dtype=torch.float64)
    gw = SimpleNamespace(device=torch.device("cpu"), plane=None, config=cfg, user_graphs=set(), local_graphs={})

    def capture_graphs(device, count, record):
        if log.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        log.events.append("capture")
        return [FakeGraph(log)], [record(0)]

    monkeypatch.setattr(decode_graph, "capture_refusals", lambda *a: {})
    monkeypatch.setattr(decode_graph, "capturable", lambda gw, wire: log.capturable)
    monkeypatch.setattr(decode_graph, "CapturedLayers", FakeLayers)
    monkeypatch.setattr(decode_graph, "capture_graphs", capture_graphs)
    monkeypatch.setattr(decode_graph, "check_qkv", lambda *a, **k: None)
    svc = SimpleNamespace(config=cfg, gateway=gw, shard_infos=[{"backend": "TRITON"}], step=lambda r: FakeStep(log))
    return decode_graph.DecodeGraph(svc, ["a"], lambda step: _toy_forward(step, log))


def _toy_forward(step, log):
    log.events.append("forward")
    x = torch.ones(1, 1, 2, dtype=torch.float64)
    for layer in range(log.layers_attended):
        x = step.attend(layer, x, x, x) * 2
    return x


def test_warm_up_capture_replay_and_recapture(monkeypatch):
    log = SimpleNamespace(events=[], bucket=1, capturable=True, fail_capture=False, layers_attended=2)
    graph = _fake_service(monkeypatch, log)
    assert graph.mode == "cuda_graph"
    hows = []
    for bucket, capturable in ((1, True), (1, True), (1, True), (1, False), (1, True), (2, True), (2, True)):
        log.bucket, log.capturable = bucket, capturable
        out = graph.step()
        hows.append(graph.last)
        assert out is graph.outputs[0] and torch.equal(out, torch.full((1, 1, 2), 4.0, dtype=torch.float64))
    # eager warm-up; capture (then one replay, in that step); replays; a step that does not fit runs eagerly and
    # leaves the recording; a new bucket records again
    assert hows == ["eager", "captured", "replayed", "eager", "replayed", "captured", "replayed"]
    assert graph.counts == {"eager": 2, "captured": 2, "replayed": 3}
    assert log.events[:8] == ["forward", "committed", "capture", "forward", "graph_replay", "replayed_all_layers",
                              "committed", "graph_replay"]


def test_capture_failure_rolls_back_and_runs_eagerly(monkeypatch):
    errors = cpattn_errors()
    log = SimpleNamespace(events=[], bucket=1, capturable=True, fail_capture=False, layers_attended=2)
    graph = _fake_service(monkeypatch, log)
    graph.step()
    log.fail_capture = True
    graph.step()   # the capture fails: that step rolls back, the same step runs eagerly, and later ones too
    assert log.events[2:] == ["rolled_back", "forward", "committed"] and graph.last == "eager" and graph.disabled
    graph.step()
    assert graph.counts == {"eager": 3, "captured": 0, "replayed": 0}
    log2 = SimpleNamespace(events=[], bucket=1, capturable=True, fail_capture=False, layers_attended=1)
    partial = _fake_service(monkeypatch, log2)
    partial.step()   # eager: the fake step accepts what it is given
    with pytest.raises(errors.IncompleteStepError, match=r"attended 1 of 2 layers \(never \[1\]\)"):
        partial.step()
    assert log2.events[-1] == "rolled_back" and partial.graph is None


def test_refusals_name_every_reason():
    import cpattn
    from cpattn.cluster.user_graphs import capture_refusals

    cfg = cpattn.ServiceConfig(num_shards=2, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=16, dtype="bfloat16", cuda_graphs="off")
    cuda = torch.device("cuda")
    why = capture_refusals(cfg, cuda, ["TORCH", "FLASH_ATTN", "TRITON"], "gloo")
    assert set(why) == {"service", "TORCH", "FLASH_ATTN"}
    assert any("cuda_graphs is 'off'" in r for r in why["service"])
    assert any("reached over gloo" in r for r in why["service"])
    assert "declares CUDA-graph support NEVER" in why["TORCH"][0]
    assert "declares UNIFORM_BATCH but its builder lacks graph_key" in why["FLASH_ATTN"][0]
    ok = cfg.model_copy(update={"cuda_graphs": "auto"})
    assert capture_refusals(ok, cuda, ["TRITON", "TRITON"], "nccl", {0: object()}) == {}
    assert capture_refusals(ok, cuda, ["TRITON"], None) == {}
    off = capture_refusals(ok, cuda, ["TRITON", "TRITON"], None, {0: object(), 1: None})
    assert off == {"service": ["the shards computed in this process ([1]) have no decode graphs for this "
                               "configuration: cluster/decode_graphs.DecodeGraphs.supported"]}
    assert "CUDA graphs need a CUDA device" in capture_refusals(ok, torch.device("cpu"), ["TRITON"], None)["service"][0]


def test_benchmark_measure_runs_both_ways(svc):
    """benchmarks/decode_graph_bench.py's measurement on this service (CPU: the graph runs eagerly)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode_graph_bench

    row = decode_graph_bench.measure(svc, batch=2, context=20, layers=svc.config.num_layers, repeats=1, matmul=True)
    assert row["mode"] == "eager" and row["graph_steps"] == {"eager": 3, "captured": 0, "replayed": 0}, row
    assert row["eager_ms_per_layer"] > 0 and row["graph_ms_per_layer"] > 0


def test_job_decode_loop_generates_the_eager_tokens(svc):
    pytest.importorskip("transformers")
    from test_long_context_job import _load_job_module

    job = _load_job_module()
    model = job.build_model(None, seed=4, num_layers=svc.config.num_layers, dtype="float64")
    prompt = job.make_prompt(model.config.vocab_size, 70, 2, seed=4)
    lm = job.CpattnLM(model, svc, 2, decode_graph=True)
    tokens, _ = job.generate(lm, prompt, chunk_size=32, max_new_tokens=6, progress=False)
    assert lm.graph is not None and lm.graph.mode == "eager" and lm.graph.counts["eager"] == 5
    lm.free()
    assert tokens.tolist() == job.eager_generate(model, prompt, 6).tolist()


def test_a_recording_fits_only_the_buffers_it_read():
    """CapturedLayers.matches: the same buffer objects (keys by value) or the graph must be captured again."""
    from cpattn.cluster.user_graphs import CapturedLayers

    def client(key=(2, (), (1,))):
        t = torch.zeros
        return SimpleNamespace(key=key, message=t(8), headers=t(3, 4), tags=t(3), norms=t(3), flags=t(3, 1),
                               recv={1: t(6)})

    def local(key=(2, 1, 64, False)):
        return SimpleNamespace(key=key, static=SimpleNamespace(), qkv=torch.zeros(2, 3, 4), replica=None)

    c, g = client(), local()
    wire = SimpleNamespace(graphs=c, local={0: SimpleNamespace(graphs=g)})
    gw = SimpleNamespace(config=SimpleNamespace(nan_policy="reject", num_layers=3), device=torch.device("cpu"))
    rec = CapturedLayers(gw, wire)
    assert rec.matches(SimpleNamespace(graphs=c, local={0: SimpleNamespace(graphs=g)}))
    c.key = (2, (), (1,))   # an equal key, another tuple: still the same bucket
    assert rec.matches(wire)
    c.recv = {1: torch.zeros(6)}   # a recapture replaced a buffer: not the recorded one
    assert not rec.matches(wire)
    c2, g2 = client(), local()
    assert not rec.matches(SimpleNamespace(graphs=c, local={0: SimpleNamespace(graphs=g2)}))
    assert not rec.matches(SimpleNamespace(graphs=c2, local={0: SimpleNamespace(graphs=g)}))
    assert not rec.matches(SimpleNamespace(graphs=c, local={}))


def test_recorded_layer_work_on_fakes():
    """CapturedLayers.record runs the client's layer (ClientLayerGraphs._layer) on the CPU, every shard in this
    process as fakes of their graphs: q|k|v into the client's then each shard's buffers, the NaN norm of the layer,
    the shards' partials merged by LSE into one softmax over both."""
    from cpattn.cluster.client_graphs import ClientLayerGraphs
    from cpattn.cluster.user_graphs import CapturedLayers

    t, hq, hk, d, num_layers = 2, 4, 2, 8, 2
    keys = torch.randn(2, 5, hk, d)   # shard s holds keys[s] (its values are its keys, for brevity)

    def attention(q, kk):   # out and natural-log lse of q over keys kk [L, Hk, D], no mask
        kk = kk.repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("tqd,lqd->tql", q, kk) / d ** 0.5
        return torch.einsum("tql,lqd->tqd", scores.softmax(-1), kk), scores.logsumexp(-1)

    class FakeShardGraphs:
        def __init__(self, s):
            self.s, self.key, self.static, self.replica = s, (t, 1, 64, False), object(), None
            self.qkv = torch.zeros(t, hq + 2 * hk, d)
            self.q, self.k, self.v = self.qkv.split([hq, hk, hk], dim=1)

        def _layer(self, layer):
            return attention(self.q, keys[self.s])

    graphs = [FakeShardGraphs(0), FakeShardGraphs(1)]
    cfg = SimpleNamespace(nan_policy="reject", num_layers=num_layers, num_q_heads=hq, num_kv_heads=hk, head_size=d,
                          torch_dtype=torch.float32, cuda_graphs="auto")
    gw = SimpleNamespace(config=cfg, device=torch.device("cpu"), plane=None, remote=[], local={0: None, 1: None})
    assert not ClientLayerGraphs.supported(gw)   # a CPU client: nothing to capture
    wire = SimpleNamespace(num_tokens=t, remote_rows={},
                           local={s: SimpleNamespace(graphs=g) for s, g in enumerate(graphs)})
    client = ClientLayerGraphs(gw)
    client.make_buffers(wire)
    wire.graphs = client
    rec = CapturedLayers(gw, wire)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    out = rec.record(1, q, k, v)
    assert torch.allclose(out, attention(q, torch.cat(list(keys)))[0], atol=1e-5)   # one softmax over both shards
    assert all(torch.equal(g.q, q) and torch.equal(g.k, k) and torch.equal(g.v, v) for g in graphs)
    assert client.norms[1] == torch.cat([q, k, v], dim=1).abs().max() and client.norms[0] == 0
    assert not client.headers[:, 2].any() and not client.message[:8].any()   # no remote shard: no header written
