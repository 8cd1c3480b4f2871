"""What planning a step costs the coordinator and the messages it sends, on the CPU, without Ray.

Issue 18's goal "plan per decode step, batch unchanged <= 0.3 ms on the client's path" is measured through
the service on the GPU machine (``cp_scaling.py``'s plan_ms_per_step); this splits that cost where it is
made, on the coordinator's own state owners (no actors, no GPU), so a change to planning can be measured on
any machine. Each decode case is one decode run of ``--run-steps`` steps (as a decode loop asks), per step:

- plan: begin_step's checks, page growth and plans (StepLedger.admit + open, then end_step's commits and close)
- messages: pickling and unpickling what Ray carries (each remote shard's plans, the client's reply)
- build: each step's plans built where they arrive (every remote shard's, the client's), as they are reached

The process uses one torch thread, as a Ray actor does (Ray sets OMP_NUM_THREADS=1).

    python benchmarks/plan_cost.py [--cases decode_128k,decode_b64_32k,...] [--json PATH]
    python benchmarks/plan_cost.py --smoke     # tiny shapes in seconds (the test suite runs it)
Prints one table and writes JSON (default benchmarks/results/plan_cost.json).
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from cpattn.config import ServiceConfig


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int
    new: int          # tokens per sequence in the step: 1 = a decode run
    shards: int = 2
    replicas: int = 1
    window: int | None = None   # on every layer: commits give back the pages before it (release_pages_outside_window)


CASES = {c.name: c for c in (
    Case("decode_128k", 1, 131072, 1), Case("decode_1m", 1, 1048576, 1), Case("decode_b64_32k", 64, 32768, 1),
    Case("decode_b64_32k_r2", 64, 32768, 1, shards=3, replicas=2), Case("prefill_32k", 1, 0, 32768),
    Case("chunked_8k_on_512k", 1, 524288, 8192), Case("decode_b64_32k_w4096", 64, 32768, 1, window=4096),
    Case("chunked_8k_on_512k_w4096", 1, 524288, 8192, window=4096))}
SMOKE = {c.name: c for c in (Case("decode_smoke", 1, 300, 1), Case("decode_b4_smoke", 4, 70, 1, shards=3, replicas=2),
                             Case("prefill_smoke", 1, 0, 96),
                             Case("decode_b4_w_smoke", 4, 70, 1, shards=3, replicas=2, window=24))}


def _coordinator(case: Case, run_steps: int, repeats: int):
    from cpattn.cluster.coordinator import Coordinator
    from cpattn.config import ServiceConfig

    # Decode runs grow the sequences run after run; each copy (replicas) needs its own pages.
    grown = case.new * run_steps * (repeats + 2) if case.new == 1 else case.new
    tokens = case.batch * (case.context + grown + 2 * 16 * case.shards) * case.replicas
    cfg = ServiceConfig(num_shards=case.shards, kv_replicas=case.replicas, num_layers=1, num_q_heads=4, num_kv_heads=2,
                        head_size=16, block_size=16, num_blocks_per_shard=2 * tokens // 16 // case.shards + 64,
                        device="cpu", dtype="float32", max_tokens_per_step=1 << 20, max_tokens_per_client=None,
                        max_sequences=max(8, 2 * case.batch), sliding_window=case.window)
    coordinator = Coordinator(cfg)
    client_id = coordinator.clients.check(coordinator.register_client()["credential"])
    return coordinator, client_id


def _filled(coordinator, client_id: str, case: Case) -> list[str]:
    seqs = [coordinator.table.add(client_id, f"s{i}").seq_id for i in range(case.batch)]
    for seq_id in seqs if case.context else ():
        seq, growth, _ = coordinator.ledger.plan_fill(client_id, seq_id, case.context, 1, coordinator.gen)
        coordinator.ledger.commit_fill(seq, case.context, growth)
    return seqs


def measure_step(coordinator, client_id: str, seqs: list[str], case: Case, run_steps: int) -> dict:
    """One begin_step (a decode run of ``run_steps`` steps, or one step) to its close; seconds per step."""
    from cpattn.cluster import decode_run
    from cpattn.cluster.decode_run_plans import RunSteps

    ledger, n = coordinator.ledger, case.shards
    t0 = time.perf_counter()
    admitted = ledger.admit(client_id, {s: case.new for s in seqs}, run_steps if case.new == 1 else 1, 1)
    step, runs = ledger.open(admitted, (), coordinator.gen)
    reply = ledger.reply(step, admitted.seqs, admitted.request, runs, None, coordinator.gen.epoch)
    t1 = time.perf_counter()
    sent = [pickle.dumps(decode_run.shard_plans(runs, r)) for r in range(n)] + [pickle.dumps(reply)]
    received = [pickle.loads(m) for m in sent]
    t2 = time.perf_counter()
    for plan, later in received[:-1]:
        for _ in plan if isinstance(plan, RunSteps) else later:   # a shard builds each step's plan as reached
            pass
    for _ in received[-1].later:
        pass
    t3 = time.perf_counter()
    steps = step.num_substeps
    for j in range(1, steps):
        ledger.advance(step, j)   # a run's commits before its last
    step.done = steps
    ledger.close(step, committed=True)
    t4 = time.perf_counter()
    return {"steps": steps, "plan": (t1 - t0 + t4 - t3) / steps, "messages": (t2 - t1) / steps,
            "build": (t3 - t2) / steps, "bytes": sum(map(len, sent))}


def run_case(case: Case, run_steps: int, repeats: int) -> dict:
    coordinator, client_id = _coordinator(case, run_steps, repeats)
    seqs = _filled(coordinator, client_id, case)
    samples = []
    for i in range(repeats + 2):   # the first two warm up
        if case.new > 1:   # a prefill or a chunk: fresh sequences each time (lengths stay at the case's)
            for s in seqs:
                coordinator.table.free(s, client_id)
            seqs = _filled(coordinator, client_id, case)
        sample = measure_step(coordinator, client_id, seqs, case, run_steps)
        if i >= 2:
            samples.append(sample)
    median = {k: 1e3 * statistics.median(s[k] for s in samples) for k in ("plan", "messages", "build")}
    return {"case": case.name, "batch": case.batch, "context": case.context, "new": case.new, "shards": case.shards,
            "replicas": case.replicas, "steps_per_begin": samples[0]["steps"], "kb_sent": samples[0]["bytes"] / 1e3,
            **{f"{k}_ms_per_step": v for k, v in median.items()}, "total_ms_per_step": sum(median.values()),
            "window": case.window, "blocks_used": sum(coordinator.table.blocks_used())}


HEADER = (f"{'case':>20} {'B':>3} {'shards':>6} {'steps':>5} {'plan':>7} {'messages':>8} {'build':>7} {'total':>7} "
          f"{'kB sent':>8}")


def _fmt(r: dict) -> str:
    return (f"{r['case']:>20} {r['batch']:>3} {r['shards']:>4}x{r['replicas']} {r['steps_per_begin']:>5} "
            f"{r['plan_ms_per_step']:>7.3f} {r['messages_ms_per_step']:>8.3f} {r['build_ms_per_step']:>7.3f} "
            f"{r['total_ms_per_step']:>7.3f} {r['kb_sent']:>8.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--run-steps", type=int, default=ServiceConfig.model_fields["decode_run_steps"].default,
                        help="steps of a decode run (decode_run_steps; default: the service's)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "plan_cost.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repeats: every path in seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # as in the coordinator's actor
    if args.smoke:
        CASES.update(SMOKE)
        args.cases, args.repeats = ",".join(SMOKE), 2
    cases = [CASES[c] for c in args.cases.split(",")]
    print(f"plan_cost: ms per step (a decode run's begin_step serves {args.run_steps} steps), medians of {args.repeats}")
    print(HEADER)
    rows = []
    for case in cases:
        rows.append(run_case(case, args.run_steps, args.repeats))
        print(_fmt(rows[-1]), flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": date.today().isoformat(), "machine": platform.node(), "processor": platform.processor(),
            "torch": torch.__version__, "run_steps": args.run_steps, "repeats": args.repeats}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
