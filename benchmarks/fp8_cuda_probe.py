"""cuda_decode_fp8.py's kernel on one GPU against the bf16 kernel and today's fp8 configuration (issue 22: fp8 decode
at 1M keys <= 0.6x the bf16 kernel's time): B=1 over 4,096 keys (a wrong result shows without a long sum) and over
``--keys``, and B=64 over 32K: each candidate configuration's time (CUDA graph replay)
and error against float64, NaNs counted.
Prints a table; writes JSON.
    python benchmarks/fp8_cuda_probe.py [--keys 1048576] [--json PATH]      # one H200, ~1 min
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sweep_common import D, DEVICE, HK, HQ, fp8_decode_call, rel, time_graph  # noqa: E402

# The adopted configuration first (triton_decode.CONFIG_OVERRIDES["fp8"]), then the candidates around it: session 14's
# (V's smem slots lane-major, the plan's splits), each of the two changes alone, more splits, stages, occupancy
CANDIDATES = [dict(), dict(cuda_v_swizzle=False, fill_splits=False), dict(fill_splits=False), dict(cuda_v_swizzle=False),
              dict(split_factor=2),
              dict(cuda_stages=3), dict(cuda_min_blocks=3),
              dict(cuda_min_blocks=3, cuda_stages=3), dict(cuda_heads_per_block=True),
              dict(cuda_heads_per_block=True, split_factor=0.5), dict(cuda_heads_per_block=True, cuda_min_blocks=3)]


def probe(batch: int, keys: int, candidates: list[dict]) -> list[dict]:
    from cpattn.attention.backends import triton_decode as tk
    d = fp8_decode_call(batch, keys, DEVICE)
    case, out, ref, splits, call = d.case, d.out, d.ref, d.splits, d.call

    saved = dict(tk.CONFIG_OVERRIDES)
    rows = []
    try:
        tk.CONFIG_OVERRIDES["fp8"] = {}
        bf16 = time_graph(functools.partial(call, case.cache, None))
        tk.CONFIG_OVERRIDES.update(saved)
        today = time_graph(functools.partial(call, case.fp8, case.scales))
        today_rel = rel(out, ref)
        rows.append(dict(batch=batch, keys=keys, cfg="bf16", ms=bf16, over_bf16=1.0))
        rows.append(dict(batch=batch, keys=keys, cfg="today's fp8", ms=today, over_bf16=today / bf16, rel=today_rel))
        for cand in candidates:
            name = "cuda " + (" ".join(f"{k.removeprefix('cuda_')}={v}" for k, v in cand.items()) or "adopted")
            tk.CONFIG_OVERRIDES["fp8"] = dict(saved["fp8"], fp8_cuda=True, **cand)
            try:
                out.fill_(float("nan"))
                call(case.fp8, case.scales)
                torch.cuda.synchronize()
                nans, err = int(out.isnan().sum()), rel(out, ref)
                ms = time_graph(functools.partial(call, case.fp8, case.scales))
                per_block = 4 if cand.get("cuda_heads_per_block") else 1
                launched = tk.launch_splits(splits * per_block, tk.decode_config(fp8=True), batch * HK // per_block,
                                            DEVICE)
                rows.append(dict(batch=batch, keys=keys, cfg=name, splits=launched,
                                 ms=ms, over_bf16=ms / bf16, rel=err, nans=nans))
            except Exception as exc:   # noqa: BLE001 - a diagnostic: the row says what failed
                rows.append(dict(batch=batch, keys=keys, cfg=name, error=f"{type(exc).__name__}: {exc}"[:600]))
    finally:
        tk.CONFIG_OVERRIDES.clear()
        tk.CONFIG_OVERRIDES.update(saved)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1 << 20)
    parser.add_argument("--json", default="fp8_cuda_probe.json")
    parser.add_argument("--first", type=int, default=len(CANDIDATES), help="only the first N candidates")
    args = parser.parse_args()
    if DEVICE.type != "cuda":
        print("fp8_cuda_probe needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for batch, keys in ((1, 4096), (1, args.keys), (64, 32768)):
        got = probe(batch, keys, CANDIDATES[:args.first])
        rows += got
        print(f"B={batch} keys={keys}")
        for r in got:
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k not in ("batch", "keys")}, flush=True)
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), hq=HQ, hk=HK, d=D)
    Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
