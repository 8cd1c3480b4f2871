"""Launches per layer of a decode step over forks (issue 24): what one shard's layer costs in kernels, on any machine.

N questions forked from one document decode one token each; one shard's layer runs eagerly (``run_layer``) and from
its graph buffers (``DecodeGraphs._layer``, what a captured graph replays), and every torch op that would launch a
kernel on a GPU (views and no-op conversions excluded, allocations counted apart) and every Triton kernel launch is
counted. "one" is one question's decode over the same document, the goal's baseline. On a GPU it also times the
eager layer's host work (no sync) and the graphed layer on the device (replays, CUDA events: issue 24's goal per
layer, shared <= 1.2x one). On a CPU it runs under Triton's interpreter with the Triton kernels stubbed
(counted, not run: launch counts need no numbers):

    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch and triton> benchmarks/prefix_pass_launches.py
    python benchmarks/prefix_pass_launches.py --json $OUT/prefix_pass_launches.json       # on a GPU

Prints one line per case and writes JSON (default benchmarks/results/prefix_pass_launches.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, str(Path(__file__).resolve().parent))   # its siblings, also where a test loads it by path
from results_json import write_results  # noqa: E402

NO_LAUNCH = {"view", "_unsafe_view", "slice", "select", "as_strided", "split", "split_with_sizes", "unbind", "alias",
             "expand", "permute", "unsqueeze", "squeeze", "detach", "t", "transpose", "narrow", "lift_fresh",
             "_reshape_alias", "reshape", "view_as", "_to_copy_noop", "is_nonzero", "item", "_local_scalar_dense"}
ALLOCS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach dispatch (after composite decompositions), except while a Triton kernel runs."""

    def __init__(self):
        super().__init__()
        self.ops, self.allocs, self.paused = Counter(), Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_LAUNCH:
            (self.allocs if name in ALLOCS else self.ops)[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting(run_kernels: bool, count_ops: bool = True):
    """(op counter, Triton launches by kernel name) over the block; Triton kernels stubbed unless ``run_kernels``;
    torch ops counted only with ``count_ops`` (the dispatch mode costs host time of its own)."""
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    launches, originals = Counter(), [(c, c.run) for c in classes]
    counter = _OpCounter()

    def patched(original):
        def run(self, *args, **kwargs):
            fn = getattr(self, "fn", self)
            launches[getattr(fn, "__name__", str(fn))] += 1
            if not run_kernels:
                return None
            counter.paused += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.paused -= 1
        return run

    for cls, original in originals:
        cls.run = patched(original)
    try:
        if count_ops:
            with counter:
                yield counter, launches
        else:
            yield counter, launches
    finally:
        for cls, original in originals:
            cls.run = original


def _plans(questions: int, prefix: int, shards: int, interleave: int, block: int):
    from cpattn.cluster.step_planner import StepRequest, plan_step
    from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

    blocks = 2 * (prefix // block // shards + 4) + 4 * questions
    alloc = ShardedKVAllocator(shards, blocks, block, interleave, max_rows=questions + 2)
    source = alloc.add_rows()
    alloc.finish(alloc.grow([(source, prefix)], [0]))
    rows = [source] + [alloc.fork_rows(source, prefix) for _ in range(questions - 1)]
    growth = alloc.grow([(r, prefix + 1) for r in rows], [prefix] * questions)
    return plan_step(alloc, [StepRequest(r, prefix, 1) for r in rows], 1, False, 1 << 30, growth=growth), blocks


def measure(questions: int, args, device: torch.device) -> dict:
    import cpattn
    from cpattn.attention.backends.triton_attn import TritonAttentionBackend
    from cpattn.cluster.decode_graphs import DecodeGraphs
    from cpattn.cluster.layer_runner import ShardLayerRunner

    hq, hk, d = args.heads
    plans, blocks = _plans(questions, args.prefix_tokens, args.shards, args.interleave, args.block_size)
    plan = plans[0]
    cfg = cpattn.ServiceConfig(num_shards=args.shards, num_layers=1, num_q_heads=hq, num_kv_heads=hk, head_size=d,
                               block_size=args.block_size, dtype=args.dtype, device=str(device),
                               dcp_interleave=args.interleave, num_blocks_per_shard=blocks)
    cache = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(blocks, args.block_size, hk, d),
                        dtype=cfg.torch_dtype, device=device)
    runner = ShardLayerRunner(cfg, TritonAttentionBackend, [cache], device)
    q, k, v = (torch.randn(plan.num_tokens, h, d, device=device).to(cfg.torch_dtype) for h in (hq, hk, hk))
    step = runner.plan(plan)
    run_kernels = device.type == "cuda"
    row = {"questions": questions, "tokens": plan.num_tokens, "prefix_pass": step.prefix_pass is not None}
    if run_kernels:
        runner.run_layer(step, 0, q, k, v)   # warm-up: JIT compiles
    with _counting(run_kernels) as (ops, launches):
        runner.run_layer(step, 0, q, k, v)
    row["eager"] = _counts(ops, launches)
    graphs = DecodeGraphs(runner)
    key = graphs.bucket(step.attn_metadata, step.replica_slots, step.prefix_pass)
    if key is not None:
        graphs.make_buffers(step.attn_metadata, key, step.prefix_pass)
        graphs.key = key
        graphs.prepare(step.attn_metadata, step.replica_slots, step.pieces, step.rows, step.prefix_pass)
        if run_kernels:
            graphs._layer(0)
        with _counting(run_kernels) as (ops, launches):
            graphs._layer(0)
        row["graphed"] = _counts(ops, launches)
    if device.type == "cuda":
        row["eager_host_us"] = _host_us(lambda: runner.run_layer(step, 0, q, k, v), args.repeats, True)
        row["graphed_layer_us"] = _graphed_layer_us(runner, copy.deepcopy(plan), q, k, v, args.repeats)
    else:   # the host's Python and torch work of a layer, its Triton launches stubbed (their own cost left out)
        with _counting(False, count_ops=False):
            row["eager_host_us_stubbed"] = _host_us(lambda: runner.run_layer(step, 0, q, k, v), args.repeats, False)
            if key is not None:
                row["graphed_layer_host_us_stubbed"] = _host_us(lambda: graphs._layer(0), args.repeats, False)
    return row


def _counts(counter: _OpCounter, launches: Counter) -> dict:
    return {"launches": sum(counter.ops.values()) + sum(launches.values()), "torch_ops": dict(counter.ops),
            "triton": dict(launches), "allocations": sum(counter.allocs.values())}


def _graphed_layer_us(runner, plan, q, k, v, repeats: int) -> float | None:
    """Wall time per layer on the device of the layer as a decode loop runs it (its captured graph replayed, the
    q/k/v copies into the graph's buffers included), CUDA events around ``repeats`` layers; None if not graphed."""
    graphs = runner.new_graphs()
    step = runner.plan(plan, graphs) if graphs is not None else None
    if step is None or step.graphs is None:
        return None
    for _ in range(3):
        runner.run_layer(step, 0, q, k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        runner.run_layer(step, 0, q, k, v)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / repeats


def _host_us(fn, repeats: int, cuda: bool) -> float:
    """Median host time of ``fn`` in microseconds, the device synchronised between calls only."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=65536)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("HQ", "HK", "D"))
    parser.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float16 on the CPU")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "prefix_pass_launches.json"))
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on a CPU set TRITON_INTERPRET=1 (Triton's interpreter stands in for the GPU)")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float16")
    if device.type == "cpu":
        torch.set_num_threads(1)   # small ops: intra-op threads only wait on each other (and on a shared box, long)
    rows = []
    for questions in (1, args.questions):
        row = measure(questions, args, device)
        rows.append(row)
        for path in ("eager", "graphed"):
            if path in row:
                c = row[path]
                print(f"{questions:3d} question(s) {path:8s}: {c['launches']:3d} launches "
                      f"({sum(c['triton'].values())} Triton), {c['allocations']} allocations  {c['torch_ops']}")
        for name in ("eager_host_us", "graphed_layer_us", "eager_host_us_stubbed", "graphed_layer_host_us_stubbed"):
            if row.get(name) is not None:
                print(f"    {name}: {row[name]:.1f} us/layer")
    meta = {"host": platform.node(), "device": str(device), "torch": torch.__version__,
            **{k: v for k, v in vars(args).items() if k != "json"}}
    write_results(args.json, meta, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
