"""Where a decode step's host time goes: cProfile of whole steps through the public API on one GPU.

    python benchmarks/profile_layer.py [--context 131072] [--batch 1] [--layers 32] [--gpus 1] [--top 30]
                                       [--window 4096] [--kv-cache-dtype fp8_e4m3]
Prints the functions with the most own time over ``--steps`` profiled steps (after warm-up).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--window", type=int, default=None, help="a sliding window on every layer")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    import cpattn

    hq, hk, d = 32, 8, 128
    cfg = cpattn.ServiceConfig(num_shards=args.gpus, num_layers=args.layers, num_q_heads=hq, num_kv_heads=hk,
                               head_size=d, block_size=16, dtype="bfloat16", backend="TRITON", device="cuda",
                               num_gpus_per_shard=1, num_blocks_per_shard=args.batch * (args.context // 16 // args.gpus + 64),
                               name="profile-layer", sliding_window=args.window,
                               kv_cache_dtype=args.kv_cache_dtype)
    svc = cpattn.start(cfg)
    try:
        sids = [svc.add_sequence() for _ in range(args.batch)]
        for i, sid in enumerate(sids):
            svc.fill_synthetic(sid, args.context, seed=i)
        q, k, v = (torch.randn(args.batch, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))

        def steps(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                with svc.step({sid: 1 for sid in sids}) as step:
                    for layer in range(args.layers):
                        step.attend(layer, q, k, v)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n / args.layers * 1e3

        steps(3)
        print(f"unprofiled: {steps(args.steps):.3f} ms/layer at context {args.context} x {args.batch} on {args.gpus} "
              f"GPU(s); graph buckets: {[g.key for g in svc.gateway.local_graphs.values() if g is not None]}")
        prof = cProfile.Profile()
        prof.enable()
        steps(args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    finally:
        svc.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
