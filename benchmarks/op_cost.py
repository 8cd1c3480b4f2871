"""What one small torch call costs the caller's thread in the client's process, before Ray, with Ray, with the
service up, and inside a decode run (issue 18).

On an H200 host (session 9) a decode run's steady step spent 0.17 ms on two device copies, a zero and their views,
and the in-process shard's plan ~24 us per small torch call, 3-4x what the same calls cost in profile_begin's client
part without Ray; a Ray driver on the 2-core CPU box shows no such cost (so not the GIL there). This times the calls
themselves at each stage, so the next GPU session sees which stage makes them slow (Ray's threads, the service's
CUDA context with the in-process shard's KV cache opened by IPC, the run's state):

    python benchmarks/op_cost.py [--json PATH]      # on the GPU machine: cuda tensors, 1 shard in this process
    python benchmarks/op_cost.py --smoke            # CPU tensors and a CPU service (the test suite runs it)

Per stage and call: microseconds per call (wall time of N calls on the caller's thread, then one device sync).
Stage "busy": as "bare", but each batch made while the GPU runs ~20 ms of matmuls enqueued before it, as a decode
step's opening and its layers' calls are made while the previous layers run (session 11's torch profile showed
device-to-device cudaMemcpyAsync at 17-30 us there against ~9 us per kernel launch; this times it unprofiled).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from results_json import base_meta, write_results

STAGES = ("bare", "busy", "ray", "service", "run")


def _calls(device: torch.device) -> dict:
    """Name -> a zero-argument call of the kind a step's opening makes."""
    small = torch.zeros(64, dtype=torch.int64, device=device)
    source = torch.arange(64, dtype=torch.int64, device=device)
    host = torch.arange(64, dtype=torch.int64)
    rows = torch.arange(64 * 128, dtype=torch.int64, device=device).view(128, 64)
    # a B=1 decode layer's q, k, v (Hq 32, Hk 8, D 128) into a graph's packed buffer: three copies or one cat
    q, k, v = (torch.zeros(1, h, 128, dtype=torch.bfloat16, device=device) for h in (32, 8, 8))
    qkv = torch.zeros(1, 48, 128, dtype=torch.bfloat16, device=device)
    qkv_q, qkv_k, qkv_v = qkv.split([32, 8, 8], dim=1)

    def three_copies():
        qkv_q.copy_(q)
        qkv_k.copy_(k)
        qkv_v.copy_(v)
    return {"q|k|v: 3 copy_": three_copies, "q|k|v: cat": lambda: torch.cat([q, k, v], dim=1, out=qkv),
            "out clone": lambda: q.clone(), "zero_": small.zero_, "copy_ device": lambda: small.copy_(source),
            "copy_ from host": lambda: small.copy_(host, non_blocking=True),
            "row view": lambda: rows[7], "empty": lambda: torch.empty(64, dtype=torch.int64, device=device),
            "tensor + to": lambda: torch.tensor([1, 2, 3], dtype=torch.int32).to(device, non_blocking=True),
            # a host op over more than torch's intra-op grain (32K elements) runs on every intra-op thread: 8 ms on a
            # busy 2-core box against 0.4 on one thread (page_delta.PageCache assembles tables in numpy for this)
            "cpu full 64K": lambda: torch.full((65536,), -1, dtype=torch.int64)}


def _busy(device: torch.device):
    """Enqueue ~20 ms of GPU work (bf16 matmuls) and return at once; a no-op on the CPU."""
    if device.type != "cuda":
        return lambda: None
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def busy():
        for _ in range(20):
            torch.matmul(a, a)
    return busy


def time_calls(device: torch.device, n: int, repeats: int = 5, busy: bool = False) -> dict[str, float]:
    """Microseconds per call, the median of ``repeats`` batches of ``n`` calls (the device synced after each);
    ``busy``: each batch made while the GPU runs work enqueued before it."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    load = _busy(device) if busy else (lambda: None)
    out = {}
    for name, call in _calls(device).items():
        for _ in range(10):
            call()
        sync()
        batches = []
        for _ in range(repeats):
            load()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            batches.append((time.perf_counter() - t0) / n)
            sync()
        out[name] = 1e6 * statistics.median(batches)
    return out


def _service(device: torch.device, smoke: bool):
    """A 1-shard service (its shard in this process on a GPU) and one sequence with some context."""
    import cpattn

    gpu = device.type == "cuda"
    cfg = cpattn.ServiceConfig(num_shards=1, num_layers=2, num_q_heads=8 if gpu else 4, num_kv_heads=2,
                               head_size=128 if gpu else 16, block_size=16, dtype="bfloat16" if gpu else "float32",
                               backend="TRITON" if gpu else "TORCH", device=device.type,
                               num_gpus_per_shard=1 if gpu else 0, num_cpus_per_shard=1 if gpu else 0.25,
                               num_blocks_per_shard=4096 if gpu else 256, name="op-cost", decode_run_steps=8)
    svc = cpattn.start(cfg)
    sid = svc.add_sequence()
    svc.fill_synthetic(sid, 2000 if gpu else 200, seed=0)
    return svc, sid


def _decode(svc, sid, device: torch.device, steps: int) -> None:
    cfg = svc.config
    dtype = cfg.torch_dtype
    q, k, v = (torch.randn(1, h, cfg.head_size, device=device, dtype=dtype)
               for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads))
    for _ in range(steps):
        with svc.step({sid: 1}) as step:
            for layer in range(cfg.num_layers):
                step.attend(layer, q, k, v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--json", default="benchmarks/results/op_cost.json")
    parser.add_argument("--smoke", action="store_true", help="CPU tensors, a CPU service, few calls")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    n = 200 if args.smoke else args.calls
    rows = {"bare": time_calls(device, n), "busy": time_calls(device, min(n, 400), busy=True)}
    from cpattn.cluster.service import ensure_ray

    ensure_ray(None, "cpattn", num_cpus_hint=1 if device.type == "cuda" else 0.25)
    rows["ray"] = time_calls(device, n)
    svc, sid = _service(device, args.smoke)
    try:
        rows["service"] = time_calls(device, n)
        _decode(svc, sid, device, 3)   # a decode run of 4 steps is open after its third
        rows["run"] = time_calls(device, n)
        threads = sorted(t.name for t in threading.enumerate())
    finally:
        svc.shutdown()
    names = list(rows["bare"])
    print(f"op_cost: us per call on the caller's thread ({device}, {n} calls a batch, median of 5)")
    print(f"{'call':>16} " + " ".join(f"{s:>9}" for s in STAGES))
    for name in names:
        print(f"{name:>16} " + " ".join(f"{rows[s][name]:9.2f}" for s in STAGES))
    print(f"threads in the client process during the run: {', '.join(threads)}")
    meta = {**base_meta(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "calls": n,
            "python": sys.version.split()[0], "threads": threads}
    write_results(args.json, meta, us_per_call=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
