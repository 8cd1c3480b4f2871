"""What a decode run's rows on the device cost the client (cluster/steady_run.py: SteadyRun.of), without Ray or GPU.

On an H200 (profile_begin.py, decode_b64_32k: 64 sequences at 32K, one shard in the client's process, TRITON with
CUDA graphs) the phase ``steady_rows`` cost 2.48 ms once per 128-step segment (4.13 ms in the slowest step), at B=1
0.3 ms. This builds the same run on the CPU (TRITON's builder plans there under the Triton interpreter; nothing is
captured, the graphs' buffers made as a capture makes them, as tests/test_steady_run.py does) and times
SteadyRun.of over the run's later steps, its parts (keys, written pages, step rows, pack, the copy), and a cProfile
top-N.

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/steady_rows_cost.py [--cases b64_32k,b64_32k_fp8] [--json P]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/steady_rows_cost.py --smoke     # tiny shapes, seconds
Prints one table and writes JSON (default benchmarks/results/steady_rows_cost.json).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

BLOCK = 16


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int
    steps: int = 128
    kv: str = "auto"
    window: int | None = None


CASES = {c.name: c for c in (Case("b64_32k", 64, 32768), Case("b64_32k_fp8", 64, 32768, kv="fp8_e4m3"),
                             Case("b64_32k_w4096", 64, 32768, window=4096), Case("b1_1m", 1, 1 << 20))}
SMOKE = {c.name: c for c in (Case("b4_smoke", 4, 300, steps=8), Case("b4_fp8_w64_smoke", 4, 300, 8, "fp8_e4m3", 64))}


def _build(case: Case):
    """The run's later steps (RunSteps, as begin_step's reply holds them), the template (its second step, planned as
    the gateway plans it) and the in-process shard's graphs."""
    from cpattn.attention.backends.triton_attn import TritonAttentionBackend
    from cpattn.cluster import decode_run
    from cpattn.cluster.decode_graphs import DecodeGraphs
    from cpattn.cluster.decode_run_plans import plan_decode_run, use_block_tables
    from cpattn.cluster.gateway import StepWire
    from cpattn.cluster.layer_runner import ShardLayerRunner
    from cpattn.cluster.step_planner import table_gatherer
    from cpattn.config import ServiceConfig
    from cpattn.kvstore.run_growth import grow_decode_run
    from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

    rng = random.Random(0)
    lengths = [case.context - rng.randrange(0, 64) for _ in range(case.batch)]
    blocks = sum(-(-(n + case.steps) // BLOCK) for n in lengths) + 2 * case.batch + 16
    alloc = ShardedKVAllocator(1, blocks, BLOCK, 1, max_rows=max(16, case.batch), replicas=1)
    rows = [alloc.add_rows() for _ in lengths]
    alloc.finish(alloc.grow(list(zip(rows, lengths)), [0] * len(rows)))
    growths = grow_decode_run(alloc, rows, lengths, case.steps, first_step=0)
    runs = plan_decode_run(alloc, rows, lengths, list(range(case.steps)), table_gatherer(alloc, rows, {}), 0, None,
                           None, growths[0], False, 8)
    first, later = decode_run.client_steps(runs, list(range(case.steps)), [0])
    use_block_tables([first], {0: runs.ranks[0].table})
    use_block_tables(later, {0: runs.ranks[0].table})
    cfg = ServiceConfig(num_shards=1, num_layers=1, num_q_heads=8, num_kv_heads=2, head_size=16, block_size=BLOCK,
                        num_blocks_per_shard=blocks, device="cpu", dtype="bfloat16", backend="TRITON",
                        kv_cache_dtype=case.kv, sliding_window=case.window)
    fp8 = case.kv != "auto"
    # Planning reads no page: a one-page cache stands in for the run's (its shape's other dims are the backend's)
    cache = torch.zeros(2, 1, BLOCK, 2, 16, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    runner = ShardLayerRunner(cfg, TritonAttentionBackend, [cache], torch.device("cpu"),
                              [torch.ones(2, 1, 2)] if fp8 else None)
    graphs = {0: DecodeGraphs(runner)}

    def capture(self, attn_metadata, key, prefix_pass=None):   # tests' no_capture: buffers made, nothing captured
        self.make_buffers(attn_metadata, key, prefix_pass)
        self.key = key
    DecodeGraphs._capture = capture

    def open_planned(info):
        local = {r: runner.plan(p, graphs[r]) for r, p in info.local_plans.items()}
        num_tokens = next(iter(info.local_plans.values())).num_tokens
        return StepWire(info.step_id, num_tokens, local, dict(info.remote_rows))
    open_planned(first)
    template = open_planned(later[0])
    return later, template, graphs


PARTS = {"keys": ("key_of",), "written": ("written_pages_of_steps", "written_pages_of_steps_host"),
         "pack": ("pack",), "copy": ("to",)}
"""SteadyRun.of's parts: the functions cProfile times for each (every call's cumulative ms, its overhead included);
"copy" is every Tensor.to (the packed rows' copy to the device, on a GPU host)."""


def _parts(profile: cProfile.Profile) -> dict:
    stats = pstats.Stats(profile, stream=io.StringIO()).stats
    return {f"{part}_ms": 1e3 * sum(cum for (_f, _l, name), (_cc, _n, _tt, cum, _) in stats.items()
                                    if name in names or any(name == f"<method '{n}' of 'torch._C.TensorBase' objects>"
                                                            for n in names))
            for part, names in PARTS.items()}


def _top(profile: cProfile.Profile, n: int) -> list[dict]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = [{"function": f"{Path(f).name}:{line}({name})", "calls": calls, "tottime_ms": 1e3 * tt,
             "cumtime_ms": 1e3 * ct} for (f, line, name), (_cc, calls, tt, ct, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r["tottime_ms"])[:n]


def run_case(case: Case, repeats: int, top: int) -> dict:
    from cpattn.cluster.steady_run import SteadyRun

    later, template, graphs = _build(case)
    assert SteadyRun.of(later, template, graphs) is not None, case   # a warm-up too
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        SteadyRun.of(later, template, graphs)
        times.append(time.perf_counter() - t0)
    profile = cProfile.Profile()
    profile.enable()
    SteadyRun.of(later, template, graphs)
    profile.disable()
    row = {"case": case.name, "batch": case.batch, "context": case.context, "steps": case.steps, "kv": case.kv,
           "window": case.window, "of_ms_median": 1e3 * statistics.median(times), "of_ms_max": 1e3 * max(times),
           "bytes_per_step": SteadyRun.of(later, template, graphs).rows[0].packed.shape[1]}
    row.update(_parts(profile))
    row["top"] = _top(profile, top)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="b64_32k,b64_32k_fp8,b64_32k_w4096,b1_1m", help=f"any of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--top", type=int, default=12, help="cProfile rows printed (by own time)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "steady_rows_cost.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repeats: every path in seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")   # TRITON's builder plans on the CPU
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        CASES.update(SMOKE)
        args.cases, args.repeats, args.top = ",".join(SMOKE), 2, 3
    print(f"steady_rows_cost: SteadyRun.of over a run's later steps, ms (median and max of {args.repeats}), "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'case':>16} {'B':>3} {'context':>8} {'steps':>5} {'median':>7} {'max':>7} "
          + " ".join(f"{p:>7}" for p in PARTS) + f" {'bytes':>6}")
    rows = []
    for name in args.cases.split(","):
        r = run_case(CASES[name], args.repeats, args.top)
        rows.append(r)
        print(f"{r['case']:>16} {r['batch']:>3} {r['context']:>8} {r['steps']:>5} {r['of_ms_median']:>7.3f} "
              f"{r['of_ms_max']:>7.3f} " + " ".join(f"{r[p + '_ms']:>7.3f}" for p in PARTS)
              + f" {r['bytes_per_step']:>6}", flush=True)
        for t in r["top"]:
            print(f"{'':>18}{t['tottime_ms']:>8.3f} own {t['cumtime_ms']:>8.3f} cum {t['calls']:>6}x  {t['function']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": date.today().isoformat(), "machine": platform.node(), "processor": platform.processor(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
