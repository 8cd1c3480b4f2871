"""Service benchmark (CPU): per-layer decode latency through cpattn vs the single-process torch reference.

For each shard count and (batch, context): sequences are filled with seeded random KV
(Service.fill_synthetic; never zeros), then decode steps run through the service. Time per layer is
split into plan (once per step, divided by layers), data plane (attend as the client sees it: wire,
in-process shards and merge, minus the slowest remote shard's kernel time) and attention (slowest shard).
The reference is TorchAttentionImpl over one unsharded paged cache of the same shape.

    cpattn bench [--quick] [--shards 1,2,4] [--batches 1,16,64] [--contexts 4096,...] [--out DIR]
    (or python benchmarks/service_bench.py ...)
Prints a table and writes DIR/service_bench.json (default: out/ of the checkout, which git ignores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported where it runs: a usage error or --help comes back without its ~3 s import
    import torch


def reference_layer_ms(batch: int, context: int, hq: int, hk: int, d: int, block: int, repeats: int,
                       device: str, dtype: torch.dtype, backend: str) -> float:
    """One decode layer over [batch x context] tokens in a single process, single backend call."""
    import torch

    from cpattn.attention import AttentionSpec, get_attn_backend, make_causal_metadata

    cls = get_attn_backend(backend, head_size=d, dtype=dtype, block_size=block, num_q_heads=hq, num_kv_heads=hk,
                           device=device)
    spec = AttentionSpec(hq, hk, d, dtype, block, device)
    pages = -(-(context + 1) // block)
    cache = torch.randn(cls.get_kv_cache_shape(batch * pages, block, hk, d), device=device).to(dtype)
    table = torch.randperm(batch * pages).view(batch, pages)
    md = cls.get_builder_cls()(spec).build(0, make_causal_metadata([1] * batch, [context] * batch, table, block).to(device))
    impl = cls.get_impl_cls()(spec)
    q, k, v = (torch.randn(batch, h, d, device=device).to(dtype) for h in (hq, hk, hk))
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        impl.forward(0, q, k, v, cache, md)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del cache
    return 1e3 * statistics.median(times)


def bench_service(num_shards: int, cases: list[tuple[int, int]], layers: int, hq: int, hk: int, d: int, block: int,
                  repeats: int, max_tokens: int, device: str, dtype: str, backend: str) -> list[dict]:
    import torch

    import cpattn

    blocks = max(64, -(-max_tokens // num_shards // block) + 4 * max(b for b, _ in cases))
    gpu = {"device": "cuda", "num_gpus_per_shard": 1.0 / num_shards, "num_cpus_per_shard": 1} if device == "cuda" else {}
    cfg = cpattn.ServiceConfig(num_shards=num_shards, num_layers=layers, num_q_heads=hq, num_kv_heads=hk,
                               head_size=d, block_size=block, dtype=dtype, num_blocks_per_shard=blocks, backend=backend,
                               name=f"cpattn-bench-{num_shards}", rpc_timeout_s=600, collective_timeout_s=600, **gpu)
    tdtype = cfg.torch_dtype
    svc = cpattn.start(cfg)
    rows = []
    try:
        for batch, context in cases:
            seqs = [svc.add_sequence() for _ in range(batch)]
            for i, s in enumerate(seqs):
                svc.fill_synthetic(s, context, seed=i)
            samples = []
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                with svc.step({s: 1 for s in seqs}) as step:
                    for layer in range(layers):
                        step.attend(layer, *(torch.randn(batch, h, d, device=device).to(tdtype) for h in (hq, hk, hk)))
                wall = time.perf_counter() - t0
                if rep:   # the first step warms up
                    step.timings["wall_s"] = wall     # attention_s joins when the commit is read
                    samples.append(step.timings)
            for s in seqs:
                svc.free(s)
            med = {k: statistics.median(x[k] for x in samples) for k, v in samples[0].items()
                   if isinstance(v, (int, float))}   # begin_parts: a dict of phases (benchmarks/profile_begin.py)
            per_layer = {k: 1e3 * v / layers for k, v in med.items()}
            wire = max(0.0, per_layer["data_plane_s"] - per_layer["attention_s"])
            total = per_layer["wall_s"]
            rows.append({"shards": num_shards, "batch": batch, "context": context, "layers": layers,
                         "device": device, "dtype": dtype, "backend": svc.info()["shards"][0]["backend"],
                         "plan_ms_per_step": 1e3 * med["plan_s"], "plan_ms": per_layer["plan_s"],
                         "data_plane_ms": wire, "attention_ms": per_layer["attention_s"],
                         "total_ms": total,
                         "overhead_pct": 100.0 * (total - per_layer["attention_s"]) / total})
            print(_fmt(rows[-1]), flush=True)
    finally:
        svc.shutdown()
    return rows


HEADER = (f"{'shards':>6} {'batch':>5} {'context':>8} {'plan/step':>9} {'plan':>6} {'wire':>7} {'attn':>7} "
          f"{'total':>7} {'ovh%':>5}")
REF_HEADER = f"{'shards':>6} {'batch':>5} {'context':>8} {'total':>7} {'ref':>7} {'total/ref':>9}"
# The default grid as measured on a 2-core CPU machine (issue 25); --quick is measured in tests/test_bench_cli.py.
DEFAULT_COST = "about 9 minutes and 17 GB of memory on a 2-core CPU machine"
QUICK = {"shards": "1,2", "batches": "1,4", "contexts": "2048", "layers": 2, "repeats": 2}


def _fmt(r: dict) -> str:
    return (f"{r['shards']:>6} {r['batch']:>5} {r['context']:>8} {r['plan_ms_per_step']:>9.2f} {r['plan_ms']:>6.2f} "
            f"{r['data_plane_ms']:>7.2f} {r['attention_ms']:>7.2f} {r['total_ms']:>7.2f} {r['overhead_pct']:>5.1f}")


def _fmt_ref(r: dict) -> str:
    return (f"{r['shards']:>6} {r['batch']:>5} {r['context']:>8} {r['total_ms']:>7.2f} {r['reference_ms']:>7.2f} "
            f"{r['total_ms'] / r['reference_ms']:>9.2f}")


def build_parser(prog: str | None = None):
    from cpattn.launch.common import Parser

    parser = Parser(prog=prog, description=__doc__.splitlines()[0],
                    epilog=f"The default grid takes {DEFAULT_COST}; --quick takes under a minute.")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid in under a minute: --shards 1,2 --batches 1,4 --contexts 2048 --layers 2 "
                             "--repeats 2 (options given as well still apply)")
    parser.add_argument("--shards", default=None, help="shard counts to run, comma-separated (default: 1,2,4)")
    parser.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default: 1,16,64)")
    parser.add_argument("--contexts", default=None,
                        help="context lengths in tokens, comma-separated (default: 4096,16384,32768,65536)")
    parser.add_argument("--layers", type=int, default=None, help="attention layers per step (default: 4)")
    parser.add_argument("--heads", default="8,2,128", help="query heads, KV heads, head size: Hq,Hk,D (default: 8,2,128)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per case, after one warm-up (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=1 << 20, help="skip cases with batch*context above this")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: shards share one GPU (gloo data plane), q/k/v live on the GPU")
    parser.add_argument("--dtype", default=None, help="default float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--backend", default="auto", help="attention backend of the shards (default: auto)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="directory for service_bench.json (default: out/ of the checkout, which git ignores)")
    return parser


def _ints(text: str, flag: str, count: int | None = None) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1 or (count is not None and len(values) != count):
        what = f"{count} positive ints" if count else "positive ints"
        raise ValueError(f"--{flag} {text!r} must be {what}, comma-separated")
    return values


def _checked_grid(parser, args, dtype: str):
    """Every argument before Ray starts (a bad one was a traceback, some after a whole run): one line each."""
    import cpattn

    try:
        heads = _ints(args.heads, "heads", 3)
        grid = [_ints(getattr(args, f), f) for f in ("shards", "batches", "contexts")]
        for flag in ("layers", "repeats"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag} {getattr(args, flag)} must be >= 1")
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out!r} is a file: name a directory (service_bench.json goes in it)")
        cpattn.ServiceConfig(num_shards=max(grid[0]), num_layers=args.layers, num_q_heads=heads[0],
                             num_kv_heads=heads[1], head_size=heads[2], dtype=dtype)
    except (ValueError, cpattn.CpattnError) as exc:   # (ConfigError is a ValueError too)
        parser.error(str(exc))
    return (heads, *grid)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    import torch

    defaults = {"shards": "1,2,4", "batches": "1,16,64", "contexts": "4096,16384,32768,65536", "layers": 4, "repeats": 3}
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    (hq, hk, d), shard_counts, batches, contexts = _checked_grid(parser, args, dtype)
    block = 16
    cases = [(b, c) for b in batches for c in contexts if b * c <= args.max_tokens]
    print(f"cpattn service bench: Hq {hq} Hk {hk} D {d} {dtype} on {args.device}, backend {args.backend}, "
          f"{args.layers} layers, per-layer ms (medians)")
    print(HEADER)
    import ray

    meta = {"date": date.today().isoformat(), "machine": platform.node(), "cpus": __import__("os").cpu_count(),
            "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "torch": torch.__version__, "ray": ray.__version__, "python": platform.python_version(),
            "heads": [hq, hk, d], "dtype": dtype, "layers": args.layers}
    out = Path(args.out) if args.out else Path(__file__).resolve().parents[1] / "out"
    out.mkdir(parents=True, exist_ok=True)
    out = out / "service_bench.json"
    rows = []
    # One Ray for the whole run, started as cpattn.start would (an embedded local instance): each shard count's
    # service then costs only its own actors, not a Ray start and shutdown each (cp_scaling.py does the same).
    from cpattn.cluster.service import ensure_ray

    ensure_ray(None, "cpattn", num_cpus_hint=max(shard_counts) * 1.0)   # every service here: 1 CPU a shard
    for n in shard_counts:
        rows += bench_service(n, cases, args.layers, hq, hk, d, block, args.repeats, args.max_tokens, args.device,
                              dtype, args.backend)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))   # keep what ran if a later size fails
    backend = rows[0]["backend"] if rows else "TORCH"
    refs = {(b, c): reference_layer_ms(b, c, hq, hk, d, block, args.repeats, args.device, getattr(torch, dtype), backend)
            for b, c in cases}
    print(f"\nagainst one single-process {backend} call per layer on the same shapes (ref, ms per layer):")
    print(REF_HEADER)
    for r in rows:
        r["reference_ms"] = refs[(r["batch"], r["context"])]
        print(_fmt_ref(r))
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
