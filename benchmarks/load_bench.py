"""Bounded load test on loopback: a detached named service and several client processes.

The main process starts the service (``ServiceConfig(detached=True, name=...)``) in its embedded Ray,
then spawns client processes that attach with ``cpattn.connect(name=...)`` and run mixed prefill chunks
and decodes for a fixed duration, each sequence freed and replaced when it reaches its target length.
Reports errors (must be 0), shard memory (stats bytes, process RSS) after warm-up vs at the end,
throughput and p50/p99 step latency; prints a table and writes benchmarks/results/load_bench.json.

    .venv/bin/python benchmarks/load_bench.py --clients 3 --duration 30
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import time
from pathlib import Path


def _rss_bytes(pid: int) -> int:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    return 0


def _client(index: int, address: str, name: str, namespace: str, duration_s: float, warmup_s: float,
            seed: int, results: mp.Queue) -> None:
    """One client process: mixed prefill/decode steps until the deadline; reports latencies and errors."""
    import ray
    import torch

    import cpattn

    ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    rng = random.Random(seed)
    result = {"client": index, "errors": [], "latencies_s": [], "tokens": 0, "steps": 0, "prefill_tokens": 0,
              "decode_tokens": 0}
    try:
        svc = cpattn.connect(name=name, namespace=namespace)
        cfg = svc.config
        gen = torch.Generator().manual_seed(seed)
        live: dict[str, int] = {}      # seq_id -> target length

        def new_sequence() -> None:
            live[svc.add_sequence()] = rng.randint(64, 384)

        for _ in range(3):
            new_sequence()
        start = time.monotonic()
        while time.monotonic() - start < warmup_s + duration_s:
            lengths = svc.sequences()
            request = {}
            for sid, target in live.items():
                if lengths[sid] < 32:
                    request[sid] = min(32, target - lengths[sid])      # prefill chunk
                elif rng.random() < 0.8:
                    request[sid] = 1                                   # decode
            if not request:
                continue
            t = sum(request.values())
            t0 = time.perf_counter()
            try:
                with svc.step(request) as step:
                    for layer in range(cfg.num_layers):
                        q = torch.randn(t, cfg.num_q_heads, cfg.head_size, generator=gen).to(cfg.torch_dtype)
                        kv = torch.randn(2, t, cfg.num_kv_heads, cfg.head_size, generator=gen).to(cfg.torch_dtype)
                        out = step.attend(layer, q, kv[0], kv[1])
                        if not bool(torch.isfinite(out).all()):
                            raise AssertionError("non-finite output")
            except Exception as exc:   # counted, the run goes on
                result["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            latency = time.perf_counter() - t0
            if time.monotonic() - start >= warmup_s:
                if not result["steps"]:
                    results.put({"warm": index})   # the main process samples memory once every client is warm
                result["latencies_s"].append(latency)
                result["steps"] += 1
                result["tokens"] += t
                for sid, n in request.items():
                    result["prefill_tokens" if n > 1 else "decode_tokens"] += n
            for sid, n in request.items():
                if lengths[sid] + n >= live[sid]:
                    svc.free(sid)
                    del live[sid]
                    new_sequence()
        for sid in list(live):
            svc.free(sid)
        svc.close()
    except Exception as exc:
        result["errors"].append(f"fatal {type(exc).__name__}: {exc}"[:300])
    results.put(result)


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _memory(svc) -> dict:
    stats = svc.stats()
    pids = [s["pid"] for s in svc.info()["shards"]]
    return {"kv_bytes_used": [s["bytes"] for s in stats["shards"]],
            "blocks_used": [s["blocks_used"] for s in stats["shards"]],
            "rss_bytes": [_rss_bytes(p) for p in pids]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per client")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "load_bench.json"))
    args = parser.parse_args()

    import ray
    import torch

    import cpattn

    name = f"cpattn-load-{os.getpid()}"
    # address="local": always our own embedded Ray, even if another cluster runs on this machine.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.shards + args.clients + 2), namespace="cpattn",
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    cfg = cpattn.ServiceConfig(num_shards=args.shards, num_layers=4, num_q_heads=8, num_kv_heads=2, head_size=64,
                               block_size=16, dtype="float32", backend="TORCH", num_blocks_per_shard=512,
                               num_cpus_per_shard=0.5, detached=True, name=name, rpc_timeout_s=120.0,
                               collective_timeout_s=120.0)
    svc = cpattn.start(cfg)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(i, address, name, cfg.namespace, args.duration, args.warmup, 1000 + i,
                                               queue)) for i in range(args.clients)]
    try:
        t_start = time.monotonic()
        for p in procs:
            p.start()
        # Shard memory is sampled every 2 s while the clients run: the first sample once every client is past
        # its warm-up (connecting 8 processes takes a while on 2 cores) vs the last one before any finished.
        results, samples, warm = [], [], 0
        deadline = time.monotonic() + args.warmup + args.duration + 600
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                item = queue.get(timeout=2.0)
                if "warm" in item:
                    warm += 1
                    continue
                results.append(item)
            except Exception:   # queue.Empty: nobody finished yet
                if not any(p.is_alive() for p in procs) and queue.empty():
                    raise SystemExit(f"client processes exited without reporting ({len(results)} reported)")
                if not results and warm == len(procs):   # every client past its warm-up, none finished
                    samples.append(_memory(svc))
        if not samples:
            raise SystemExit("no memory sample while every client was past its warm-up and none had finished: "
                             "raise --warmup or --duration (clients started too far apart)")
        mem_warm, mem_end_live = samples[0], samples[-1]
        for p in procs:
            p.join(timeout=60)
        wall = time.monotonic() - t_start
        # Every client freed its sequences and closed: nothing may be left behind (blocks, steps, groups).
        leak_deadline = time.monotonic() + 30
        while True:
            stats = svc.stats()
            if (stats["open_steps"] == 0 and stats["num_clients"] == 1) or time.monotonic() > leak_deadline:
                break
            time.sleep(0.2)
        shards = ray.get(svc.gateway.coordinator.get_shards.remote(svc.operator_credential), timeout=60).shards
        leftovers = {"blocks_used": [s["blocks_used"] for s in stats["shards"]], "open_steps": stats["open_steps"],
                     "clients": stats["num_clients"] - 1,
                     "groups_per_shard": [len(g) - 1 for g in ray.get([h.group_names.remote(svc.operator_credential) for h in shards],
                                                                      timeout=60)]}
    finally:
        svc.shutdown()
        ray.shutdown()

    latencies = [x for r in results for x in r["latencies_s"]]
    errors = [e for r in results for e in r["errors"]]
    tokens = sum(r["tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    rss_growth = [e - w for e, w in zip(mem_end_live["rss_bytes"], mem_warm["rss_bytes"])]
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core CPU, no GPU",
        "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
        "cpattn": cpattn.__version__, "config": {k: v for k, v in cfg.model_dump().items()
                                                 if k in ("num_shards", "num_layers", "num_q_heads", "num_kv_heads",
                                                          "head_size", "block_size", "dtype", "backend")},
        "clients": args.clients, "duration_s": args.duration, "warmup_s": args.warmup, "wall_s": round(wall, 1),
        "errors": len(errors), "error_samples": errors[:5], "steps": steps, "tokens": tokens,
        "prefill_tokens": sum(r["prefill_tokens"] for r in results),
        "decode_tokens": sum(r["decode_tokens"] for r in results),
        "steps_per_s": steps / args.duration, "tokens_per_s": tokens / args.duration,
        "latency_p50_ms": 1e3 * _percentile(latencies, 50), "latency_p99_ms": 1e3 * _percentile(latencies, 99),
        "latency_max_ms": 1e3 * max(latencies, default=float("nan")),
        "memory_after_warmup": mem_warm, "memory_at_end": mem_end_live, "rss_growth_bytes": rss_growth,
        "kv_bytes_max": [max(x["kv_bytes_used"][i] for x in samples) for i in range(args.shards)],
        "memory_samples": len(samples), "leftovers_after_clients_exit": leftovers,
        "rss_growth_pct": [round(100 * g / w, 1) for g, w in zip(rss_growth, mem_warm["rss_bytes"])],
    }
    rows = [("clients x duration", f"{args.clients} x {args.duration:.0f} s (+{args.warmup:.0f} s warm-up)"),
            ("errors", f"{len(errors)}"),
            ("steps / tokens", f"{steps} / {tokens} ({report['prefill_tokens']} prefill, "
                               f"{report['decode_tokens']} decode)"),
            ("throughput", f"{report['tokens_per_s']:.1f} tokens/s, {report['steps_per_s']:.2f} steps/s"),
            ("step latency p50 / p99 / max", f"{report['latency_p50_ms']:.1f} / {report['latency_p99_ms']:.1f} / "
                                             f"{report['latency_max_ms']:.1f} ms"),
            ("shard KV bytes warm -> end", f"{mem_warm['kv_bytes_used']} -> {mem_end_live['kv_bytes_used']}"),
            ("shard RSS MiB warm -> end", f"{[round(x / 2**20, 1) for x in mem_warm['rss_bytes']]} -> "
                                          f"{[round(x / 2**20, 1) for x in mem_end_live['rss_bytes']]} "
                                          f"({report['rss_growth_pct']} %)"),
            ("left after clients exit", f"blocks {leftovers['blocks_used']}, open steps {leftovers['open_steps']}, "
                                        f"clients {leftovers['clients']}, groups/shard {leftovers['groups_per_shard']}")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for e in errors[:5]:
        print("error:", e)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
