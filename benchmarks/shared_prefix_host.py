"""Shared prefixes' host cost per decode step, on the CPU: 16 forks of one document vs 16 separate copies vs one.

Issue 24's time goal (a batched step over N forks <= 1.2x one question's) is measured on GPUs by
``shared_prefix.py``; this measures, without Ray or a GPU, the host work a step pays where it is made, at the
real table widths (16 requests x 16,384 pages per shard for a 512K-token document on 2 shards):

- coordinator: a decode run's begin_step (admit, grow, plan every step), pickling what Ray carries, and its
  commits, per step (benchmarks/plan_cost.py's measure on the coordinator's own state owners);
- shard: each rank building its step from the run (RankRun.plan) and ShardLayerRunner.plan, where forks get the
  cascade split (attention/cascade_plan.py) and both tables move to the device. The builder is TRITON's when
  triton is importable, else a stand-in that only moves the metadata (the split is the same either way);
  ``--fresh-split`` plans each step with a new PrefixSplitter (the cost before it kept a table's analysis).

    python benchmarks/shared_prefix_host.py                 # 16 questions over 512K tokens, 2 shards
    python benchmarks/shared_prefix_host.py --smoke         # tiny shapes in seconds (the test suite runs it)
Prints one table and writes JSON (default benchmarks/results/shared_prefix_host.json).
"""

from __future__ import annotations

import argparse
import pickle
import platform
import statistics
import time
from pathlib import Path

import torch
from results_json import base_meta, write_results

WAYS = ("one", "shared", "separate")


def _backend():
    """TRITON's backend class where triton imports, else a stand-in whose builder only moves the metadata."""
    try:
        from cpattn.attention.backends.triton_attn import TritonAttentionBackend
        import triton  # noqa: F401
        return TritonAttentionBackend, "TRITON"
    except ImportError:
        from cpattn.attention.backend import AttentionMetadataBuilder
        from cpattn.attention.backends.torch_ref import TorchReferenceBackend

        class MoveOnly(AttentionMetadataBuilder):
            def build(self, common_prefix_len, common):   # the step's indices to the device, as every GPU builder
                return common.to(torch.device(self.spec.device))   # copies them (ShardLayerRunner moves the table)

        class StandIn(TorchReferenceBackend):
            builder_cls = MoveOnly
            reads_shared_prefix_once = False   # take the block-table kernels' split, as TRITON does
        return StandIn, "stand-in (no triton)"


def _coordinator(way: str, args):
    from cpattn.cluster.coordinator import Coordinator
    from cpattn.config import ServiceConfig

    copies = args.questions if way == "separate" else 1
    per_copy = args.prefix_tokens // args.shards // args.block_size + 2
    blocks = per_copy * copies + 4 * args.questions * (args.run_steps * (args.repeats + 2) // args.block_size + 2)
    cfg = ServiceConfig(num_shards=args.shards, num_layers=1, num_q_heads=32, num_kv_heads=8, head_size=128,
                        block_size=args.block_size, num_blocks_per_shard=blocks, device="cpu", dtype="bfloat16",
                        max_tokens_per_step=1 << 20, max_tokens_per_client=None,
                        max_sequences=2 * args.questions + 2)
    coordinator = Coordinator(cfg)
    client = coordinator.clients.check(coordinator.register_client()["credential"])
    ledger = coordinator.ledger
    if way == "separate":
        seqs = [coordinator.table.add(client, f"s{i}").seq_id for i in range(args.questions)]
    else:
        seqs = [coordinator.table.add(client, "doc").seq_id]
    for seq_id in seqs:
        seq, growth, _ = ledger.plan_fill(client, seq_id, args.prefix_tokens, 1, coordinator.gen)
        ledger.commit_fill(seq, args.prefix_tokens, growth)
    if way == "shared":
        doc = seqs[0]
        seqs = [coordinator.sharing.fork(client, doc) for _ in range(args.questions)]
        coordinator.table.free(doc, client)   # the forks hold its pages
    return coordinator, client, seqs, cfg


def measure(way: str, args) -> dict:
    from cpattn.cluster import decode_run
    from cpattn.cluster.layer_runner import ShardLayerRunner

    coordinator, client, seqs, cfg = _coordinator(way, args)
    backend, backend_name = _backend()
    runners = [ShardLayerRunner(cfg, backend, [], torch.device("cpu")) for _ in range(args.shards)]
    for runner in runners:
        runner.split_prefixes = True   # no windows here: what a block-table backend gets
    ledger, samples = coordinator.ledger, []
    for rep in range(args.repeats + 2):   # the first two warm up
        t0 = time.perf_counter()
        admitted = ledger.admit(client, {s: 1 for s in seqs}, args.run_steps, 1)
        step, runs = ledger.open(admitted, (), coordinator.gen)
        ledger.reply(step, admitted.seqs, admitted.request, runs, None, coordinator.gen.epoch)
        sent = [pickle.dumps(decode_run.shard_plans(runs, r)) for r in range(args.shards)]
        t1 = time.perf_counter()
        shard_s, split_steps = [0.0] * args.shards, 0
        for rank, message in enumerate(sent):
            steps, _ = pickle.loads(message)
            s0 = time.perf_counter()
            for plan in steps:   # built as reached, then planned for the kernels (a shard's run_step)
                if args.fresh_split:
                    from cpattn.attention.cascade_plan import PrefixSplitter

                    runners[rank]._splitter = PrefixSplitter(runners[rank].kernel_block_size)
                split_steps += runners[rank].plan(plan).prefix_pass is not None
            shard_s[rank] = time.perf_counter() - s0
        t2 = time.perf_counter()
        n = step.num_substeps
        for j in range(1, n):
            ledger.advance(step, j)
        step.done = n
        ledger.close(step, committed=True)
        coordinator_s = (t1 - t0) + (time.perf_counter() - t2)
        if rep >= 2:
            samples.append({"coordinator": coordinator_s / n, "shard": max(shard_s) / n, "steps": n,
                            "split_steps": split_steps})
    med = {k: 1e3 * statistics.median(s[k] for s in samples) for k in ("coordinator", "shard")}
    table = runs.ranks[0].table
    return {"way": way, "batch": len(seqs), "table": list(table.shape), "steps_per_run": samples[0]["steps"],
            "split_steps": samples[0]["split_steps"], "coordinator_ms_per_step": med["coordinator"],
            "shard_ms_per_step": med["shard"], "total_ms_per_step": med["coordinator"] + med["shard"],
            "builder": backend_name}


HEADER = f"{'way':>9} {'batch':>5} {'table/shard':>12} {'coordinator':>11} {'shard':>7} {'total':>7} {'split':>6}"


def _fmt(r: dict) -> str:
    return (f"{r['way']:>9} {r['batch']:>5} {'x'.join(map(str, r['table'])):>12} {r['coordinator_ms_per_step']:>11.3f} "
            f"{r['shard_ms_per_step']:>7.3f} {r['total_ms_per_step']:>7.3f} {r['split_steps']:>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=524288)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--run-steps", type=int, default=8, help="steps of each decode run (its first: 4, doubling)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--fresh-split", action="store_true", help="a new PrefixSplitter per step (nothing kept)")
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "shared_prefix_host.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: every path in seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # as in a Ray actor (OMP_NUM_THREADS=1)
    if args.smoke:
        args.questions, args.prefix_tokens, args.shards, args.run_steps, args.repeats = 4, 1000, 3, 3, 1
    print(f"shared_prefix_host: {args.questions} questions over {args.prefix_tokens} tokens, {args.shards} shards, "
          f"ms of host work per decode step (runs of {args.run_steps}), medians of {args.repeats}"
          + (", fresh split per step" if args.fresh_split else ""))
    print(HEADER)
    rows = []
    for way in args.ways.split(","):
        rows.append(measure(way, args))
        print(_fmt(rows[-1]), flush=True)
    print(f"(shard: the slowest rank's RankRun.plan + ShardLayerRunner.plan; builder: {rows[0]['builder']})")
    meta = {**base_meta(), "processor": platform.processor(),
            **{k: v for k, v in vars(args).items() if k not in ("json", "ways")}}
    print()
    write_results(args.json, meta, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
