"""Context-parallel scaling on GPUs: one kernel call on 1 GPU vs the service on 1 and on N GPUs.

Every row is measured the way a user runs it: ``cpattn.start``, ``svc.step``, ``step.attend`` with q/k/v
already on the client's GPU (cuda:0, where the model would run), whole steps of ``--layers`` layers
(fewer where the KV of that many layers does not fit; the row says how many), wall time from
``svc.step(...)`` to the end of the ``with`` block, after the GPU finished. Per step, the row has the planning
(``plan_ms_per_step``: the coordinator's begin_step and the shards' plans) and the caller's wall time to open the
step (``begin_ms_per_step``: what the client's path pays before its first attend), so ms/layer at another depth
can be derived. The kernel columns are one backend call on one GPU over the same shape (CUDA events, median):
eager (launches included) and replayed from a CUDA graph (the kernels alone).

    python benchmarks/cp_scaling.py [--gpus 1,2] [--layers 32] [--cases decode_1m,...] [--json PATH]
    python benchmarks/cp_scaling.py --smoke     # tiny shapes on the CPU (TORCH, gloo): the test suite runs it
Prints one table and writes JSON (default benchmarks/results/cp_scaling.json); exits non-zero on any error.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import torch

HQ, HK, D, BLOCK = 32, 8, 128, 16
KV_BYTES_PER_TOKEN_LAYER = 2 * HK * D * 2   # K and V, bf16
DEVICE, DTYPE = "cuda", torch.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int     # tokens each sequence holds before the step (fill_synthetic)
    new: int         # new tokens per sequence in the step
    backend: str     # kernel for the 1-GPU reference and the service
    kv: str = "auto"             # kv_cache_dtype (fp8_e4m3: one byte per element, per-page scales)
    window: int | None = None    # a sliding window (global positions) on every layer, or every window_every-th
    window_every: int = 1        # 2: layers 1, 3, 5, ... windowed, the others full (Gemma-2's alternation)
    prefill: str = "auto"        # ServiceConfig.prefill_backend


CASES = {
    "decode_128k": Case("decode_128k", 1, 131072, 1, "TRITON"),
    "decode_512k": Case("decode_512k", 1, 524288, 1, "TRITON"),
    "decode_1m": Case("decode_1m", 1, 1048576, 1, "TRITON"),
    "decode_b64_32k": Case("decode_b64_32k", 64, 32768, 1, "TRITON"),
    # fp8 KV and sliding windows (issue 22): the goals are fp8 <= 0.6x bf16's kernel time, a window of 4,096 at
    # 1M costing what a 4,096-token context costs.
    "decode_1m_fp8": Case("decode_1m_fp8", 1, 1048576, 1, "TRITON", kv="fp8_e4m3"),
    "decode_1m_w4096": Case("decode_1m_w4096", 1, 1048576, 1, "TRITON", window=4096),
    "decode_b64_32k_fp8": Case("decode_b64_32k_fp8", 64, 32768, 1, "TRITON", kv="fp8_e4m3"),
    # FLASHINFER's windows (flashinfer_windows.py): decodes grouped by count; a chunk by FlashInfer's rule on one
    # shard, a masked plan on each of two.
    "decode_1m_w4096_flashinfer": Case("decode_1m_w4096_flashinfer", 1, 1048576, 1, "FLASHINFER", window=4096),
    "chunked_8k_on_512k_w4096_flashinfer": Case("chunked_8k_on_512k_w4096_flashinfer", 1, 524288, 8192,
                                                "FLASHINFER", window=4096, prefill="same"),
    # TRITON's windowed chunk beside it (prefill same: auto would take FLASH_ATTN, whose windowed layers run on
    # TRITON's kernels; FLASHINFER's row above is prefilled by FLASHINFER for the same reason).
    "chunked_8k_on_512k_w4096": Case("chunked_8k_on_512k_w4096", 1, 524288, 8192, "TRITON", window=4096,
                                     prefill="same"),
    # A model of full and windowed layers (Gemma-2's alternation), chunked: TRITON prefilling every layer against
    # FLASH_ATTN (its full layers on FlashAttention, its windowed ones on TRITON's kernels): the timing that set
    # FLASH_ATTN's auto_prefill_with_windows (RESULTS.md "Session 22").
    "chunked_8k_on_512k_alt4096": Case("chunked_8k_on_512k_alt4096", 1, 524288, 8192, "TRITON", window=4096,
                                       window_every=2, prefill="same"),
    "chunked_8k_on_512k_alt4096_flash_attn": Case("chunked_8k_on_512k_alt4096_flash_attn", 1, 524288, 8192, "TRITON",
                                                  window=4096, window_every=2, prefill="FLASH_ATTN"),
    "prefill_32k": Case("prefill_32k", 1, 0, 32768, "FLASH_ATTN"),
    "prefill_128k": Case("prefill_128k", 1, 0, 131072, "FLASH_ATTN"),
    "chunked_8k_on_512k": Case("chunked_8k_on_512k", 1, 524288, 8192, "FLASH_ATTN"),
    # The scale run (4 and 8 GPUs): the 1-GPU kernel column is measured where its KV fits one GPU.
    "decode_4m": Case("decode_4m", 1, 4 * 1048576, 1, "TRITON"),
    "decode_10m": Case("decode_10m", 1, 10 * 1048576, 1, "TRITON"),
    "prefill_256k": Case("prefill_256k", 1, 0, 262144, "FLASH_ATTN"),
    "prefill_1m": Case("prefill_1m", 1, 0, 1048576, "FLASH_ATTN"),
}
DEFAULT_CASES = ("decode_128k", "decode_512k", "decode_1m", "decode_b64_32k", "prefill_32k", "prefill_128k",
                 "chunked_8k_on_512k", "decode_1m_fp8", "decode_1m_w4096", "decode_b64_32k_fp8")
# --smoke: every code path of a real run (fill, decode, batched decode, prefill split across shards, chunked
# prefill, 1 and 2 shards, the kernel column) on tiny shapes on the CPU, in seconds.
SMOKE_CASES = {
    "decode_smoke": Case("decode_smoke", 1, 300, 1, "TORCH"),
    "decode_b4_smoke": Case("decode_b4_smoke", 4, 70, 1, "TORCH"),
    "prefill_smoke": Case("prefill_smoke", 1, 0, 96, "TORCH"),
    "chunked_smoke": Case("chunked_smoke", 1, 200, 40, "TORCH"),
    "decode_fp8_w64_smoke": Case("decode_fp8_w64_smoke", 2, 300, 1, "TORCH", kv="fp8_e4m3", window=64),
    "chunked_fp8_w64_smoke": Case("chunked_fp8_w64_smoke", 1, 200, 40, "TORCH", kv="fp8_e4m3", window=64),
    "chunked_alt64_smoke": Case("chunked_alt64_smoke", 1, 200, 40, "TORCH", window=64, window_every=2,
                                prefill="TORCH"),
}


def use_smoke_shapes() -> None:
    global HQ, HK, D, BLOCK, KV_BYTES_PER_TOKEN_LAYER, DEVICE, DTYPE, RUN_STEPS
    HQ, HK, D, BLOCK, DEVICE, DTYPE = 4, 2, 16, 16, "cpu", torch.float32
    RUN_STEPS = 8   # runs of 4 and 8 steps: every path of a decode run in a few steps
    KV_BYTES_PER_TOKEN_LAYER = 2 * HK * D * 4


def layer_windows(case: Case, layers: int) -> list[int | None]:
    """ServiceConfig.sliding_window for the case's ``layers`` layers."""
    return [case.window if i % case.window_every == case.window_every - 1 else None for i in range(layers)]


def kernel_backend(case: Case) -> str:
    """The backend the service runs the case's step on: its prefill backend where one is named and the step
    prefills, else its decode backend."""
    return case.prefill if case.prefill not in ("auto", "same") and case.new > 1 else case.backend


def _features(case: Case) -> dict:
    return {"kv_cache_dtype": case.kv, "sliding_window": case.window is not None}


def usable_backend(name: str, case: Case) -> str:
    from cpattn.attention import get_attn_backend
    from cpattn.errors import BackendUnavailableError

    try:
        get_attn_backend(name, head_size=D, dtype=DTYPE, block_size=BLOCK, num_q_heads=HQ, num_kv_heads=HK,
                         device=DEVICE, **_features(case))
        return name
    except BackendUnavailableError:
        return "TRITON" if DEVICE == "cuda" else "TORCH"


def _kv_bytes_per_token_layer(case: Case) -> float:
    return KV_BYTES_PER_TOKEN_LAYER * (0.5 if case.kv.startswith("fp8") and DTYPE == torch.bfloat16 else
                                       0.25 if case.kv.startswith("fp8") else 1.0)


def layers_that_fit(case: Case, gpus: int, wanted: int, budget_gb: float, repeats: int) -> int:
    """As many layers as the pages one shard allocates for the case's run fit in ``budget_gb`` (at least one)."""
    per_layer = _blocks_per_shard(case, gpus, repeats) * BLOCK * _kv_bytes_per_token_layer(case)
    return max(1, min(wanted, int(budget_gb * 2**30 // per_layer)))


def _blocks_per_shard(case: Case, gpus: int, repeats: int) -> int:
    """Pages one shard needs for a case's run: a case with a context keeps its sequences, which grow by ``new``
    every step (warm-ups and slack included); a case without one opens fresh sequences each step and frees
    them, so one step's tokens suffice (charging every repeat's prefill made a 32K prefill ask for 1.6M tokens'
    pages and run out of memory)."""
    warm, measured = steps_of(case, repeats)
    # + a run's pages reserved ahead (its segment and the extension asked during it: two of decode_run_steps) and slack
    grown = case.context + case.new * (warm + measured + 2 * RUN_STEPS + 8) if case.context else case.new
    return -(-case.batch * grown // gpus) // BLOCK + 2 * case.batch + 16


from cpattn.config import ServiceConfig  # noqa: E402  (pydantic only)

RUN_STEPS = ServiceConfig.model_fields["decode_run_steps"].default
RUN_EXTEND = True
"""decode_run_extend of the services (``--no-extend``: False, each run ends after RUN_STEPS and the next begins)."""
"""ServiceConfig.decode_run_steps of every service here: the default (8 under --smoke)."""


def steps_of(case: Case, repeats: int) -> tuple[int, int]:
    """(warm-up steps, measured steps). Two warm-ups (kernel JIT, NCCL communicators, graph captures); a decode
    case (a context, one new token a sequence) also warms up through the runs a decode loop grows through
    (client_run.FIRST_RUN_STEPS doubling up to decode_run_steps: 4 + 8 + ... steps, the first two warm-ups among
    them) and measures whole runs of RUN_STEPS, so a run start (one begin_step round trip) is charged once per
    RUN_STEPS steps, as a long decode loop pays it; before, 40 steps after two warm-ups held three run starts."""
    if not (case.context and case.new == 1):
        return 2, repeats
    from cpattn.cluster.client_run import FIRST_RUN_STEPS

    ramp, run = 0, FIRST_RUN_STEPS
    while run < RUN_STEPS:
        ramp, run = ramp + run, run * 2
    return max(2, ramp), -(-repeats // RUN_STEPS) * RUN_STEPS


def _fits_one_gpu(case: Case, budget_gb: float) -> bool:
    """One layer of the whole batch's KV on one GPU (the kernel column); 10M tokens do not fit."""
    return case.batch * (case.context + case.new) * _kv_bytes_per_token_layer(case) <= budget_gb * 2**30


def kernel_ms(case: Case, backend: str, repeats: int) -> tuple[float, float]:
    """One backend call on cuda:0 over the whole (unsharded) batch: causal, context + new tokens. Returns the
    eager call (launches included, as a caller without graphs pays them) and the same call replayed from a CUDA
    graph (the kernels alone, as the service's graphed decode runs them; nan where the call cannot be captured).
    A case of full and windowed layers: their mean, in the model's proportion."""
    if case.window_every > 1:
        full = kernel_ms(replace(case, window=None, window_every=1), backend, repeats)
        windowed = kernel_ms(replace(case, window_every=1), backend, repeats)
        k = case.window_every
        return tuple(((k - 1) * f + w) / k for f, w in zip(full, windowed))
    from cpattn.attention import AttentionSpec, get_attn_backend, make_causal_metadata

    cls = get_attn_backend(backend, head_size=D, dtype=DTYPE, block_size=BLOCK, num_q_heads=HQ,
                           num_kv_heads=HK, device=DEVICE, **_features(case))
    spec = AttentionSpec(HQ, HK, D, DTYPE, BLOCK, DEVICE, sliding_windows=(case.window,))
    pages = -(-(case.context + case.new) // BLOCK)
    cache = torch.randn(cls.get_kv_cache_shape(case.batch * pages, BLOCK, HK, D), device=DEVICE, dtype=DTYPE)
    extra = {}
    if case.kv.startswith("fp8"):
        from cpattn.kvstore.fp8 import fp8_dtype, page_scales_of, quantize

        scales = page_scales_of(cache, case.kv)                                  # per page, as the service keeps
        cache = quantize(cache, scales[:, :, None, :, None], fp8_dtype(case.kv))
        extra["kv_scale"] = scales
    table = torch.randperm(case.batch * pages).view(case.batch, pages)
    md = cls.get_builder_cls()(spec).build(0, make_causal_metadata([case.new] * case.batch, [case.context] * case.batch,
                                                                     table, BLOCK).to(DEVICE))
    impl = cls.get_impl_cls()(spec)
    t = case.batch * case.new
    q, k, v = (torch.randn(t, h, D, device=DEVICE, dtype=DTYPE) for h in (HQ, HK, HK))
    call = functools.partial(impl.forward, 0, q, k, v, cache, md, **extra)
    eager = _median_ms(call, repeats)
    graphed = float("nan")
    if DEVICE == "cuda":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            graphed = _median_ms(graph.replay, repeats)
        except Exception as exc:   # a backend whose call cannot be captured: the eager column stands alone
            print(f"  ({case.name}: {backend} not captured: {type(exc).__name__}: {str(exc)[:120]})")
        del graph
    del cache
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return eager, graphed


def _median_ms(call, repeats: int) -> float:
    """Median of ``repeats`` calls after two warm-ups: CUDA events on the GPU, wall time on the CPU."""
    times = []
    for i in range(repeats + 2):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            call()
            elapsed = 1e3 * (time.perf_counter() - t0)
        if i >= 2:
            times.append(elapsed)
    return statistics.median(times)


@dataclass
class Planned:
    """One service to start and the cases measured on it."""
    gpus: int
    cases: list[Case]
    layers: int
    backends: dict[str, str]
    config: object   # cpattn.ServiceConfig


def plan_services(gpus: int, cases: list[Case], wanted_layers: int, repeats: int, budget_gb: float,
                  one_service: bool = False, prefill_wire: str = "auto", wire_flops: float = 3000.0) -> list[Planned]:
    """One service of ``gpus`` shards (one GPU each) per case, sized for it (``one_service``: one for all the
    cases, as --smoke does so that it runs in seconds)."""
    import cpattn

    groups = [[c] for c in cases]
    if one_service:            # one service per KV format and window (service-wide settings)
        settings = list(dict.fromkeys((c.kv, c.window, c.window_every, c.prefill) for c in cases))
        groups = [[c for c in cases if (c.kv, c.window, c.window_every, c.prefill) == kw] for kw in settings]
    planned = []
    for i, group in enumerate(groups):
        layers = min(layers_that_fit(c, gpus, wanted_layers, budget_gb, repeats) for c in group)
        backends = {c.name: usable_backend(c.backend, c) for c in group}
        blocks = sum(_blocks_per_shard(c, gpus, repeats) for c in group)
        gpu = DEVICE == "cuda"
        cfg = cpattn.ServiceConfig(num_shards=gpus, num_layers=layers, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
                                   block_size=BLOCK, dtype=str(DTYPE).removeprefix("torch."),
                                   backend=backends[group[0].name], device=DEVICE, num_gpus_per_shard=1 if gpu else 0,
                                   num_cpus_per_shard=1 if gpu else 0.25, num_blocks_per_shard=blocks,
                                   name=f"cp-scaling-{gpus}-{i}", rpc_timeout_s=600, collective_timeout_s=600,
                                   shard_hang_timeout_s=600, pcp_min_tokens=2048 if gpu else 32,
                                   # one step of the case, whatever its size (the default caps steps at 16K)
                                   max_tokens_per_step=max(16384, *(c.batch * c.new for c in group)),
                                   kv_cache_dtype=group[0].kv, sliding_window=layer_windows(group[0], layers),
                                   prefill_backend=group[0].prefill,
                                   prefill_wire=prefill_wire, pcp_wire_flops_per_byte=wire_flops,
                                   decode_run_steps=RUN_STEPS, decode_run_extend=RUN_EXTEND)
        planned.append(Planned(gpus, group, layers, backends, cfg))
    return planned


def service_rows(planned: list[Planned], repeats: int, concurrent_starts: bool = False):
    """Yields one row per case, whole steps timed. GPU services run one at a time (each may need every GPU);
    ``concurrent_starts`` (--smoke, CPU shards) starts every service at once, as a start is mostly its actors'
    process startup, then measures them one after another."""
    import cpattn

    if not concurrent_starts:
        for p in planned:
            svc = cpattn.start(p.config)
            try:
                yield from _rows(svc, p, repeats)
            finally:
                svc.shutdown()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(planned)) as pool:
        futures = [pool.submit(cpattn.start, p.config) for p in planned]
    services = []
    try:
        for future in futures:   # every start has finished (the pool's exit waited): collect them all, then raise
            if future.exception() is None:
                services.append(future.result())
        for future in futures:
            future.result()
        for svc, p in zip(services, planned):
            yield from _rows(svc, p, repeats)
    finally:
        for svc in services:
            svc.shutdown()


def _rows(svc, p: Planned, repeats: int):
    for case in p.cases:
        row = _measure(svc, case, p.gpus, p.layers, repeats, p.backends[case.name])
        print(_fmt(row), flush=True)
        yield row


def _measure(svc, case: Case, gpus: int, layers: int, repeats: int, backend: str) -> dict:
    t = case.batch * case.new
    q, k, v = (torch.randn(t, h, D, device=DEVICE, dtype=DTYPE) for h in (HQ, HK, HK))
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    seqs = []
    if case.context:
        seqs = [svc.add_sequence() for _ in range(case.batch)]
        for i, s in enumerate(seqs):
            svc.fill_synthetic(s, case.context, seed=i)
    walls, timings, begins, sent, starts = [], [], [], [], 0
    assert svc.config.decode_run_steps == RUN_STEPS, "steps_of counts runs of RUN_STEPS"
    warm, measured = steps_of(case, repeats)
    for rep in range(warm + measured):
        if not case.context:
            seqs = [svc.add_sequence() for _ in range(case.batch)]
        sync()
        t0 = time.perf_counter()
        with svc.step({s: case.new for s in seqs}) as step:
            for layer in range(layers):
                step.attend(layer, q, k, v)
        sync()
        wall = time.perf_counter() - t0
        sent.append(step.timings["sent_bytes"])
        if rep >= warm:   # a warm-up step's opening compiles and captures, a short run's plans more often
            timings.append(step.timings)   # its plan_s is complete once its run ended (the shards report per run)
            walls.append(wall)
            begins.append(step.timings["begin_s"])
            starts += "begin_rpc" in step.timings.get("begin_parts", {})   # this step asked the coordinator
        if not case.context:
            for s in seqs:
                svc.free(s)
    gw = svc.gateway
    gw.flush(end_run=True)   # the run ends: its shards' plans are shared out over its steps' timings (in place)
    plans = [t["plan_s"] for t in timings]
    # The mean, not the median: a decode run's first step carries the plan of all its steps (decode_run_steps),
    # and the mean charges it to every step as a decode loop pays it.
    wall = statistics.fmean(walls)
    return {"case": case.name, "gpus": gpus, "batch": case.batch, "context": case.context, "new": case.new,
            "kv_cache_dtype": case.kv, "window": case.window, "window_every": case.window_every,
            "prefill_backend": svc.config.prefill_backend, "layers": layers, "backend": backend, "local_shards": sorted(gw.local),
            "data_plane": gw.plane.backend if gw.plane else "none",
            "local_graphs": [g.key for g in gw.local_graphs.values() if g is not None and g.key],
            "ms_per_layer": 1e3 * wall / layers, "step_ms": 1e3 * wall,
            "step_ms_median": 1e3 * statistics.median(walls), "decode_run_steps": svc.config.decode_run_steps,
            "decode_run_extend": svc.config.decode_run_extend,
            "warmup_steps": warm, "measured_steps": len(walls), "measured_begin_step_calls": starts,
            "plan_ms_per_step": 1e3 * statistics.fmean(plans),
            # The caller's wall time to open a step (issue 18's "plan on the client's path"): the run's begin_step
            # round trip on its first step, the in-process shards' plans on every step.
            "begin_ms_per_step": 1e3 * statistics.fmean(begins),
            # The slowest opening and step measured: a run's start or a segment's planned step (a decode loop's
            # latency spikes), which a mean spreads out
            "begin_ms_max": 1e3 * max(begins), "step_ms_max": 1e3 * max(walls),
            # Opening by phase (begin_rpc: the coordinator's round trip; flush: the previous commit's answer read;
            # local_plans: the in-process shards' plans; ...), means over the measured steps.
            "begin_parts_ms": _mean_parts([t.get("begin_parts", {}) for t in timings]),
            # The caller's time inside one attend call: above the kernel's time per layer, the host sets the pace
            "attend_ms_per_layer": 1e3 * statistics.fmean(t["data_plane_s"] for t in timings) / layers,
            # The caller's time to end a step (wait for the device, the NaN flags, the commit sent): with begin and
            # attend, what is left of step_ms is the caller's own Python between calls.
            "end_ms_per_step": 1e3 * statistics.fmean(t.get("end_s", 0.0) for t in timings),
            # What the client sent its remote shards per layer (the broadcast, or each rank's own rows: issue 18).
            "sent_mb_per_layer": statistics.fmean(sent) / layers / 1e6,
            "prefill_wire": svc.config.prefill_wire, "pcp_wire_flops_per_byte": svc.config.pcp_wire_flops_per_byte}


def _mean_parts(parts: list[dict]) -> dict:
    names = dict.fromkeys(name for p in parts for name in p)
    return {name: 1e3 * statistics.fmean(p.get(name, 0.0) for p in parts) for name in names}


def _fmt(r: dict) -> str:
    return (f"{r['case']:>20} {r['gpus']:>4} {r['layers']:>6} {r['data_plane']:>6} {r['plan_ms_per_step']:>9.2f} "
            f"{r['begin_ms_per_step']:>10.2f} {r['ms_per_layer']:>9.3f} {r.get('kernel_ms', float('nan')):>9.3f} "
            f"{r.get('kernel_graph_ms', float('nan')):>9.3f} {r.get('speedup', float('nan')):>7.2f} "
            f"{r.get('sent_mb_per_layer', float('nan')):>8.1f}")


HEADER = (f"{'case':>20} {'gpus':>4} {'layers':>6} {'wire':>6} {'plan/step':>9} {'begin/step':>10} {'ms/layer':>9} "
          f"{'kernel':>9} {'graphed':>9} {'x kern':>7} {'MB sent':>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="service sizes (one shard per GPU)")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-budget-gb", type=float, default=96.0, help="KV per GPU for the layers of one service")
    parser.add_argument("--json", default="benchmarks/results/cp_scaling.json")
    parser.add_argument("--prefill-wire", default="auto", choices=("auto", "broadcast", "per_rank"),
                        help="ServiceConfig.prefill_wire: how a prefill's q|k|v reach the remote shards")
    parser.add_argument("--pcp-wire-flops-per-byte", type=float, default=3000.0,
                        help="ServiceConfig.pcp_wire_flops_per_byte: how much smaller a remote shard's causal share "
                             "of a prefill is (0: equal shares)")
    parser.add_argument("--no-extend", action="store_true",
                        help="decode_run_extend=False: a decode run ends after its steps and the next one begins with "
                             "a begin_step (what a run's start costs a step, with extensions hidden)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (TORCH backend, gloo), 1 and 2 shards, 2 layers: checks that "
                             "every path of the benchmark still runs (the test suite runs it)")
    args = parser.parse_args(argv)
    import ray

    global RUN_EXTEND
    RUN_EXTEND = not args.no_extend

    if args.smoke:
        use_smoke_shapes()
        CASES.update(SMOKE_CASES)
        args.cases, args.layers, args.repeats = ",".join(SMOKE_CASES), min(args.layers, 2), 1
    cases = [CASES[c] for c in args.cases.split(",")]
    gpu = DEVICE == "cuda"
    meta = {"date": date.today().isoformat(), "machine": platform.node(),
            "gpu": torch.cuda.get_device_name() if gpu else "none (cpu)", "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "ray": ray.__version__, "heads": [HQ, HK, D],
            "dtype": str(DTYPE).removeprefix("torch."), "block_size": BLOCK}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"cp_scaling: Hq {HQ} Hk {HK} D {D} bf16, page {BLOCK}, up to {args.layers} layers per step; "
          f"ms/layer = step wall time / layers (means of {args.repeats} steps)")
    print(HEADER)
    # One Ray for the whole run, started as cpattn.start would (an embedded local instance): a service's start
    # then costs only its own actors, not a Ray start and shutdown each.
    from cpattn.cluster.service import ensure_ray

    kernels = {c.name: (kernel_ms(c, usable_backend(kernel_backend(c), c), args.repeats) if _fits_one_gpu(c, args.kv_budget_gb)
                        else (float("nan"), float("nan"))) for c in cases}
    planned = [p for gpus in map(int, args.gpus.split(","))
               for p in plan_services(gpus, cases, args.layers, args.repeats, args.kv_budget_gb, one_service=args.smoke,
                                      prefill_wire=args.prefill_wire, wire_flops=args.pcp_wire_flops_per_byte)]
    # CPUs for the shards of the services up at once: all of them with --smoke (concurrent starts), else the largest.
    cpus = [p.config.num_shards * p.config.num_cpus_per_shard for p in planned]
    ensure_ray(None, "cpattn", num_cpus_hint=sum(cpus) if args.smoke else max(cpus))
    rows = []
    for row in service_rows(planned, args.repeats, concurrent_starts=args.smoke):
        row["kernel_ms"], row["kernel_graph_ms"] = kernels[row["case"]]
        row["speedup"] = row["kernel_ms"] / row["ms_per_layer"]
        rows.append(row)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))   # every row as it comes: a long run
    print("\nsummary (x kern = one 1-GPU kernel call / service ms per layer):")
    print(HEADER)
    for r in rows:
        print(_fmt(r))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
