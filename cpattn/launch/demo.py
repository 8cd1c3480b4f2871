"""`cpattn demo`: the main job. An embedded 4-shard service on CPU runs a long-context workload.

Three sequences are prefilled in chunks (one of 8K tokens), then 64 decode steps of mixed batches
run (decodes of every sequence, with a fourth sequence's prefill chunks mixed in). A sample of
outputs is checked against a float64 dense reference; a table reports where the KV lives and where
step time goes.
"""

from __future__ import annotations


import math
import statistics
import time
from typing import TYPE_CHECKING

from cpattn.launch.common import Parser, in_range

if TYPE_CHECKING:   # torch is imported where it runs: a usage error comes back without its ~3 s import
    import torch

PROMPTS = {"A": 8192, "B": 2048, "C": 512}
CHUNK = 1024


def reference(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, context: int) -> torch.Tensor:
    """Dense causal attention in float64, independent of cpattn's kernels."""
    import torch

    q, k, v = q_LQD.double(), k_LKD.double(), v_LKD.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[0])[None, :] > (torch.arange(q.shape[0])[:, None] + context)
    scores = scores.masked_fill(mask, -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


# A demo stays a demo: 8 x the prompts is ~87K tokens (the cache: 2048 pages of 16 tokens per shard; what does
# not fit, with few shards or many decode steps, the service refuses with CapacityError, one line).
MAX_SCALE = 8.0


def build_parser() -> Parser:
    parser = Parser(prog="cpattn demo", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4, help="shards of the embedded service (default: 4)")
    parser.add_argument("--layers", type=int, default=4, help="attention layers per step (default: 4)")
    parser.add_argument("--decode-steps", type=in_range(int, 0, 100_000), default=64,
                        help="decode steps after the prefills (default: 64)")
    parser.add_argument("--scale", type=in_range(float, 0.001, MAX_SCALE), default=1.0,
                        help=f"multiply prompt lengths, up to {MAX_SCALE:g} (e.g. 0.25 for a quick run)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random q/k/v (default: 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    import cpattn
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    hq, hk, d = 8, 2, 64
    cfg = cpattn.ServiceConfig(num_shards=args.shards, num_layers=args.layers, num_q_heads=hq, num_kv_heads=hk,
                               head_size=d, block_size=16, dtype="float32", num_blocks_per_shard=2048,
                               pcp_min_tokens=512, name="cpattn-demo")
    import torch   # after the checks above: a usage or config error comes back at once

    torch.manual_seed(args.seed)
    prompts = {name: max(1, int(n * args.scale)) for name, n in PROMPTS.items()}
    print(f"cpattn demo: {cfg.num_shards} shards on CPU, {cfg.num_layers} layers, Hq {hq} / Hk {hk} / D {d}, "
          f"prompts {prompts}, {args.decode_steps} decode steps")
    t_start = time.perf_counter()
    svc = cpattn.start(cfg)
    try:
        backend = svc.info()["shards"][0]
        print(f"service up in {time.perf_counter() - t_start:.1f}s, backend {backend['backend']} "
              f"({backend['kernel_version']}), LSE base {backend['lse_base']}")
        ids = {name: svc.add_sequence() for name in list(prompts) + ["D"]}
        history: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        timings: list[dict[str, float]] = []
        max_err = 0.0
        checked = 0

        def run_step(request: dict[str, int], check: bool) -> None:
            nonlocal max_err, checked
            total = sum(request.values())
            t0 = time.perf_counter()
            with svc.step({ids[n]: c for n, c in request.items()}) as step:
                for layer in range(cfg.num_layers):
                    q = torch.randn(total, hq, d)
                    k, v = torch.randn(total, hk, d), torch.randn(total, hk, d)
                    out = step.attend(layer, q, k, v)
                    start = 0
                    for name, count in request.items():
                        k0, v0 = history.get((name, layer), (torch.zeros(0, hk, d), torch.zeros(0, hk, d)))
                        kk, vv = torch.cat([k0, k[start:start + count]]), torch.cat([v0, v[start:start + count]])
                        history[(name, layer)] = (kk, vv)
                        if check and layer in (0, cfg.num_layers - 1):
                            ref = reference(q[start:start + count], kk, vv, k0.shape[0])
                            max_err = max(max_err, float((out[start:start + count].double() - ref).abs().max()))
                            checked += count
                        start += count
            # The step's own dict: attention_s joins it when the commit is read (the client's next call).
            step.timings.update(total_s=time.perf_counter() - t0, tokens=total)
            timings.append(step.timings)

        plan = []
        for name, n in prompts.items():
            for s in range(0, n, CHUNK):
                plan.append(({name: min(CHUNK, n - s)}, s + CHUNK >= n))
        d_chunks = iter(range(0, 4 * 128, 128))
        for i in range(args.decode_steps):
            request = {name: 1 for name in prompts}
            if i % 16 == 0 and next(d_chunks, None) is not None:
                request["D"] = 128
            plan.append((request, i % 8 == 0 or i == args.decode_steps - 1))
        for request, check in tqdm(plan, desc="steps", unit="step"):
            run_step(request, check)

        stats = svc.stats()
        print()
        print(f"{'shard':>5} {'device':>6} {'tokens':>8} {'blocks used':>11} {'blocks free':>11} {'KV bytes':>12}")
        for s in stats["shards"]:
            print(f"{s['rank']:>5} {s['device']:>6} {s['tokens']:>8} {s['blocks_used']:>11} {s['blocks_free']:>11} "
                  f"{s['bytes']:>12,}")
        print()
        decode = [t for t in timings if t["tokens"] <= len(prompts) + 128]
        prefill = [t for t in timings if t not in decode]
        print(f"{'steps':>14} {'n':>4} {'plan ms':>8} {'data plane ms':>13} {'attention ms':>12} {'total ms':>9}")
        for label, rows in (("prefill chunks", prefill), ("decode (mixed)", decode)):
            if rows:
                med = {key: 1e3 * statistics.median(r[key] for r in rows)
                       for key in ("plan_s", "data_plane_s", "attention_s", "total_s")}
                print(f"{label:>14} {len(rows):>4} {med['plan_s']:>8.2f} {med['data_plane_s']:>13.2f} "
                      f"{med['attention_s']:>12.2f} {med['total_s']:>9.2f}")
        print("(medians per step over all layers; data plane = broadcast + shard compute + partials back + merge "
              "as the client sees it, attention = slowest shard's kernel time)")
        ok = max_err < 1e-4
        print(f"\ncheck vs float64 reference: {checked} token-rows, max abs error {max_err:.2e} "
              f"({'OK' if ok else 'FAILED'}); total {time.perf_counter() - t_start:.1f}s")
        return 0 if ok else 1
    finally:
        svc.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
