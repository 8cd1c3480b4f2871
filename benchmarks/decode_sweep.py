"""Launch configurations of the TRITON paged split-KV decode kernel on this GPU (waves of programs per SM,
tile length, warps, pipeline stages), timed over decode shapes; prints a table and writes JSON. The best
configuration goes into triton_decode.DECODE_CONFIG.

    python benchmarks/decode_sweep.py [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

HQ, HK, D, PS = 32, 8, 128, 16
SHAPES = {"b1_128k": (1, 131072), "b1_1m": (1, 1048576), "b64_32k": (64, 32768), "b1_32k": (1, 32768)}


def time_decode(tk, batch: int, length: int, reps: int = 20) -> float:
    pages = -(-length // PS)
    kc = torch.randn(batch * pages, PS, HK, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(batch * pages, device="cuda").view(batch, pages)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, HQ, device="cuda", dtype=torch.float32)
    splits = tk.decode_num_splits(batch, HK, length, torch.device("cuda"))
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        tk.paged_decode(q, kc, vc, table, idx, idx, lens, splits, D ** -0.5, out, lse, all_rows=True)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="decode_sweep.json")
    args = ap.parse_args()
    from cpattn.attention.backends import triton_decode as tk

    base = dict(tk.DECODE_CONFIG)
    rows = []
    grid = itertools.product([2, 4, 8, 16], [32, 64, 128], [4, 8], [2, 3, 4])
    for waves, block_n, warps, stages in grid:
        tk.DECODE_CONFIG.update(waves=waves, block_n=block_n, num_warps=warps, num_stages=stages)
        row = dict(waves=waves, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            for name, (b, l) in SHAPES.items():
                ms = time_decode(tk, b, l)
                row[name] = ms
                row[name + "_tbs"] = b * l * HK * D * 2 * 2 / ms / 1e9
        except Exception as exc:   # a configuration that does not fit shared memory
            row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    tk.DECODE_CONFIG.update(base)
    ok = [r for r in rows if "error" not in r]
    for name in SHAPES:
        best = min(ok, key=lambda r: r[name])
        print(f"best {name}: {best[name]:.4f} ms ({best[name + '_tbs']:.2f} TB/s) with "
              f"waves={best['waves']} block_n={best['block_n']} warps={best['num_warps']} stages={best['num_stages']}")
    score = min(ok, key=lambda r: sum(r[n] / min(x[n] for x in ok) for n in SHAPES))
    print("best overall (sum of ratios to each shape's best):", {k: score[k] for k in
                                                                   ("waves", "block_n", "num_warps", "num_stages")})
    Path(args.json).write_text(json.dumps({"rows": rows, "best_overall": score}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
