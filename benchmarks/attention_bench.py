"""GPU attention benchmarks: each backend alone and through cpattn's per-rank (DCP / PCP) path.

Hq 32, Hk 8, D 128, bf16, page 16, random data, pages placed by a random permutation. Timings are
medians of CUDA-event timings after warm-up; each forward includes the step's KV write.
Sections (``--sections``):
  copy     the device-to-device copy ceiling (read + write GB/s)
  decode   B=1 L=128K and 1M, B=64 L=32K, B=256 L=4K: ms and GB/s of K/V read, vs the copy ceiling
  dcp      the 1M decode split over N=4 shards on one GPU: 4 context partials + the new token's
           causal part + the GPU merge (the per-rank path the service runs)
  prefill  causal prefill 32K and 128K: TFLOP/s; PCP N=4 (head-tail chunk pairs) vs one call
  merge    the merge kernel: N = 2, 4, 8 at T = 1, 64, 4096: GB/s
  sweep    decode B=1 latency vs context length per backend (the plot)
  tune     the TRITON decode launch config (split waves, tile, warps, stages); keeps the best
Writes JSON (``--out``) and prints a table.

Usage: python benchmarks/attention_bench.py --backends TRITON,FLASH_ATTN,FLASHINFER --out bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpattn.attention import AttentionSpec, LseBase, make_causal_metadata, make_dcp_context_metadata, to_natural_lse  # noqa: E402
from cpattn.attention.registry import load_backend_class  # noqa: E402
from cpattn.kvstore import dcp_local_seq_lens  # noqa: E402

HQ, HK, D, PS = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"
KV_BYTES_PER_TOKEN = 2 * HK * D * 2     # K and V, bf16


def timed(fn, warmup=3, iters=20, back_to_back=4) -> float:
    """Median milliseconds per call of ``fn``: ``iters`` CUDA-event timed groups of ``back_to_back``
    calls after ``warmup``. Groups let the host queue the next call while the GPU runs the last, as
    a model's layer loop does; a host-bound call still shows its host time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(times)


def make_cache(num_tokens_per_req: list[int], seed: int = 0):
    """A random cache holding the given lengths, pages placed by a random permutation."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = [-(-n // PS) for n in num_tokens_per_req]
    num_blocks = sum(pages) + 1
    kv = torch.empty(2, num_blocks, PS, HK, D, dtype=DTYPE, device=DEV)
    kv.normal_(generator=g)
    perm = torch.randperm(num_blocks, device=DEV, generator=g)
    table = torch.full((len(pages), max(pages)), -1, dtype=torch.int64, device=DEV)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used:used + p]
        used += p
    return kv, table


def spec() -> AttentionSpec:
    return AttentionSpec(num_q_heads=HQ, num_kv_heads=HK, head_size=D, dtype=DTYPE, block_size=PS, device=DEV)


def qkv(t: int, seed: int = 1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(t, h, D, generator=g, device=DEV, dtype=DTYPE) for h in (HQ, HK, HK))


def decode_case(name: str, batch: int, length: int) -> dict:
    cls = load_backend_class(name)
    kv, table = make_cache([length] * batch)
    md = make_causal_metadata([1] * batch, [length - 1] * batch, table.cpu(), PS).to(DEV)
    builder, impl = cls.get_builder_cls()(spec()), cls.get_impl_cls()(spec())
    plan = builder.build(0, md)
    q, k, v = qkv(batch)
    ms = timed(lambda: impl.forward(0, q, k, v, kv, plan), iters=20 if batch * length <= 2 ** 22 else 10)
    nbytes = batch * length * KV_BYTES_PER_TOKEN
    del kv
    return dict(backend=name, B=batch, L=length, ms=ms, GBps=nbytes / ms / 1e6)


def dcp_case(name: str, length: int, world: int = 4) -> dict:
    """One sequence of ``length`` keys dealt over ``world`` shards (interleave = page size) on one GPU."""
    from cpattn.attention.ops.merge import merge_partials

    cls = load_backend_class(name)
    ctx = length - 1
    shards = []
    for rank in range(world):
        local_ctx = int(dcp_local_seq_lens([ctx], world, rank, PS)[0])
        owns_new = int(dcp_local_seq_lens([length], world, rank, PS)[0]) - local_ctx
        kv, table = make_cache([local_ctx + owns_new], seed=rank)
        md = make_dcp_context_metadata([1], [ctx], table.cpu(), PS, world, rank, PS).to(DEV)
        builder = cls.get_builder_cls()(spec())
        shards.append((kv, builder.build(0, md)))
    impl = cls.get_impl_cls()(spec())
    q, k, v = qkv(1)
    pieces = torch.tensor([[0, 1, 0]])
    base = cls.lse_base

    def step():
        outs, lses = [], []
        for kv, plan in shards:
            o, l = impl.forward(0, q, k, v, kv, plan)
            outs.append(o)
            lses.append(l if base is LseBase.E else to_natural_lse(l, base))
        o, l = impl.forward_new_tokens(q, k, v, pieces)
        outs.append(o)
        lses.append(l)
        return merge_partials(torch.stack(outs), torch.stack(lses), LseBase.E)

    ms = timed(step, iters=20)
    # Component times: the slowest shard alone, and the merge alone.
    shard_ms = timed(lambda: impl.forward(0, q, k, v, *shards[0]), iters=20)
    outs = torch.randn(world + 1, 1, HQ, D, device=DEV, dtype=DTYPE)
    lses = torch.randn(world + 1, 1, HQ, device=DEV)
    merge_ms = timed(lambda: merge_partials(outs, lses, LseBase.E), iters=50)
    graph_ms, graph_error = _graph_time(step) if name == "TRITON" else (None, "not tried")
    nbytes = length * KV_BYTES_PER_TOKEN
    floor_ms = nbytes / 4250e9 * 1e3     # every K/V byte read once at the copy ceiling
    return dict(backend=name, N=world, L=length, ms=ms, GBps=nbytes / ms / 1e6, shard_ms=shard_ms, merge_ms=merge_ms,
                hbm_floor_ms=floor_ms, graph_ms=graph_ms, graph_error=graph_error)


def _graph_time(fn, iters=20) -> tuple[float | None, str | None]:
    """GPU time of ``fn`` with host overhead removed: capture it in a CUDA graph, time replays."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timed(graph.replay, iters=iters), None
    except Exception as exc:   # report, do not fail the run
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}"[:300]


def prefill_case(name: str, length: int, world: int = 4) -> dict:
    cls = load_backend_class(name)
    kv, table = make_cache([length])
    md = make_causal_metadata([length], [0], table.cpu(), PS).to(DEV)
    builder, impl = cls.get_builder_cls()(spec()), cls.get_impl_cls()(spec())
    plan = builder.build(0, md)
    q, k, v = qkv(length)
    iters = 10 if length <= 32768 else 3
    ms = timed(lambda: impl.forward(0, q, k, v, kv, plan), warmup=2, iters=iters, back_to_back=1)
    flops = 2 * HQ * D * length * length     # causal: half of 4 * H * D * L^2
    res = dict(backend=name, L=length, ms=ms, TFLOPs=flops / ms / 1e9)
    # PCP: 2N chunks, rank r gets chunks r and 2N-1-r (head-tail pairing), causal among new tokens.
    chunk = length // (2 * world)
    bounds = [(i * chunk, (i + 1) * chunk if i < 2 * world - 1 else length) for i in range(2 * world)]
    single = torch.tensor([[0, length, 0]])
    single_ms = timed(lambda: impl.forward_new_tokens(q, k, v, single), warmup=2, iters=iters, back_to_back=1)
    rank_ms = []
    for r in range(world):
        a, b = bounds[r], bounds[2 * world - 1 - r]
        pieces = torch.tensor([[a[0], a[1], 0], [b[0], b[1], 0]])
        rank_ms.append(timed(lambda p=pieces: impl.forward_new_tokens(q, k, v, p), warmup=2, iters=iters,
                             back_to_back=1))
    res.update(new_tokens_single_ms=single_ms, pcp_rank_ms=rank_ms,
               pcp_sum_cost=sum(rank_ms) / single_ms - 1.0,
               pcp_parallel_cost=world * max(rank_ms) / single_ms - 1.0)
    del kv
    return res


def merge_case(n: int, t: int) -> dict:
    from cpattn.attention.ops.merge import merge_attn_states
    from cpattn.attention.merge_triton import merge_attn_states_triton

    outs = torch.randn(n, t, HQ, D, device=DEV, dtype=DTYPE)
    lses = torch.randn(n, t, HQ, device=DEV) * 5
    ms = timed(lambda: merge_attn_states_triton(outs, lses, LseBase.TWO), iters=50)
    torch_ms = timed(lambda: merge_attn_states(outs, lses, LseBase.TWO), iters=20)
    graph_ms, _ = _graph_time(lambda: merge_attn_states_triton(outs, lses, LseBase.TWO), iters=50)
    nbytes = outs.numel() * 2 + lses.numel() * 4 + t * HQ * D * 2 + t * HQ * 4
    return dict(N=n, T=t, ms=ms, GBps=nbytes / ms / 1e6, torch_ms=torch_ms, graph_ms=graph_ms,
                graph_GBps=nbytes / graph_ms / 1e6 if graph_ms else None)


def copy_ceiling() -> float:
    x = torch.empty(2 ** 30, dtype=torch.uint8, device=DEV)
    x.random_(0, 255)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / ms / 1e6


TUNE_CONFIGS = [dict(waves=w, block_n=64, num_warps=4, num_stages=3) for w in (2, 4, 8)] + [
    dict(waves=4, block_n=64, num_warps=4, num_stages=4), dict(waves=4, block_n=128, num_warps=4, num_stages=3),
    dict(waves=4, block_n=128, num_warps=8, num_stages=3), dict(waves=4, block_n=32, num_warps=4, num_stages=4)]


def tune_triton_decode(results: dict) -> None:
    """Time the TRITON decode under each launch config; keep the best for B=1 L=1M (ties: B=64)."""
    from cpattn.attention.backends import triton_decode as tk

    rows = []
    for cfg in TUNE_CONFIGS:
        tk.DECODE_CONFIG.update(cfg)
        row = dict(cfg)
        for batch, length in ((1, 1048576), (64, 32768)):
            r = decode_case("TRITON", batch, length)
            row[f"ms_B{batch}"] = r["ms"]
        rows.append(row)
        print("tune", json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    best = min(rows, key=lambda r: (round(r["ms_B1"], 2), r["ms_B64"]))
    tk.DECODE_CONFIG.update({k: best[k] for k in ("waves", "block_n", "num_warps", "num_stages")})
    results["tune"] = rows
    results["decode_config"] = dict(tk.DECODE_CONFIG)


def _guard(results: dict, key: str, fn, *args):
    t0 = time.time()
    try:
        row = fn(*args)
    except Exception as exc:   # one backend failing must not lose the others' numbers
        row = dict(args=[str(a) for a in args], error=f"{type(exc).__name__}: {exc}"[:500])
    row["wall_s"] = round(time.time() - t0, 2)
    results.setdefault(key, []).append(row)
    print(key, json.dumps(row), flush=True)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="TRITON,FLASH_ATTN,FLASHINFER")
    ap.add_argument("--sections", default="copy,tune,decode,dcp,prefill,merge,sweep")
    ap.add_argument("--out", default="attention_bench.json")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    sections = args.sections.split(",")
    import triton

    results: dict = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                         versions=dict(torch=torch.__version__, triton=triton.__version__),
                         shape=dict(Hq=HQ, Hk=HK, D=D, dtype="bfloat16", page=PS))
    for name in backends:
        results["versions"][name] = load_backend_class(name).kernel_version()
    if "copy" in sections:
        results["copy_GBps"] = copy_ceiling()
        print("copy GB/s", results["copy_GBps"], flush=True)
    if "tune" in sections and "TRITON" in backends:
        tune_triton_decode(results)
    if "merge" in sections:
        for n in (2, 4, 8):
            for t in (1, 64, 4096):
                _guard(results, "merge", merge_case, n, t)
    for name in backends:
        if "decode" in sections:
            for batch, length in ((1, 131072), (1, 1048576), (64, 32768), (256, 4096)):
                _guard(results, "decode", decode_case, name, batch, length)
        if "dcp" in sections:
            _guard(results, "dcp", dcp_case, name, 1048576)
        if "sweep" in sections:
            for length in (4096, 16384, 65536, 262144):
                _guard(results, "sweep", decode_case, name, 1, length)
        if "prefill" in sections:
            for length in (32768, 131072):
                _guard(results, "prefill", prefill_case, name, length)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: dict) -> None:
    ceiling = results.get("copy_GBps", 4250.0)
    for row in results.get("decode", []) + results.get("sweep", []):
        if "ms" in row:
            print(f"decode {row['backend']:<11} B={row['B']:<4} L={row['L']:<8} {row['ms']:8.3f} ms "
                  f"{row['GBps']:7.0f} GB/s ({row['GBps'] / ceiling:.0%} of copy)")
    for row in results.get("dcp", []):
        if "ms" in row:
            print(f"dcp    {row['backend']:<11} N={row['N']} L={row['L']} {row['ms']:8.3f} ms "
                  f"(floor {row['hbm_floor_ms']:.3f} ms, x{row['ms'] / row['hbm_floor_ms']:.2f}); "
                  f"GPU time (graph) {row.get('graph_ms')}")
    for row in results.get("prefill", []):
        if "ms" in row:
            print(f"prefill {row['backend']:<11} L={row['L']:<7} {row['ms']:9.2f} ms {row['TFLOPs']:6.0f} TFLOP/s "
                  f"PCP sum cost {row['pcp_sum_cost']:+.1%} parallel {row['pcp_parallel_cost']:+.1%}")
    for row in results.get("merge", []):
        if "ms" in row:
            print(f"merge N={row['N']} T={row['T']:<5} {row['ms'] * 1e3:8.1f} us {row['GBps']:7.0f} GB/s "
                  f"(torch {row['torch_ms'] * 1e3:.1f} us); GPU time (graph) {row.get('graph_ms')} ms, "
                  f"{row.get('graph_GBps')} GB/s")


if __name__ == "__main__":
    main()
