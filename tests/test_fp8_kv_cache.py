"""fp8 KV cache on the TORCH backend: formats, dynamic power-of-two scales, error vs float64, capacity.

The service path without Ray: ServiceConfig -> ShardWorker (fp8 caches and scales) -> the coordinator's
planner (plan_step, DCP interleave and PCP pieces) -> ShardLayerRunner (dynamic scales grow on write) ->
the gateway's merge (merge_rows, sinks once). The oracle is float64 attention over the exact K/V, so the
error measured is the fp8 storage error alone (the causal part among a step's new tokens uses the exact
K/V; only context read back from the cache is quantised).
"""

import math

import pytest
import torch

from cpattn import ServiceConfig
from cpattn.attention.backend import write_kv_cache
from cpattn.attention.ops.merge import merge_rows
from cpattn.cluster.recovery import refill_copies
from cpattn.cluster.shard import ShardWorker
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.errors import ConfigError
from cpattn.kvstore.fp8 import (FP8_FORMATS, PageScaleWrites, dequantize, max_relative_error, needed_scales,
                                quantize)
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator
from tests.reference import attention_with_visibility, window_visibility

# Bounds on the relative L2 error of every output row read against an fp8 context (all layers, all steps after
# the first prefill), vs float64 attention on the exact K/V, on data with one 20x outlier channel in K and V and
# 0.2% of entries at 40 sigma. Measured (12 seeds of the service-path test, one full-attention layer with sinks
# and one windowed, soft-capped layer): e4m3 median 2.9e-2, max 3.8e-2; e5m2 median 4.7e-2, max 6.0e-2. Full
# attention without a cap (3 seeds of the static-scale test, dynamic or static scales alike): e4m3 5.4e-2 to
# 8.7e-2. The floor is the format, not the code (the same numbers come from fake-quantising K/V and running
# float64 attention): 3 (e4m3) / 2 (e5m2) mantissa bits on K move each logit by up to 2^-4 / 2^-3 of its size,
# which peaked softmaxes amplify; V's rounding mostly averages out. Single rows are heavy-tailed.
ERROR_BOUND = {"fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}


def _with_outliers(shape, g, scale=1.0):
    """Gaussian values with realistic outliers: one channel 20x larger, and 0.2% of entries +-40 sigma."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    x[..., 3] *= 20.0
    spikes = torch.rand(*shape, generator=g, dtype=torch.float64) < 0.002
    return torch.where(spikes, torch.sign(x) * 40.0 * scale, x)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_quantize_error_per_format_and_scales_are_powers_of_two(fmt):
    g = torch.Generator().manual_seed(1)
    k, v = _with_outliers((500, 2, 16), g), _with_outliers((500, 2, 16), g, scale=0.01)
    scales = needed_scales(torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]), fmt)
    assert bool((torch.log2(scales) == torch.round(torch.log2(scales))).all())       # powers of two
    dtype = FP8_FORMATS[fmt]
    tiny = torch.finfo(dtype).smallest_normal
    for x, s in ((k, scales[0]), (v, scales[1])):
        back = dequantize(quantize(x, s[:, None], dtype), s[:, None], torch.float64)
        assert bool(torch.isfinite(back).all())
        assert float((x.abs() / s[:, None]).max()) <= torch.finfo(dtype).max             # nothing saturates
        normal = x.abs() >= tiny * s[:, None]
        rel = ((back - x).abs() / x.abs())[normal]
        assert float(rel.max()) <= max_relative_error(fmt) + 1e-12, float(rel.max())


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_page_scale_growth_requantises_by_exponent_shift(fmt):
    """A page's scale grown by 2^e re-expresses its cached values exactly, except those below the new subnormal
    range; the other pages (other sequences) keep their bytes and scales."""
    dtype = FP8_FORMATS[fmt]
    g = torch.Generator().manual_seed(2)
    cache = torch.zeros(2, 4, 8, 2, 16, dtype=dtype)
    scales = torch.zeros(2, 4, 2)
    first = _with_outliers((2, 32, 2, 16), g)                    # every page's slots 0 .. 5
    slots = torch.tensor([p * 8 + i for p in range(4) for i in range(6)])
    k, v = first[0, :24].float(), first[1, :24].float()
    PageScaleWrites([slots], 8, "cpu").grow(cache, scales, k, v, fmt)
    write_kv_cache(cache, k, v, slots, scales)
    before = dequantize(cache, scales[:, :, None, :, None], torch.float64)
    bytes_before, scales_before = cache.view(torch.uint8).clone(), scales.clone()
    big = torch.zeros(1, 2, 16)
    big[0, 1, 0] = 16 * float(first[0, 6:12].abs().amax()) + 1e3   # page 1, kv head 1: scale grows >= 16x
    PageScaleWrites([torch.tensor([14])], 8, "cpu").grow(cache, scales, big, big * 0, fmt)
    write_kv_cache(cache, big, big * 0, torch.tensor([14]), scales)
    assert scales[0, 1, 1] >= 16 * scales_before[0, 1, 1]
    changed = torch.zeros_like(scales, dtype=torch.bool)
    changed[0, 1, 1] = True
    assert torch.equal(scales[~changed], scales_before[~changed])
    untouched = torch.ones(2, 4, dtype=torch.bool)
    untouched[0, 1] = False
    assert torch.equal(cache.view(torch.uint8)[untouched], bytes_before[untouched])     # other pages: same bytes
    after = dequantize(cache, scales[:, :, None, :, None], torch.float64)
    min_sub = 2.0 ** {"fp8_e4m3": -9, "fp8_e5m2": -16}[fmt]
    kept = before[0, 1, :6, 1].abs() >= min_sub * float(scales[0, 1, 1]) * 2 ** 3        # at least 4 bits left
    assert torch.equal(after[0, 1, :6, 1][kept], before[0, 1, :6, 1][kept])
    assert torch.equal(after[0, 1, :6, 0], before[0, 1, :6, 0])                         # the page's other head


def test_page_scales_isolate_sequences_restart_on_reuse_and_saturate_inf():
    """One page per sequence: a huge value in sequence B's page moves neither A's bytes nor A's scales; a page
    written again from its first slot (a new owner after a free) starts from scale 0; inf saturates to
    +-fp8_max * scale and NaN stays NaN, moving no scale; the same writes give the same bytes (replicas)."""
    fmt, dtype = "fp8_e4m3", torch.float8_e4m3fn
    g = torch.Generator().manual_seed(5)
    cache, scales = torch.zeros(2, 3, 4, 1, 8, dtype=dtype), torch.zeros(2, 3, 1)
    a_kv = torch.randn(4, 1, 8, generator=g)
    slots_a, slots_b = torch.arange(0, 4), torch.arange(4, 8)          # A owns page 0, B page 1
    for slots, kv in ((slots_a, a_kv), (slots_b, torch.randn(4, 1, 8, generator=g))):
        PageScaleWrites([slots], 4, "cpu").grow(cache, scales, kv, kv, fmt)
        write_kv_cache(cache, kv, kv, slots, scales)
    a_bytes, a_scales = cache[:, 0].view(torch.uint8).clone(), scales[:, 0].clone()
    b_kv = torch.randn(4, 1, 8, generator=g)
    b_kv[2, 0, 3] = 1e6
    both = torch.cat([slots_b, torch.tensor([-1])])                   # a slot of -1 (another shard's token)
    b_kv5 = torch.cat([b_kv, torch.full((1, 1, 8), 3e7)])
    plan = PageScaleWrites([both], 4, "cpu")
    plan.grow(cache, scales, b_kv5, b_kv5, fmt)
    write_kv_cache(cache, b_kv5, b_kv5, both, scales)
    assert float(scales[0, 1, 0]) == 2.0 ** math.ceil(math.log2(1e6 / 448))
    assert torch.equal(cache[:, 0].view(torch.uint8), a_bytes) and torch.equal(scales[:, 0], a_scales)
    # B freed, its page 1 reused by C from slot 4 on: C's scale is its own, not B's 1e6.
    c_kv = torch.randn(2, 1, 8, generator=g)
    PageScaleWrites([torch.tensor([4, 5])], 4, "cpu").grow(cache, scales, c_kv, c_kv, fmt)
    assert float(scales[0, 1, 0]) == float(needed_scales(c_kv.abs().amax(), fmt))
    # inf / NaN: saturate / stay NaN, scale from the finite values only.
    odd = torch.randn(2, 1, 8, generator=g)
    odd[0, 0, 0], odd[1, 0, 1] = float("inf"), float("nan")
    replica_cache, replica_scales = cache.clone(), scales.clone()
    for c, s in ((cache, scales), (replica_cache, replica_scales)):
        PageScaleWrites([torch.tensor([8, 9])], 4, "cpu").grow(c, s, odd, odd, fmt)
        write_kv_cache(c, odd, odd, torch.tensor([8, 9]), s)
    finite = odd.nan_to_num(nan=0.0, posinf=0.0).abs().amax()
    assert float(scales[0, 2, 0]) == float(needed_scales(finite, fmt))
    back = dequantize(cache[0, 2, :2], scales[0, 2][:, None], torch.float64)
    assert float(back[0, 0, 0]) == 448.0 * float(scales[0, 2, 0]) and bool(back[1, 0, 1].isnan())
    assert torch.equal(cache.view(torch.uint8), replica_cache.view(torch.uint8)) and torch.equal(scales, replica_scales)


def _config(fmt, **kw):
    base = dict(num_shards=3, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                dtype="float32", kv_cache_dtype=fmt, num_blocks_per_shard=48, pcp_min_tokens=16,
                sliding_window=[None, 13], logits_soft_cap=[None, 5.0])
    base.update(kw)
    return ServiceConfig(**base)


class InProcessService:
    """The service's data path with no Ray: planner, shard workers, runner, merge."""

    def __init__(self, cfg):
        threads = torch.get_num_threads()
        self.cfg = cfg
        self.workers = [ShardWorker(cfg, r) for r in range(cfg.num_shards)]
        torch.set_num_threads(threads)       # ShardWorker pins its process to num_cpus_per_shard threads
        self.alloc = ShardedKVAllocator(cfg.num_shards, cfg.blocks_per_shard(), cfg.block_size,
                                        cfg.dcp_interleave, max_rows=4, replicas=cfg.kv_replicas)
        self.rows, self.lens, self.step_id = [], [], 0

    def add(self):
        self.rows.append(self.alloc.add_rows())
        self.lens.append(0)
        return len(self.rows) - 1

    def step(self, request: dict[int, int], layers_qkv, sinks):
        reqs = [StepRequest(self.rows[s], self.lens[s], n) for s, n in request.items()]
        self.alloc.grow([(self.rows[s], self.lens[s] + n) for s, n in request.items()])
        self.step_id += 1
        plans = plan_step(self.alloc, reqs, self.step_id, self.cfg.pcp_enabled, self.cfg.pcp_min_tokens,
                          row_window=self.cfg.row_window())
        self.last_plans = plans
        planned = [w.runner.plan(p) for w, p in zip(self.workers, plans)]
        outs = []
        for layer, (q, k, v) in enumerate(layers_qkv):
            parts = [(pl.rows, *w.runner.run_layer(pl, layer, q, k, v)) for w, pl in zip(self.workers, planned)]
            parts = [p for p, pl in zip(parts, plans) if pl.num_rows]
            outs.append(merge_rows(parts, q.shape[0], sinks[layer]))
        for s, n in request.items():
            self.lens[s] += n
        return outs


def _oracle(cfg, history, request, layers_qkv, sinks):
    """float64: every layer's output for the step, from the exact K/V history (updated in place)."""
    outs = []
    for layer, (q, k, v) in enumerate(layers_qkv):
        window, cap = cfg.layer_windows()[layer], cfg.layer_soft_caps()[layer]
        rows, start = [], 0
        for s, n in request.items():
            kk, vv = history.get((s, layer), (torch.zeros(0, cfg.num_kv_heads, cfg.head_size, dtype=torch.float64),) * 2)
            kk, vv = torch.cat([kk, k[start:start + n].double()]), torch.cat([vv, v[start:start + n].double()])
            history[(s, layer)] = (kk, vv)
            L = kk.shape[0]
            vis = window_visibility(torch.arange(L - n, L), torch.arange(L), window)
            o, _ = attention_with_visibility(q[start:start + n].double(), kk, vv, vis, soft_cap=cap,
                                             sinks_Q=None if sinks[layer] is None else sinks[layer].double())
            rows.append(o)
            start += n
        outs.append(torch.cat(rows))
    return outs


def _random_layers(cfg, t, g, outlier_scale=1.0):
    layers = []
    for _ in range(cfg.num_layers):
        q = torch.randn(t, cfg.num_q_heads, cfg.head_size, generator=g, dtype=torch.float64)
        k = _with_outliers((t, cfg.num_kv_heads, cfg.head_size), g, outlier_scale) * 0.3
        v = _with_outliers((t, cfg.num_kv_heads, cfg.head_size), g, outlier_scale)
        layers.append(tuple(x.float() for x in (q, k, v)))
    return layers


class RelError:
    """Relative L2 error accumulated over outputs: sqrt(sum |out - ref|^2 / sum |ref|^2)."""

    def __init__(self):
        self.num = self.den = 0.0

    def add(self, outs, refs):
        for o, r in zip(outs, refs):
            self.num += float((o.double() - r).pow(2).sum())
            self.den += float(r.pow(2).sum())

    @property
    def value(self) -> float:
        return math.sqrt(self.num / self.den)


@pytest.mark.parametrize("fmt, interleave", [("fp8_e4m3", 1), ("fp8_e5m2", 8), ("fp8", 8)])
def test_fp8_service_path_error_bound_and_replica_refill(fmt, interleave):
    """DCP (3 shards, interleave 1 and the block size), PCP (a 40-token prefill split across shards), a
    windowed + soft-capped layer, sinks on layer 0, a step whose outliers grow the scales mid-sequence, and
    kv_replicas=2: a replaced shard refilled from the copies gives the same outputs as before."""
    cfg = _config(fmt, dcp_interleave=interleave, kv_replicas=2)
    fmt_name = cfg.kv_cache_format
    g = torch.Generator().manual_seed(3 + interleave)
    svc, history = InProcessService(cfg), {}
    a, b, c, d = svc.add(), svc.add(), svc.add(), svc.add()
    sinks = [torch.randn(cfg.num_q_heads, generator=g), None]
    err = RelError()
    schedule = [({a: 40, b: 3, c: 20, d: 7}, 1.0), ({a: 1, b: 1, c: 1, d: 1}, 1.0), ({a: 5, b: 1, c: 1, d: 2}, 8.0),
                ({a: 1, b: 9, c: 1, d: 1}, 1.0), ({a: 1, b: 1, c: 1, d: 1}, 1.0)]
    for i, (request, outlier) in enumerate(schedule):
        layers = _random_layers(cfg, sum(request.values()), g, outlier)
        scales_before = [s.clone() for s in svc.workers[0].kv_scales]
        outs = svc.step(request, layers, sinks)
        refs = _oracle(cfg, history, request, layers, sinks)
        if i == 0:                         # from an empty cache: the exact causal part only
            for o, r in zip(outs, refs):
                torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)
        else:
            err.add(outs, refs)
        if outlier > 1:
            assert any(bool((s > s0).any()) for s, s0 in zip(svc.workers[0].kv_scales, scales_before))
    print(f"{fmt_name} interleave {interleave}: relative L2 error {err.value:.4f}")
    assert 0 < err.value <= ERROR_BOUND[fmt_name], f"{fmt_name}: relative error {err.value}"
    # Replica pages hold exactly their owner's values and scales (a page's scale depends on its tokens only).
    for rank in range(cfg.num_shards):
        holder = svc.alloc.replica_holder(rank)
        for seq in svc.rows:
            mine = svc.alloc.tables[rank].row(seq.primary[rank])
            copy = svc.alloc.tables[holder].row(seq.replica[holder])
            assert torch.equal(svc.workers[rank].read_blocks(mine), svc.workers[holder].read_blocks(copy))
            assert torch.equal(svc.workers[rank].read_block_scales(mine), svc.workers[holder].read_block_scales(copy))
    # Replace shard 1 by a fresh one refilled from the copies: same values and scales, hence the same next step.
    lost = 1
    fresh = ShardWorker(cfg, lost)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for c in refill_copies(svc.alloc, svc.rows, lost):
        src = svc.workers[c.src]
        fresh.write_blocks(c.dst_blocks, src.read_blocks(c.src_blocks), scales=src.read_block_scales(c.src_blocks))
    for seq in svc.rows:
        for row in (seq.primary[lost], seq.replica[lost]):
            pages = svc.alloc.tables[lost].row(row)
            assert torch.equal(fresh.read_blocks(pages), svc.workers[lost].read_blocks(pages))
            assert torch.equal(fresh.read_block_scales(pages), svc.workers[lost].read_block_scales(pages))
    layers = _random_layers(cfg, 2, g)
    before = svc.step({a: 1, b: 1}, layers, sinks)
    for s in (a, b):
        svc.lens[s] -= 1                       # run the same step again on the replaced shard set
    svc.workers[lost] = fresh
    after = svc.step({a: 1, b: 1}, layers, sinks)
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_capacity_doubles_and_stats_fields():
    bf16 = dict(num_shards=2, num_layers=4, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                kv_cache_bytes_per_shard=64 * 2**20)
    auto = ServiceConfig(dtype="bfloat16", **bf16)
    for fmt in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        fp8 = ServiceConfig(dtype="bfloat16", kv_cache_dtype=fmt, **bf16)
        assert fp8.blocks_per_shard() == 2 * auto.blocks_per_shard()
        assert fp8.bytes_per_block() * 2 == auto.bytes_per_block()
    f32 = ServiceConfig(dtype="float32", **bf16)
    assert ServiceConfig(dtype="float32", kv_cache_dtype="fp8_e4m3", **bf16).blocks_per_shard() == \
        4 * f32.blocks_per_shard()
    assert ServiceConfig(kv_cache_dtype="fp8", **bf16).kv_cache_format == "fp8_e4m3"
    cfg = ServiceConfig(dtype="bfloat16", kv_cache_dtype="fp8_e5m2", num_blocks_per_shard=4, **{
        k: v for k, v in bf16.items() if k != "kv_cache_bytes_per_shard"})
    threads = torch.get_num_threads()
    w = ShardWorker(cfg, 0)
    torch.set_num_threads(threads)
    info = w.info()
    assert info.kv_cache_dtype == "float8_e5m2"
    assert info.kv_bytes == cfg.bytes_per_block() * 4               # one byte per element


def test_config_rejects_bad_fp8_and_window_settings():
    geo = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=16)
    with pytest.raises(ConfigError, match="kv_scales are fp8 scales"):
        ServiceConfig(kv_scales=[[[1.0, 1.0]] * 2] * 2, **geo)
    with pytest.raises(ConfigError, match=r"kv_scales must be \[num_layers=2\]\[2\]\[num_kv_heads=2\]"):
        ServiceConfig(kv_cache_dtype="fp8", kv_scales=[[[1.0]] * 2] * 2, **geo)
    with pytest.raises(ConfigError, match="finite and > 0"):
        ServiceConfig(kv_cache_dtype="fp8", kv_scales=[[[1.0, 0.0]] * 2] * 2, **geo)
    with pytest.raises(ConfigError, match="sliding_window has 3 entries for 2 layers"):
        ServiceConfig(sliding_window=[4, None, 8], **geo)
    with pytest.raises(ConfigError, match=r"sliding_window 0 of layer 1 must be in 1\.\."):
        ServiceConfig(sliding_window=[4, 0], **geo)
    with pytest.raises(ConfigError, match="logits_soft_cap -1.0 of layer 0"):
        ServiceConfig(logits_soft_cap=-1.0, **geo)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ServiceConfig(kv_cache_dtype="int8", **geo)
    cfg = ServiceConfig(kv_cache_dtype="fp8_e4m3", kv_scales=[[[0.5, 0.25], [1.0, 2.0]]] * 2,
                        sliding_window=4096, logits_soft_cap=[30.0, None], **geo)
    assert cfg.layer_windows() == [4096, 4096] and cfg.layer_soft_caps() == [30.0, None]


def test_static_scales_are_used_as_given():
    static = [[0.125, 0.1], [0.25, 0.2]]                               # K covers |k| <= 45, V |v| <= 89
    cfg = _config("fp8_e4m3", kv_scales=[static] * 2, sliding_window=None,
                  logits_soft_cap=None)
    g = torch.Generator().manual_seed(4)
    svc, history = InProcessService(cfg), {}
    seqs = [svc.add() for _ in range(4)]
    err = RelError()
    for n in (20, 1, 3, 1):
        request = {s: n for s in seqs}
        layers = _random_layers(cfg, sum(request.values()), g)
        outs = svc.step(request, layers, [None, None])
        refs = _oracle(cfg, history, request, layers, [None, None])
        if n != 20:
            err.add(outs, refs)
    assert 0 < err.value <= ERROR_BOUND["fp8_e4m3"], err.value
    for w in svc.workers:
        assert torch.equal(w.kv_scales[0], torch.tensor(static)[:, None, :].expand_as(w.kv_scales[0]))   # never changed


@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
def test_gpu_backends_declare_what_they_serve_and_say_why_not(backend, monkeypatch):
    """Every GPU backend serves fp8, windows and soft caps: FLASHINFER's and FLASH_ATTN's fp8 pages dequantised for
    their kernels, FLASH_ATTN's windowed layers on TRITON's kernels (whose absence is then a reason)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    from cpattn.attention.backend import AttentionSelectorConfig
    from cpattn.attention.registry import load_backend_class

    cls = load_backend_class(backend)
    everything = AttentionSelectorConfig(head_size=128, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", block_size=16,
                                         num_q_heads=8, num_kv_heads=2, device_type="cuda", device_capability=(9, 0),
                                         sliding_window=True, logits_soft_cap=True)
    reasons = " | ".join(cls.validate(everything))
    assert "logits_soft_cap" not in reasons
    assert "fp8" not in reasons and "sliding_window is not served" not in reasons
    if backend == "TRITON":
        older = AttentionSelectorConfig(**{**everything.__dict__, "device_capability": (8, 0)})
        assert "fp8_e4m3 KV needs compute capability 8.9 or newer in Triton" in " | ".join(cls.validate(older))
    if backend == "FLASH_ATTN":   # its windowed layers need TRITON's kernels, missing on this CPU box
        without_triton = " | ".join(cls.availability(everything))
        assert "sliding_window layers run on TRITON's kernels, which cannot run here: triton" in without_triton
    default = AttentionSelectorConfig(head_size=128, dtype="bfloat16", kv_cache_dtype="auto", block_size=16,
                                      num_q_heads=8, num_kv_heads=2, device_type="cuda", device_capability=(9, 0))
    assert not [r for r in cls.validate(default) if "served" in r or "KV needs" in r]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_pages_are_the_stored_values_times_their_scales_exactly(fmt, dtype):
    """kvstore.fp8.dequantize_pages (FLASH_ATTN's fp8 path) on a kernel view of 2 kernel pages per scale page,
    and the FLASH_ATTN impl's renumbered page table: every entry reads the float64 dequantised page it named."""
    from cpattn.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata
    from cpattn.kvstore.fp8 import dequantize_pages, fp8_dtype, page_scales_of, quantize

    seed = int(torch.randint(1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    scale_pages, kernel_per_scale, page, hk, d = 12, 2, 8, 2, 16
    values = _with_outliers((2, scale_pages, kernel_per_scale * page, hk, d), g, scale=3.0).to(torch.float64)
    scales = page_scales_of(values, fmt).float()
    scales[:, 3] = 0.0                                               # a page nobody wrote: zeros
    cache = quantize(values, scales[:, :, None, :, None], fp8_dtype(fmt))
    view = cache.view(2, scale_pages * kernel_per_scale, page, hk, d)   # the kernel's pages
    table = torch.randint(0, scale_pages * kernel_per_scale, (3, 5), generator=g)
    md = FlashAttentionMetadata(0, torch.zeros(0), False, *(torch.zeros(1),) * 3, table.to(torch.int32), 1, 1, True,
                                None, page_table_cpu=table)
    scratch, renumbered = FlashAttentionImpl._dequantized(view, scales, md, dtype)
    assert scratch.dtype == dtype and scratch.shape[1] == torch.unique(table).numel()
    assert renumbered.dtype == torch.int32 and md.fp8_pages[1] is renumbered   # kept for the step's other layers
    exact = dequantize(view, torch.repeat_interleave(scales.double(), kernel_per_scale, dim=1)[:, :, None, :, None],
                       torch.float64)
    for b in range(3):
        for j in range(5):
            assert torch.equal(scratch[:, renumbered[b, j]].double(), exact[:, table[b, j]]), (seed, b, j)
    some = torch.tensor([5, 0, 7])
    assert torch.equal(dequantize_pages(view, scales, some, dtype).double(), exact[:, some]), seed


def test_device_metadata_keeps_the_host_block_table_it_was_copied_from():
    """FLASH_ATTN and FLASHINFER plan an fp8 step's distinct pages from the host table: the service hands the builder
    device metadata (ShardLayerRunner._to_device), which must still carry that table, or the first layer syncs."""
    from cpattn.attention.metadata import make_causal_metadata

    table = torch.tensor([[3, 1, -1], [0, 2, 4]])
    md = make_causal_metadata([3, 1], [5, 40], table, 16)
    on_device = md.to("meta")
    assert on_device.block_table_tensor.device.type == "meta"
    assert on_device.block_table_cpu is md.block_table_tensor and on_device.to("meta").block_table_cpu is md.block_table_tensor
    assert torch.equal(on_device.block_table_cpu, table)
    # FLASHINFER reads it through table_on_host(): the kept host table, the table itself on the CPU
    assert on_device.table_on_host() is md.block_table_tensor and md.table_on_host() is md.block_table_tensor
