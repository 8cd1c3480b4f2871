"""Opening a decode run's later step on the client, forks vs one question (issue 24): host time and device ops.

On one GPU ``shared_prefix.py`` measured 16 forks' steps opening in 2.12 ms against one question's 0.79: a decode
run's later step is opened by the client alone (no coordinator call): its in-process shard's plan is built from
the run (decode_run_plans.client_step), planned for the kernels (ShardLayerRunner.plan: for forks the cascade
split and the prefix pass) and its graph buffers refilled (DecodeGraphs.prepare). This runs exactly that on the
CPU at the real table width (a 512K-token document, 1 shard: 16 x 32K pages) and reports per step

- host ms: the work on device "cpu" (moves to the device cost nothing here: count them below);
- device ops: every torch op that reaches a device tensor when the runner's device is "meta" (host-to-device
  copies, fills, buffer refills: each a launch or a synchronous copy of ~10-30 us on a GPU host).

    PYTHONPATH=. /work/tvenv/bin/python benchmarks/shared_prefix_begin.py     # TRITON's builder (triton imports)
    python benchmarks/shared_prefix_begin.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from results_json import base_meta, write_results

from shared_prefix_host import _backend, _coordinator


class _DeviceOps(TorchDispatchMode):
    """Ops with a meta tensor among their inputs or outputs (what would run on, or copy to, the GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat):
            self.ops[func.overloadpacket.__name__] += 1
        return out


def _nothing():
    return contextlib.nullcontext()


def _graphs(runner):
    """DecodeGraphs whose capture only makes its buffers (what prepare refills each step; no CUDA here)."""
    from cpattn.cluster.decode_graphs import DecodeGraphs

    graphs = DecodeGraphs(runner)

    def capture(md, key, prefix_pass=None):
        graphs.make_buffers(md, key, prefix_pass)
        graphs.key = key
    graphs._capture = capture
    return graphs


def measure(way: str, args, device: str) -> dict:
    from cpattn.cluster import decode_run
    from cpattn.cluster.decode_run_plans import use_block_tables
    from cpattn.cluster.layer_runner import ShardLayerRunner

    coordinator, client, seqs, cfg = _coordinator(way, args)
    backend, _ = _backend()
    runner = ShardLayerRunner(cfg, backend, [], torch.device(device))
    runner.split_prefixes = True
    graphs = _graphs(runner) if hasattr(runner.builder, "graph_key") else None   # the stand-in has no graphs
    ledger, times, firsts, ops, first_ops = coordinator.ledger, [], [], Counter(), Counter()
    for rep in range(args.repeats + 1):   # the first run warms up
        admitted = ledger.admit(client, {s: 1 for s in seqs}, args.run_steps, 1)
        step, runs = ledger.open(admitted, (), coordinator.gen)
        first, later = decode_run.client_steps(runs, runs.ranks[0].step_ids, [0])
        use_block_tables([first], {0: runs.ranks[0].table.clone()})
        table = first.local_plans[0].metadata.block_table_tensor
        use_block_tables(later, {0: table})
        counter = _DeviceOps() if device == "meta" else None
        t0 = time.perf_counter()
        with counter or _nothing():   # a run's first step (the coordinator's reply: a new table)
            runner.plan(first.local_plans[0], graphs)
        if rep:
            firsts.append(time.perf_counter() - t0)
            first_ops = counter.ops if counter is not None else first_ops
        for j in range(len(later)):
            counter = _DeviceOps() if device == "meta" else None
            t0 = time.perf_counter()
            with counter or _nothing():
                runner.plan(later[j].local_plans[0], graphs)
            if rep:
                times.append(time.perf_counter() - t0)
                if counter is not None:
                    ops = counter.ops
        n = step.num_substeps
        for j in range(1, n):
            ledger.advance(step, j)
        step.done = n
        ledger.close(step, committed=True)
    return {"way": way, "batch": len(seqs), "ms": 1e3 * statistics.median(times),
            "device_ops": sum(ops.values()), "ops": dict(ops), "first_ms": 1e3 * statistics.median(firsts),
            "first_device_ops": sum(first_ops.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=524288)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--run-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="one and shared measured interleaved this many times")
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "shared_prefix_begin.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round: every path in seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.smoke:
        args.questions, args.prefix_tokens, args.repeats, args.rounds = 4, 1000, 1, 1
    print(f"shared_prefix_begin: a run's later step opened on the client, {args.questions} forks of "
          f"{args.prefix_tokens} tokens vs one, {args.shards} shard(s); host ms (cpu) and device ops (meta)")
    rows = []
    for rnd in range(args.rounds):
        for way in ("one", "shared"):
            host = measure(way, args, "cpu")
            dev = measure(way, args, "meta")
            rows.append({"round": rnd, "way": way, "batch": host["batch"], "host_ms": host["ms"],
                         "device_ops": dev["device_ops"], "ops": dev["ops"], "first_host_ms": host["first_ms"],
                         "first_device_ops": dev["first_device_ops"], "builder": _backend()[1]})
            print(f"round {rnd} {way:>7} B={host['batch']:>3} later steps: host {host['ms']:.3f} ms, device ops "
                  f"{dev['device_ops']:>3} {dict(sorted(dev['ops'].items()))}; a run's first step: host "
                  f"{host['first_ms']:.3f} ms, device ops {dev['first_device_ops']}", flush=True)
    write_results(args.json, {**base_meta(), **{k: v for k, v in vars(args).items() if k != "json"}}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
