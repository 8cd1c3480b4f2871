"""What the TRITON kernel sweeps share (triton_decode_sweep.py --fp8-sweep, prefix_pass_sweep.py): outlier data in a
paged cache (bf16, and fp8 e4m3 with per-page power-of-two scales as the service stores it), float64 references,
CUDA-graph timing with CUDA events, and a staged search over launch configurations under a time budget. On a GPU;
``--smoke`` runs a sweep's every path at tiny shapes on the CPU through Triton's interpreter (TRITON_INTERPRET=1,
float16 activations: numpy has no bfloat16; times are wall times of one call, meaningless): the suite's check that
the next GPU session's command runs (tests/test_kernel_sweeps_interpret.py).

Legend: B requests of N keys, Q query heads, K kv heads, D head size, PS tokens per page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

HQ, HK, D, PS = 32, 8, 128, 16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ACT = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
"""Activations' (and the exact cache's) dtype: bf16 as served; float16 in the interpreter."""
RESULTS = Path(__file__).resolve().parent / "results"
FP8_BOUND = 1e-1
"""fp8 e4m3's bound vs float64 on outlier data (README, tests/test_triton_interpret.py)."""


@dataclass
class PagedCase:
    cache: torch.Tensor
    """[2, pages, PS, K, D] ACT: the exact values."""
    table: torch.Tensor
    """[B, N / PS] int64: each request's pages (shuffled)."""
    keys: int
    fp8: torch.Tensor | None = None
    """The cache in fp8 e4m3 and its scales [2, pages, K] (with_fp8())."""
    scales: torch.Tensor | None = None


def paged_case(batch: int, keys: int, device, seed: int = 7) -> PagedCase:
    """B requests of ``keys`` keys with the fp8 tests' outliers (one channel 20x, 0.2% of entries at +-40 sigma, K
    scaled 0.3: tests/kernel_feature_cases.py), pages shuffled."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = -(-keys // PS)
    pages = batch * per
    halves = []
    for scale in (0.3, 1.0):   # K, then V: float32 temporaries of half the cache at a time (B=64 x 32K: 8.6 GB)
        x = torch.randn(pages, PS, HK, D, generator=g, device=device)
        x[..., 3] *= 20.0
        x = torch.where(torch.rand(x.shape, generator=g, device=device) < 0.002, torch.sign(x) * 40.0, x)
        halves.append((x * scale).to(ACT))
    table = torch.randperm(pages, generator=g, device=device).view(batch, per)
    return PagedCase(torch.stack(halves), table, keys)


def with_fp8(case: PagedCase) -> PagedCase:
    """The case's cache as the service stores an fp8_e4m3 cache (kvstore.fp8: page scales, saturating rounding)."""
    from cpattn.kvstore.fp8 import FP8_FORMATS, page_scales_of, quantize

    halves = [case.cache[i:i + 1] for i in (0, 1)]   # K, then V: float32 copies of half the cache at a time
    scales = torch.cat([page_scales_of(x.float(), "fp8_e4m3") for x in halves])
    case.fp8 = torch.cat([quantize(x.float(), scales[i:i + 1, :, None, :, None], FP8_FORMATS["fp8_e4m3"])
                          for i, x in enumerate(halves)])
    case.scales = scales
    return case


@dataclass
class DecodeCall:
    """B decodes of one query each over ``case``'s requests (bf16 queries, their float64 reference), as the builder
    plans them (``splits``: it does not know the cache dtype); ``call(cache, scales)`` runs triton_decode.paged_decode
    into ``out`` / ``lse``."""
    case: PagedCase
    q: torch.Tensor
    ref: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    splits: int
    idx: torch.Tensor
    """[B] int32: decode b reads request b (also its token row)."""
    lens: torch.Tensor

    def call(self, cache: torch.Tensor, scales: torch.Tensor | None) -> None:
        from cpattn.attention.backends import triton_decode as tk
        tk.paged_decode(self.q, cache[0], cache[1], self.case.table, self.idx, self.idx, self.lens, self.splits,
                        D ** -0.5, self.out, self.lse, all_rows=True, kv_scale=scales)


def fp8_decode_call(batch: int, keys: int, device) -> DecodeCall:
    """with_fp8(paged_case(batch, keys)) and its decodes' buffers (the sweeps' and probes' shared setup)."""
    from cpattn.attention.backends import triton_decode as tk
    case = with_fp8(paged_case(batch, keys, device))
    q = torch.randn(batch, HQ, D, device=device).to(ACT)
    return DecodeCall(case, q, float64_attention(q, case), torch.empty(batch, HQ, D, dtype=ACT, device=device),
                      torch.empty(batch, HQ, dtype=torch.float32, device=device),
                      tk.decode_num_splits(batch, HK, keys, device),
                      torch.arange(batch, dtype=torch.int32, device=device),
                      torch.full((batch,), keys, dtype=torch.int32, device=device))


def float64_attention(q_BQD: torch.Tensor, case: PagedCase, rows_of_request: list[int] | None = None) -> torch.Tensor:
    """Softmax attention in float64 of each request's queries over its keys (exact values): [rows, Q, D].
    ``rows_of_request``: the request each query row reads (default row b reads request b)."""
    rows = list(range(q_BQD.shape[0])) if rows_of_request is None else rows_of_request
    g = HQ // HK
    out = torch.empty(q_BQD.shape, dtype=torch.float64, device=q_BQD.device)
    for req in sorted(set(rows)):
        mine = [i for i, r in enumerate(rows) if r == req]
        pages = case.table[req]
        for h in range(HK):   # one kv head at a time: 1M keys x D in float64 is 1 GiB
            k = case.cache[0][pages, :, h].reshape(-1, D)[:case.keys].double()
            v = case.cache[1][pages, :, h].reshape(-1, D)[:case.keys].double()
            q = q_BQD[mine, h * g:(h + 1) * g].double().reshape(-1, D)
            p = torch.softmax(q @ k.T * D ** -0.5, dim=-1)
            out[mine, h * g:(h + 1) * g] = (p @ v).view(len(mine), g, D)
    return out


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def time_graph(fn, iters: int = 10, replays: int = 10) -> float:
    """ms per call of ``fn``: ``iters`` calls captured in one CUDA graph, replayed ``replays`` times after a warm-up
    replay, timed with CUDA events (the kernels' time, not Python's). Off the GPU: one call's wall time (smoke)."""
    if DEVICE.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()   # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * replays)


class Budget:
    """A sweep's wall-time budget: later stages stop early rather than run over (the GPU time is scarce)."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def try_candidate(measure, cfg: dict) -> dict:
    """``measure(cfg)`` -> a row dict; a configuration that does not compile or run (shared memory, registers) is a
    row with its error, not the end of the sweep."""
    try:
        return dict(cfg=cfg, **measure(cfg))
    except Exception as exc:   # noqa: BLE001 - recorded and shown, never fatal to the sweep
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return dict(cfg=cfg, error=f"{type(exc).__name__}: {str(exc)[:160]}")


def new_kernel_stats(jit_fn, seen: set) -> list[dict]:
    """Registers, spills and shared memory of ``jit_fn``'s variants compiled since the last call (``seen``: ids so
    far): a tiling that spills or holds one program per SM shows here. Best effort across Triton versions ([] when
    its caches look different)."""
    stats = []
    try:
        for caches in getattr(jit_fn, "device_caches", {}).values():
            for kernel in caches[0].values():
                if id(kernel) in seen:
                    continue
                seen.add(id(kernel))
                kernel._init_handles()
                meta = kernel.metadata
                stats.append(dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=getattr(meta, "shared", None),
                                  warps=getattr(meta, "num_warps", None), stages=getattr(meta, "num_stages", None)))
    except Exception as exc:   # noqa: BLE001 - a diagnostic, never fatal
        stats.append(dict(unavailable=f"{type(exc).__name__}: {str(exc)[:80]}"))
    return stats


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (Triton interpreter smoke run)"


def config_line(name: str, cfg: dict, base: dict) -> str:
    """The CONFIG_OVERRIDES entry to paste into cpattn/attention/backends/triton_decode.py: what differs from base."""
    diff = {k: v for k, v in cfg.items() if base.get(k) != v}
    return f'    "{name}": {diff!r},'
