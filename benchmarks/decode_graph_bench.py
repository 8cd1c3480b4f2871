"""Decode ms/layer: a model's forward captured in one CUDA graph (svc.decode_graph) vs the public eager API.

The same sequences and the same forward both ways, as a model would run them: per layer ``step.attend`` on
q/k/v already on the client's GPU and (``--matmul``) a [T, Hq*D] x [Hq*D, Hq*D] matmul between layers, the
o-projection's size. Eager: ``with svc.step(...)`` and ``step.attend`` per layer, wall time to the end of the
``with`` block after the GPU finished (as benchmarks/cp_scaling.py measures the service). Graph:
``graph.step()`` (the step's begin, one replay, its end), wall time after the GPU finished; the graph's warm-up
and capture steps are not timed. Service shapes and cases are cp_scaling.py's (one shard per GPU, bf16,
Hq 32 / Hk 8 / D 128, page 16, up to 32 layers where the KV fits).

    python benchmarks/decode_graph_bench.py [--gpus 1,2] [--cases decode_128k,decode_1m,decode_b64_32k] [--matmul]
    python benchmarks/decode_graph_bench.py --smoke   # tiny shapes on the CPU: the graph runs eagerly (a check)
Prints one row per (case, GPUs) and writes JSON (default benchmarks/results/decode_graph.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_scaling  # noqa: E402

DEFAULT_CASES = "decode_128k,decode_1m,decode_b64_32k"


def measure(svc, batch: int, context: int, layers: int, repeats: int, matmul: bool = False) -> dict:
    """Eager steps, then graph steps, on ``batch`` sequences of ``context`` tokens (fill_synthetic)."""
    cfg = svc.config
    device, dtype = svc.gateway.device, cfg.torch_dtype
    hq, hk, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
    q, k, v = (torch.randn(batch, h, d, device=device, dtype=dtype) for h in (hq, hk, hk))
    w = torch.randn(hq * d, hq * d, device=device, dtype=dtype) / (hq * d) ** 0.5 if matmul else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward(step):
        x = q
        for layer in range(layers):
            out = step.attend(layer, x, k, v)
            x = (out.reshape(batch, -1) @ w).view(batch, hq, d) if w is not None else q
        return out

    seqs = [svc.add_sequence() for _ in range(batch)]
    for i, s in enumerate(seqs):
        svc.fill_synthetic(s, context, seed=i)

    def timed(run_step) -> list[float]:
        walls = []
        for rep in range(repeats + 2):   # two untimed: JIT and communicators (eager); warm-up and capture (graph)
            sync()
            t0 = time.perf_counter()
            run_step()
            sync()
            if rep >= 2:
                walls.append(time.perf_counter() - t0)
        return walls

    def eager_step():
        with svc.step({s: 1 for s in seqs}) as step:
            forward(step)

    eager = timed(eager_step)
    graph = svc.decode_graph(seqs, forward, allow_eager=device.type != "cuda")
    replayed = timed(graph.step)
    counts = dict(graph.counts)
    graph.close()
    for s in seqs:
        svc.free(s)
    gw = svc.gateway
    return {"batch": batch, "context": context, "layers": layers, "matmul": matmul, "mode": graph.mode,
            "data_plane": gw.plane.backend if gw.plane else "none", "local_shards": sorted(gw.local),
            "eager_ms_per_layer": 1e3 * statistics.fmean(eager) / layers,
            "graph_ms_per_layer": 1e3 * statistics.fmean(replayed) / layers,
            "graph_ms_per_layer_median": 1e3 * statistics.median(replayed) / layers, "graph_steps": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="service sizes (one shard per GPU)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"decode cases of cp_scaling.py ({DEFAULT_CASES})")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--matmul", action="store_true", help="a [T, Hq*D] x [Hq*D, Hq*D] matmul between layers")
    parser.add_argument("--kv-budget-gb", type=float, default=96.0)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "decode_graph.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, 1 and 2 shards (eager)")
    args = parser.parse_args(argv)
    import cpattn
    from cpattn.cluster.service import ensure_ray

    if args.smoke:
        cp_scaling.use_smoke_shapes()
        cp_scaling.CASES.update(cp_scaling.SMOKE_CASES)
        args.cases, args.layers, args.repeats = "decode_smoke,decode_b4_smoke", 2, 1
    cases = [cp_scaling.CASES[c] for c in args.cases.split(",")]
    gpus_list = list(map(int, args.gpus.split(",")))
    ensure_ray(None, "cpattn", num_cpus_hint=max(gpus_list) * (1 if cp_scaling.DEVICE == "cuda" else 0.25))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'case':>16} {'gpus':>4} {'layers':>6} {'wire':>5} {'mode':>10} {'eager ms/l':>10} {'graph ms/l':>10}")
    for gpus in gpus_list:
        for p in cp_scaling.plan_services(gpus, cases, args.layers, 2 * args.repeats + 4, args.kv_budget_gb):
            svc = cpattn.start(p.config)
            try:
                for case in p.cases:
                    row = {"case": case.name, "gpus": gpus,
                           **measure(svc, case.batch, case.context, p.layers, args.repeats, args.matmul)}
                    rows.append(row)
                    print(f"{row['case']:>16} {gpus:>4} {row['layers']:>6} {row['data_plane']:>5} {row['mode']:>10} "
                          f"{row['eager_ms_per_layer']:>10.3f} {row['graph_ms_per_layer']:>10.3f}", flush=True)
                    out.write_text(json.dumps({"rows": rows}, indent=1))
            finally:
                svc.shutdown()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
