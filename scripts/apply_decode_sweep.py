"""Print the fastest valid fp8 tiling of a triton_decode_sweep.py JSON and, with --write, set it as the
default DECODE_CONFIG_FP8 in cpattn/attention/backends/triton_kernels.py (a developer's tool: review the diff)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "cpattn/attention/backends/triton_kernels.py"


def best(rows: list[dict], kv: str, context: int, waves: int | None = None) -> dict | None:
    ok = [r for r in rows if r["kv"] == kv and r["context"] == context and "ms" in r and r["rel_vs_default"] < 2e-2
          and waves in (None, r["waves"])]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = json.loads(Path(args.json).read_text())["rows"]
    context = max(r["context"] for r in rows)
    # waves (splits per SM) is shared by both dtypes: the written fp8 tiling keeps the default's (2)
    bf16, fp8 = best(rows, "bf16", context, 2), best(rows, "fp8_e4m3", context, 2)
    print(f"context {context}: best bf16 {bf16}\n  best fp8 {fp8}")
    if fp8 and bf16:
        print(f"  fp8 / bf16 = {fp8['ms'] / bf16['ms']:.2f}")
    if args.write and fp8:
        cfg = {k: fp8[k] for k in ("keys_a", "block_n", "num_warps", "num_stages")}
        text = KERNELS.read_text()
        text, n = re.subn(r"^DECODE_CONFIG_FP8 = dict\(.*\)$", "DECODE_CONFIG_FP8 = dict(" +
                          ", ".join(f"{k}={v!r}" for k, v in cfg.items()) + ")", text, flags=re.M)
        assert n == 1, "DECODE_CONFIG_FP8 line not found"
        KERNELS.write_text(text)
        print("wrote", cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
