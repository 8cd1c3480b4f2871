"""A diagnostic of triton_decode_fp8_mma.py's kernel on one GPU: each tiling at B=1 over ``--keys`` keys (and at 4,096
keys, where a wrong result shows without a long sum), its time against the bf16 kernel's and today's fp8 configuration's
and its error against float64, NaN counts included. Prints a table; writes JSON. (Its 2026-12-02 run, with an e4m3 PV
dot beside the float16 one: benchmarks/RESULTS.md, session 12.)
    python benchmarks/fp8_mma_probe.py [--keys 1048576] [--json PATH]
    TRITON_INTERPRET=1 python benchmarks/fp8_mma_probe.py --smoke   # the first tiling at 256 and 512 keys, on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sweep_common import (ACT, D, DEVICE, HK, HQ, float64_attention, paged_case, rel,  # noqa: E402
                                 time_graph, with_fp8)

CANDIDATES = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in ((64, 8, 1), (64, 4, 1), (32, 4, 3), (64, 8, 3),
                                                                         (128, 8, 2), (32, 8, 3))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1 << 20)
    parser.add_argument("--json", default="fp8_mma_probe.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one tiling (CPU, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    from cpattn.attention.backends import triton_decode as tk
    dev = DEVICE
    rows = []
    candidates = CANDIDATES[:1] if args.smoke else CANDIDATES
    for keys in (256, 512) if args.smoke else (4096, args.keys):
        case = with_fp8(paged_case(1, keys, dev))
        q = torch.randn(1, HQ, D, device=dev).to(ACT)
        ref = float64_attention(q, case)
        idx = torch.zeros(1, dtype=torch.int32, device=dev)
        lens = torch.full((1,), keys, dtype=torch.int32, device=dev)
        out = torch.empty(1, HQ, D, dtype=ACT, device=dev)
        lse = torch.empty(1, HQ, dtype=torch.float32, device=dev)
        splits = tk.decode_num_splits(1, HK, keys, dev)

        def call(cache, scales):
            tk.paged_decode(q, cache[0], cache[1], case.table, idx, idx, lens, splits, D ** -0.5, out, lse,
                            all_rows=True, kv_scale=scales)

        saved = dict(tk.CONFIG_OVERRIDES)
        tk.CONFIG_OVERRIDES["fp8"] = {}
        bf16 = time_graph(functools.partial(call, case.cache, None))
        tk.CONFIG_OVERRIDES.update(saved)
        today = time_graph(functools.partial(call, case.fp8, case.scales))
        rows.append(dict(keys=keys, cfg="today's fp8", ms=today, over_bf16=today / bf16, rel=rel(out, ref)))
        for cand in candidates:
            tk.CONFIG_OVERRIDES["fp8"] = dict(cand, fp8_mma=True)
            try:
                out.fill_(float("nan"))
                call(case.fp8, case.scales)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                nans = int(out.isnan().sum())
                err = rel(out, ref)
                ms = time_graph(functools.partial(call, case.fp8, case.scales))
                rows.append(dict(keys=keys, cfg=cand, ms=ms, over_bf16=ms / bf16, rel=err, nans=nans))
            except Exception as exc:   # noqa: BLE001 - a diagnostic: the row says what failed
                rows.append(dict(keys=keys, cfg=cand, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            finally:
                tk.CONFIG_OVERRIDES.clear()
                tk.CONFIG_OVERRIDES.update(saved)
        print(f"{keys} keys: bf16 {bf16:.3f} ms")
        for r in rows:
            if r["keys"] == keys:
                print("  ", {k: v for k, v in r.items() if k != "keys"}, flush=True)
    Path(args.json).write_text(json.dumps(dict(rows=rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
