"""Merge the per-row JSON files of scripts/job_gpu.sh into one JSON and a markdown table for benchmarks/RESULTS.md.

    python3 examples/job_rows.py ROWS_DIR OUT.json ROW [ROW ...]      # writes OUT.json and OUT.md, prints the table

An OUT.json already there keeps its other rows (two job_gpu.sh calls in one device command share one $OUT: on
2026-12-02 the second call's table replaced the first's row); a ROW named again is this call's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| row | attention | GPUs | KV | context | prefilled | prefill s | prefill tok/s | decode ms/token median "
          "(mean) | KV per shard GiB | layer-0 vs float64 | status |")


def markdown_row(name: str, r: dict) -> str:
    if "prefill_tokens_per_s" not in r:
        what = r.get("oom") or r.get("error") or (f"check ok={r['ok']}" if "ok" in r else "") or f"rc={r.get('rc', '')}"
        return f"| {name} |  |  |  |  |  |  |  |  |  |  | {r.get('status', '?')}: {what} |"
    service = r.get("service", {})
    gpus = service.get("num_shards", 1) if r.get("attn") == "cpattn" else 1
    kv = service.get("kv_cache_dtype", r["model"]["dtype"])
    oracle = f"{r['oracle']['rel_err']:.1e}" if "oracle" in r else ""
    prefilled = f"{r['prefill_tokens']:,}" + (" (+random KV)" if r.get("synthetic_prefix") else "")
    attn = r["attn"]
    if r.get("decode_backend"):   # cpattn rows: the backend of decode steps, and of prefill chunks where another
        prefill = r.get("prefill_backend")
        attn += f" {r['decode_backend']}" + (f", prefill {prefill}" if prefill and prefill != r["decode_backend"] else "")
    return (f"| {name} | {attn} | {gpus} | {kv} | {r['context_tokens']:,} | {prefilled} | {r['prefill_s']:.1f} | "
            f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_ms_per_token_median']:.2f} "
            f"({r['decode_ms_per_token_mean']:.2f}) | {r['kv_gib_per_shard']:.1f} | {oracle} | {r['status']} |")


def main(argv: list[str]) -> int:
    rows_dir, out, names = Path(argv[0]), Path(argv[1]), argv[2:]
    rows = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        f = rows_dir / f"{name}.json"
        rows[name] = json.loads(f.read_text()) if f.exists() else {"status": "not run"}
    out.write_text(json.dumps(rows, indent=1))
    table = "\n".join([HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
                      + [markdown_row(n, r) for n, r in rows.items()])
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"rows: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
