"""Plot decode ms/layer vs context (B=1) from cp_scaling JSON: the 1-GPU kernel call, the service on 1 GPU and
on 2 GPUs (run locally: the GPU machine has no matplotlib). Usage: python benchmarks/plot_cp_scaling.py OUT.png RUN.json"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, path = sys.argv[1], sys.argv[2]
    rows = [r for r in json.load(open(path))["rows"] if r["batch"] == 1 and r["new"] == 1]
    series: dict[str, dict[int, float]] = {}
    for r in rows:
        series.setdefault("one kernel call, 1 GPU", {})[r["context"]] = r["kernel_ms"]
        series.setdefault(f"service, {r['gpus']} GPU(s)", {})[r["context"]] = r["ms_per_layer"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens), decode B=1")
    ax.set_ylabel("ms per layer")
    ax.set_title("cpattn decode through the service (H200, bf16, Hq32/Hk8/D128, TRITON)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
