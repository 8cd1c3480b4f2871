"""A shard's kernel warm-up on FLASHINFER from an empty JIT cache: its modules compiled side by side (kernel_warmup's
COMPILE_WORKERS at a time) or one at a time (--workers 1, as before session 33), then the warm-up's steps. Prints
one line per phase and writes JSON.

    python benchmarks/flashinfer_jit_ahead.py --workers 2 --json out.json   # on the GPU machine (source env.sh)

The JIT cache is a fresh directory under /tmp (FLASHINFER_WORKSPACE_BASE, read when flashinfer is imported), so
every module compiles: run each worker count in a process of its own. The config is a Gemma-2-like layer pair, a
window of 4,096 with a soft cap of 50 beside a full layer with the cap.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="builds at once (default: kernel_warmup's)")
    parser.add_argument("--shards", type=int, default=1, help="the service's shards (2 or more: masked prefills too)")
    parser.add_argument("--device", default="cuda", help="cpu: tests/test_kernel_warmup.py's smoke, on a model")
    parser.add_argument("--jit-dir", default=None, help="FlashInfer's JIT cache (default: a fresh one under /tmp)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = args.jit_dir or tempfile.mkdtemp(prefix="cpattn-fi-jit-")

    import torch

    from cpattn.attention.backends.flashinfer import FlashInferBackend
    from cpattn.cluster import kernel_warmup
    from cpattn.config import ServiceConfig

    if args.workers is not None:
        kernel_warmup.COMPILE_WORKERS = args.workers
    phases: list[tuple[str, float]] = []

    class Phases(logging.Handler):   # the warm-up logs its ahead-of-time compile with its time
        def emit(self, record):
            phases.append((record.getMessage(), time.perf_counter() - t0))
            print(f"{time.perf_counter() - t0:7.1f} s  {record.getMessage()}", flush=True)

    log, handler, level = logging.getLogger("cpattn"), Phases(), logging.getLogger("cpattn").level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = ServiceConfig(num_shards=args.shards, num_layers=2, num_q_heads=16, num_kv_heads=8, head_size=128,
                        block_size=16, dtype="bfloat16", backend="FLASHINFER", device=args.device,
                        num_blocks_per_shard=256, sliding_window=[4096, None], logits_soft_cap=[50.0, 50.0])
    t0 = time.perf_counter()
    try:
        seconds = kernel_warmup.warm_up_kernels(cfg, FlashInferBackend, FlashInferBackend, torch.device(args.device))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result = dict(workers=kernel_warmup.COMPILE_WORKERS, shards=args.shards, cpus=os.cpu_count(),
                  warm_up_s=round(seconds, 1), log=[[m, round(t, 1)] for m, t in phases], device=device,
                  torch=torch.__version__)
    print(f"warm-up {seconds:.1f} s with {kernel_warmup.COMPILE_WORKERS} builds at once on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
