"""Plot decode latency vs context length per backend from attention_bench JSON files (run locally:
the GPU machine has no matplotlib). Usage: python benchmarks/plot_attention.py OUT.png RUN.json..."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, paths = sys.argv[1], sys.argv[2:]
    points: dict[str, dict[int, float]] = {}
    dcp: dict[str, tuple[int, float]] = {}
    for path in paths:              # later files override earlier ones for the same backend
        data = json.load(open(path))
        fresh: dict[str, dict[int, float]] = {}
        for row in data.get("sweep", []) + data.get("decode", []):
            if "ms" in row and row.get("B") == 1:
                fresh.setdefault(row["backend"], {})[row["L"]] = row["ms"]
        points.update(fresh)
        for row in data.get("dcp", []):
            if "ms" in row:
                dcp[row["backend"]] = (row["L"], row["ms"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, series in sorted(points.items()):
        xs = sorted(series)
        ax.plot(xs, [series[x] for x in xs], marker="o", label=f"{name} (one call)")
    for name, (length, ms) in sorted(dcp.items()):
        ax.scatter([length], [ms], marker="*", s=120, label=f"{name} DCP N=4, one GPU")
    xs = sorted({x for s in points.values() for x in s})
    ax.plot(xs, [x * 2 * 8 * 128 * 2 / 4250e9 * 1e3 for x in xs], "k--", lw=1, label="HBM floor (4250 GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens), B=1")
    ax.set_ylabel("decode latency per layer (ms)")
    ax.set_title("Paged decode on H200, Hq32/Hk8/D128 bf16, page 16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
