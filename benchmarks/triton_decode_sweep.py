"""Launch configurations of the TRITON paged decode kernel, swept on one GPU: bf16 and fp8 caches.

Times one decode (B=1, Hq 32, Hk 8, D 128, page 16: cp_scaling's geometry) over ``--contexts`` keys for
each (tile length, warps, stages, splits per SM) and checks each result against the default
configuration's output (a fast wrong tiling is not a candidate). Kernels are replayed from a CUDA graph
(10 calls per replay), so the times are the kernels', not Python's.

    python benchmarks/triton_decode_sweep.py [--contexts 131072,1048576] [--json PATH] [--goals-only]
Prints the best configurations per (context, dtype), then issue 22's kernel goals at the longest context with the
default configuration (fp8 e4m3 <= 0.6x bf16, a 4,096-key window <= 0.05 ms), and writes every row as JSON. GPU only.

    python benchmarks/triton_decode_sweep.py --fp8-sweep [--seconds 100] [--json PATH]
The fp8 cache's own configuration (triton_decode.CONFIG_OVERRIDES["fp8"]): kernel variants (page-wise tile loads,
prefetch, float16 dots, V scaled first; triton_decode_fp8_mma.py's e4m3 tensor-core q.K dots; triton_decode_heads.py's H kv
heads per program), tilings and split
factors, staged within ``--seconds``, at B=1 over 1M keys and B=64 over 32K keys (outlier data, each candidate checked
against float64: rel < 1e-1), against the bf16 kernel's time on the same data. Prints the winner, its ratio to bf16
and the line to paste; writes triton_fp8_sweep.json. With ``--smoke`` (and TRITON_INTERPRET=1, no GPU): the first
candidate of every stage at tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sweep_common import (DEVICE, FP8_BOUND, RESULTS, Budget, config_line, device_name,  # noqa: E402
                                 fp8_decode_call, new_kernel_stats, rel, time_graph, try_candidate)

from kernel_sweep_common import D, HK, HQ, PS  # noqa: E402  (cp_scaling's geometry)


def _cache(n: int, fp8: bool, device):
    g = torch.Generator(device=device).manual_seed(7)
    pages = n // PS + 1
    cache = torch.randn(2, pages, PS, HK, D, generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn(1, HQ, D, generator=g, device=device, dtype=torch.bfloat16)
    table = torch.randperm(pages, device=device, dtype=torch.int64)[None].to(torch.int32)
    scales = None
    if fp8:
        amax = cache.float().abs().amax(dim=(2, 4))                         # [2, pages, Hk]
        scales = (amax / 448.0).contiguous()
        cache = (cache.float() / scales[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q, cache, table, scales


def _run(tk, q, cache, table, scales, n, splits, out, lse, key_start=None):
    dev = q.device
    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.full((1,), n, dtype=torch.int32, device=dev)
    tk.paged_decode(q, cache[0], cache[1], table, idx, idx, lens, splits, D ** -0.5, out, lse, all_rows=True,
                    kv_scale=scales, key_start=key_start)


def goals(tk, n: int, dev, window: int = 4096) -> dict:
    """Issue 22's kernel goals at ``n`` keys with the default configuration: fp8 e4m3 <= 0.6x bf16's time (also with
    the dots in float16: DECODE_CONFIG's fp8_f16_dot), a ``window``-key sliding window <= 0.05 ms (it reads only the
    window's pages). The fp8 outputs are checked against bf16's (a fast wrong kernel is no candidate)."""
    times, outs = {}, {}
    cases = (("bf16", False, None, False), ("fp8_e4m3", True, None, False), ("fp8_e4m3_f16_dot", True, None, True),
             (f"window_{window}", False, window, False))
    base = dict(tk.DECODE_CONFIG)
    for name, fp8, win, f16 in cases:
        tk.DECODE_CONFIG.update(base, fp8_f16_dot=f16)
        q, cache, table, scales = _cache(n, fp8, dev)
        out = torch.empty(1, HQ, D, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(1, HQ, dtype=torch.float32, device=dev)
        start = None if win is None else torch.full((1,), n - win, dtype=torch.int32, device=dev)
        splits = tk.decode_num_splits(1, HK, n if win is None else win, dev)
        times[name] = time_graph(functools.partial(_run, tk, q, cache, table, scales, n, splits, out, lse, start))
        outs[name] = out.float().clone()
        del cache, scales   # one 1M-key cache at a time
        torch.cuda.empty_cache()
    tk.DECODE_CONFIG.update(base)
    ref = outs["bf16"]
    errors = {k: float((outs[k] - ref).norm() / ref.norm()) for k in ("fp8_e4m3", "fp8_e4m3_f16_dot")}
    best = min(("fp8_e4m3", "fp8_e4m3_f16_dot"), key=lambda k: times[k] if errors[k] < 1e-1 else float("inf"))
    fp8_ratio = times[best] / times["bf16"]
    result = dict(context=n, ms=times, rel_vs_bf16=errors, best_fp8=best, fp8_over_bf16=fp8_ratio,
                  fp8_goal_met=fp8_ratio <= 0.6, window_goal_met=times[f"window_{window}"] <= 0.05)
    print(f"goals at {n} keys (default configuration): bf16 {times['bf16']:.3f} ms, fp8_e4m3 {times['fp8_e4m3']:.3f} ms"
          f" (rel {errors['fp8_e4m3']:.1e}), with f16 dots {times['fp8_e4m3_f16_dot']:.3f} ms (rel "
          f"{errors['fp8_e4m3_f16_dot']:.1e}); best {fp8_ratio:.2f}x (goal <= 0.6x: "
          f"{'met' if result['fp8_goal_met'] else 'missed'}); window {window} {times[f'window_{window}']:.4f} ms "
          f"(goal <= 0.05: {'met' if result['window_goal_met'] else 'missed'})")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="131072,1048576")
    parser.add_argument("--json", default=None, help=f"default {RESULTS}/triton_decode_sweep.json "
                        "(triton_fp8_sweep.json with --fp8-sweep)")
    parser.add_argument("--goals-only", action="store_true", help="only issue 22's goals at the longest context")
    parser.add_argument("--fp8-sweep", action="store_true", help="the fp8 cache's configuration (CONFIG_OVERRIDES)")
    parser.add_argument("--seconds", type=float, default=100.0, help="--fp8-sweep's wall-time budget")
    parser.add_argument("--smoke", action="store_true",
                        help="--fp8-sweep at tiny shapes, each stage's first candidate (CPU, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    from cpattn.attention.backends import triton_decode as tk

    dev = DEVICE
    if args.fp8_sweep or args.smoke:
        cases = (("b1_1m", 1, 1024), ("b64_32k", 4, 128)) if args.smoke else FP8_CASES
        result = fp8_sweep(tk, dev, 30.0 if args.smoke else args.seconds, cases, first_only=args.smoke)
        _write(args.json or RESULTS / "triton_fp8_sweep.json", result)
        return 0
    base_cfg = dict(tk.DECODE_CONFIG)
    rows = []
    contexts = [int(c) for c in args.contexts.split(",")]
    for n in [] if args.goals_only else contexts:
        for fp8 in (False, True) if n == max(contexts) else (False,):
            q, cache, table, scales = _cache(n, fp8, dev)
            out = torch.empty(1, HQ, D, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(1, HQ, dtype=torch.float32, device=dev)
            tk.DECODE_CONFIG.update(base_cfg)
            splits0 = tk.decode_num_splits(1, HK, n, dev)
            _run(tk, q, cache, table, scales, n, splits0, out, lse)
            ref = out.float().clone()
            grid = itertools.product((64, 128, 256), (4, 8), (3, 4), (2, 4))
            for block_n, warps, stages, waves in grid:
                cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages, waves=waves)
                tk.DECODE_CONFIG.update(cfg)
                splits = tk.decode_num_splits(1, HK, n, dev, block_n=block_n)
                row = dict(context=n, kv="fp8_e4m3" if fp8 else "bf16", splits=splits, **cfg)
                try:
                    ms = time_graph(lambda: _run(tk, q, cache, table, scales, n, splits, out, lse))
                    err = float((out.float() - ref).norm() / ref.norm())
                    row.update(ms=ms, rel_vs_default=err)
                except Exception as exc:   # a tiling that does not fit shared memory: recorded, not fatal
                    row.update(error=f"{type(exc).__name__}: {str(exc)[:120]}")
                rows.append(row)
            tk.DECODE_CONFIG.update(base_cfg)
            ok = sorted((r for r in rows if r["context"] == n and r["kv"] == ("fp8_e4m3" if fp8 else "bf16")
                         and "ms" in r and r["rel_vs_default"] < 2e-2), key=lambda r: r["ms"])
            default = next(r for r in ok if r["waves"] == base_cfg["waves"]) if ok else None
            print(f"context {n} {'fp8_e4m3' if fp8 else 'bf16'}: {len(ok)} valid tilings; best 5:")
            for r in ok[:5]:
                print("   ", {k: r[k] for k in ("ms", "block_n", "num_warps", "num_stages", "waves", "splits")})
            if default:
                print("    (first at default waves)", {k: default[k] for k in ("ms", "block_n", "num_warps", "num_stages")})
    tk.DECODE_CONFIG.update(base_cfg)
    goal = goals(tk, max(contexts), dev)
    _write(args.json or RESULTS / "triton_decode_sweep.json", dict(rows=rows, goals=goal))
    return 0


def _write(path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=device_name(),
                                    torch=torch.__version__, **result), indent=1, default=str))
    print("wrote", path)


FP8_CASES = (("b1_1m", 1, 1 << 20), ("b64_32k", 64, 32768))
"""(name, requests, keys each): issue 22's goal case and a batched one (no regression there)."""
HEADS_CANDIDATES = ((4, 64, 4, 1, True), (8, 32, 8, 1, True), (4, 128, 4, 1, True), (8, 64, 8, 1, True),
                    (4, 32, 4, 1, True), (2, 64, 2, 1, True), (4, 64, 4, 2, True), (8, 16, 8, 4, True))
"""triton_decode_heads.py's kernel: (kv heads per program, keys per tile, warps, stages, f16 dots). One warp per head
(warps = H): a whole 16-key page of all 8 heads (16 KB fp8) or two per tile; or 4 heads, 2-4 pages a tile, two
programs per SM; f16 dots (one cvt per two fp8 values; bf16 needs three: >= 0.75 ms of conversions at 1M). On
2026-12-01 (nvidia-h200) one stage beat two to four at every tiling where both ran (4 heads, 64 keys: 0.856 vs 0.921 ms
at 1M; adopted) and bf16 dots lost everywhere (1.48x bf16): the candidates are now one-stage shapes around it."""
MMA_CANDIDATES = ((64, 4, 1), (32, 4, 3))
"""triton_decode_fp8_mma.py's kernel (fp8 e4m3 tensor-core q.K dots, M = 64 rows): (keys per tile, warps, stages). On
2026-12-02 (nvidia-h200, triton 3.6) its best, 64 keys / 4 warps / 1 stage, took 1.33 ms at 1M (1.29x bf16; the heads
kernel 0.855) and 8 warps or more stages were slower (benchmarks/RESULTS.md, session 12): two candidates stay, so that a
later Triton's change shows."""
MMA_TILINGS = ((64, 8, 2), (32, 8, 2), (128, 8, 3), (32, 4, 2), (64, 4, 2))
ONE_HEAD_TILINGS = ((128, 4, 2), (128, 8, 2), (256, 8, 2), (256, 8, 3), (128, 4, 3), (256, 4, 2), (64, 4, 3),
                    (128, 8, 3), (64, 2, 2))
HEADS_TILINGS = ((128, 4, 1), (32, 4, 1), (64, 8, 1), (128, 8, 1), (64, 2, 1), (32, 4, 2), (16, 8, 3))
"""(keys per tile, warps, stages) around the best variant: triton_decode's kernel, or the heads kernel's."""


def fp8_sweep(tk, dev, seconds: float, fp8_cases=FP8_CASES, first_only: bool = False) -> dict:
    """Staged search of CONFIG_OVERRIDES["fp8"]: variants at today's tiling, the heads kernel's candidates, then tilings
    with the best variant, then split factors, each candidate timed at 1M and checked against float64; then today's
    and the four fastest at B=64 too (the last ~20 s of the budget). The winner: fastest at 1M among valid finalists
    no more than 5% slower than today's fp8 configuration at B=64. ``first_only`` (--smoke): each stage's first
    candidate, whatever the budget."""
    budget = Budget(seconds)
    base = tk.decode_config()
    cases = {}
    saved = dict(tk.CONFIG_OVERRIDES)
    for name, batch, keys in fp8_cases:
        d = fp8_decode_call(batch, keys, dev)   # splits: the builder's plan (it does not know the cache dtype)
        case, out, ref, splits, call = d.case, d.out, d.ref, d.splits, d.call

        tk.CONFIG_OVERRIDES["fp8"] = {}
        bf16_ms = time_graph(functools.partial(call, case.cache, None))
        cases[name] = dict(call=call, case=case, out=out, ref=ref, bf16_ms=bf16_ms, bf16_rel=rel(out, ref))
        print(f"{name}: bf16 {bf16_ms:.3f} ms (rel {cases[name]['bf16_rel']:.1e}), splits {splits} "
              f"[{budget.elapsed():.0f} s]", flush=True)

    def measure(cfg: dict, names=("b1_1m",)) -> dict:
        tk.CONFIG_OVERRIDES["fp8"] = {k: v for k, v in cfg.items() if base.get(k) != v}
        row = {}
        for name in names:
            c = cases[name]
            ms = time_graph(functools.partial(c["call"], c["case"].fp8, c["case"].scales))
            row.update({f"{name}_ms": ms, f"{name}_rel": rel(c["out"], c["ref"]),
                        f"{name}_over_bf16": ms / c["bf16_ms"]})
        row["valid"] = all(row[f"{n}_rel"] < FP8_BOUND for n in names)
        return row

    rows, seen = [], set()
    from cpattn.attention.backends.triton_decode_heads import _paged_decode_heads_kernel
    from cpattn.attention.backends.triton_decode_fp8_mma import _paged_decode_fp8_mma_kernel
    jits = (tk._paged_decode_kernel, _paged_decode_heads_kernel, _paged_decode_fp8_mma_kernel)
    for jit in jits:
        new_kernel_stats(jit, seen)

    def stage(configs):   # screened at 1M only (one compile, one timing each); B=64 for the finalists
        for cfg in configs[:1] if first_only else configs:
            over = rows and budget.left() < 20 and not first_only   # today's always runs
            if over or any(r["cfg"] == cfg for r in rows):
                continue
            stats = [st for jit in jits for st in new_kernel_stats(jit, seen)]
            rows.append(dict(try_candidate(measure, cfg), kernels=stats))
            print("   ", _fp8_row_text(rows[-1]), rows[-1]["kernels"], f"[{budget.elapsed():.0f} s]", flush=True)

    def best(finalists: bool = False) -> dict:
        ok = [r for r in rows if r.get("valid") and (not finalists or "b64_32k_ms" in r)]
        if finalists:   # no more than 5% slower than today's fp8 configuration at B=64
            today = next((r for r in ok if r["cfg"] == base), None)
            limit = 1.05 * today["b64_32k_ms"] if today else float("inf")
            ok = [r for r in ok if r["b64_32k_ms"] <= limit]
        return min(ok, key=lambda r: r["b1_1m_ms"]) if ok else dict(cfg=base)

    # f16-dot variants first: fp8 -> bf16 costs three cvt per two values (>= 0.75 ms at 1M: triton_decode_heads.py),
    # so the bf16-dot ones, least likely to meet the goal, come after the heads kernel's when the budget runs short
    variants = [dict(base, page_tiles=p, fp8_v_scaled=v, fp8_f16_dot=h)
                for h, p, v in itertools.product((True, False), repeat=3)]
    stage([base] + [c for c in variants if c["fp8_f16_dot"]][:2])
    stage([dict(base, fp8_mma=True, block_n=n, num_warps=w, num_stages=st) for n, w, st in MMA_CANDIDATES])
    stage([c for c in variants if c["fp8_f16_dot"]][2:])
    stage([dict(base, heads_per_program=h, block_n=n, num_warps=w, num_stages=st, fp8_f16_dot=f16)
           for h, n, w, st, f16 in HEADS_CANDIDATES])
    stage([c for c in variants if not c["fp8_f16_dot"]])
    stage([dict(best()["cfg"], prefetch=True)] if not best()["cfg"]["heads_per_program"] else [])
    flags = {k: best()["cfg"].get(k, False)
             for k in ("page_tiles", "prefetch", "fp8_f16_dot", "fp8_v_scaled", "heads_per_program", "fp8_mma")}
    tilings = (MMA_TILINGS if flags["fp8_mma"] else HEADS_TILINGS if flags["heads_per_program"] else ONE_HEAD_TILINGS)
    stage([dict(base, **flags, block_n=n, num_warps=w, num_stages=st) for n, w, st in tilings])
    top = best()["cfg"]
    stage([dict(top, split_factor=f) for f in (2, 0.5, 4)] + [dict(top, num_stages=1)])
    screened = sorted((r for r in rows if r.get("valid")), key=lambda r: r["b1_1m_ms"])
    for row in [r for r in rows if r["cfg"] == base] + screened[:4]:   # today's and the 1M leaders at B=64
        if "b64_32k_ms" not in row and "error" not in row:
            try:
                row.update(measure(row["cfg"], names=tuple(cases)))
            except Exception as exc:   # noqa: BLE001 - a finalist that fails at B=64 is out, not the sweep
                row.update(valid=False, error=f"B=64: {type(exc).__name__}: {str(exc)[:160]}")
            print("    B=64:", _fp8_row_text(row), f"[{budget.elapsed():.0f} s]", flush=True)
    tk.CONFIG_OVERRIDES.clear()
    tk.CONFIG_OVERRIDES.update(saved)
    win = best(finalists=True)
    line = config_line("fp8", win["cfg"], base)
    print(f"fp8 winner ({len(rows)} candidates in {budget.elapsed():.0f} s): {_fp8_row_text(win)}")
    if "b1_1m_over_bf16" in win:
        print(f"issue 22 (fp8 <= 0.6x bf16 at 1M): {win['b1_1m_over_bf16']:.2f}x "
              f"({'met' if win['b1_1m_over_bf16'] <= 0.6 else 'missed'}); B=64 32K {win['b64_32k_over_bf16']:.2f}x")
    print("adopt: in cpattn/attention/backends/triton_decode.py CONFIG_OVERRIDES, replace the \"fp8\" line with")
    print(line)
    return dict(cases={n: dict(bf16_ms=c["bf16_ms"], bf16_rel=c["bf16_rel"]) for n, c in cases.items()},
                base=base, rows=rows, winner=win, adopt_line=line)


def _fp8_row_text(row: dict) -> str:
    cfg = {k: row["cfg"].get(k) for k in ("block_n", "num_warps", "num_stages", "page_tiles", "prefetch", "fp8_f16_dot",
                                          "fp8_v_scaled", "split_factor", "heads_per_program", "fp8_mma")}
    if "error" in row:
        return f"{cfg} error {row['error']}"
    if "b1_1m_ms" not in row:
        return f"{cfg} (no valid candidate)"
    b64 = (f" B64 {row['b64_32k_ms']:.3f} ms ({row['b64_32k_over_bf16']:.2f}x, rel {row['b64_32k_rel']:.1e})"
           if "b64_32k_ms" in row else "")
    return (f"{cfg} 1M {row['b1_1m_ms']:.3f} ms ({row['b1_1m_over_bf16']:.2f}x bf16, rel {row['b1_1m_rel']:.1e})"
            f"{b64}{'' if row.get('valid') else ' INVALID'}")


if __name__ == "__main__":
    raise SystemExit(main())
