"""Issue 24's prefix pass on one GPU: N forks' queries over a shared prefix vs one B=1 decode over the same pages.

The cascade's prefix pass (attention/cascade_plan.py) runs every fork's query over the shared prefix as one query
group (TRITON: triton_query_groups.py, the decode kernel with N x G rows per program). It reads the same bytes as one
decode, so it should cost about one decode; issue 24 measured 16 forks' layers at ~1.7x one question's. This sweep
times, on one GPU over the prefix one GPU holds of a 512K document (256K keys, Hq 32, Hk 8, D 128, pages of 16,
bf16, outlier data; CUDA graphs, CUDA events):
- ``decode``: one question's B=1 decode (today's decode configuration);
- ``legacy``: the pass as before this change (q gathered into one virtual token of N x G heads, outputs transposed
  back: four copies around the kernel), today's configuration;
- ``pass``: the pass now (rows addressed in the kernel, partials merged in place) under each candidate of
  triton_decode.CONFIG_OVERRIDES["query_groups"] (tile length, warps, stages, prefetch, page-wise loads, waves),
  staged within ``--seconds``;
- ``layer``: what a layer adds for the forks with the winner: the pass as a shard runs it (its q read in place, its
  split partials merged into the suffix pass's rows in one launch: triton_query_groups.into_step_rows).
Every output is checked against float64 (rel < 1e-2). Prints the winner, its ratio to the decode (goal ~1x), the
line to paste, and writes JSON (default benchmarks/results/prefix_pass_sweep.json).

    python benchmarks/prefix_pass_sweep.py [--questions 16] [--prefix-keys 262144] [--seconds 100] [--json PATH]
    TRITON_INTERPRET=1 python benchmarks/prefix_pass_sweep.py --smoke --json PATH   # every path, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_sweep_common import (ACT, D, DEVICE, HK, HQ, RESULTS, Budget, config_line,  # noqa: E402
                                 device_name, float64_attention, new_kernel_stats, paged_case, rel, time_graph,
                                 try_candidate)

BF16_BOUND = 1e-2


def legacy_pass(groups, q_TQD, k_cache, v_cache, block_table, scale, out_TQD, lse_TQ) -> None:
    """The query groups' pass before the kernel addressed rows itself (triton_query_groups.py until 2026-12-01):
    a request's n queries as one virtual token of n x G heads per kv head, outputs transposed back."""
    from cpattn.attention.backends.triton_decode import paged_decode

    hq, d = q_TQD.shape[1:]
    g = hq // HK
    for grp in groups:
        r = grp.req.numel()
        rows = (grp.first_tok.long()[:, None] + torch.arange(grp.n, device=q_TQD.device)).flatten()
        q_virtual = q_TQD.index_select(0, rows).view(r, grp.n, HK, g, d).transpose(1, 2).reshape(r, HK * grp.n * g, d)
        out_v = torch.empty(r, HK * grp.n * g, d, dtype=out_TQD.dtype, device=out_TQD.device)
        lse_v = torch.empty(r, HK * grp.n * g, dtype=torch.float32, device=out_TQD.device)
        tok = torch.arange(r, dtype=torch.int32, device=q_TQD.device)
        paged_decode(q_virtual.contiguous(), k_cache, v_cache, block_table, tok, grp.req, grp.kv_len, grp.splits,
                     scale, out_v, lse_v, all_rows=True)
        out_TQD.index_copy_(0, rows, out_v.view(r, HK, grp.n, g, d).transpose(1, 2).reshape(r * grp.n, hq, d))
        lse_TQ.index_copy_(0, rows, lse_v.view(r, HK, grp.n, g).transpose(1, 2).reshape(r * grp.n, hq))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--prefix-keys", type=int, default=262144, help="keys of the prefix on this GPU")
    parser.add_argument("--seconds", type=float, default=100.0, help="wall-time budget (setup and candidates)")
    parser.add_argument("--json", default=str(RESULTS / "prefix_pass_sweep.json"))
    parser.add_argument("--smoke", action="store_true", help="a 512-key prefix, 30 s (CPU, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.smoke:
        args.prefix_keys, args.seconds = 512, 30.0
    from cpattn.attention.backends import triton_decode as tk
    from cpattn.attention.backends import triton_query_groups as tq

    budget = Budget(args.seconds)
    dev = DEVICE
    n, keys, scale = args.questions, args.prefix_keys, D ** -0.5
    case = paged_case(1, keys, dev)
    q1 = torch.randn(1, HQ, D, device=dev).to(ACT)
    qn = torch.randn(n, HQ, D, device=dev).to(ACT)
    ref1, refn = float64_attention(q1, case), float64_attention(qn, case, [0] * n)
    k_cache, v_cache = case.cache[0], case.cache[1]
    saved = dict(tk.CONFIG_OVERRIDES)
    tk.CONFIG_OVERRIDES["query_groups"] = {}
    base = tk.decode_config(query_groups=True)

    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.full((1,), keys, dtype=torch.int32, device=dev)
    out1, lse1 = torch.empty(1, HQ, D, dtype=ACT, device=dev), torch.empty(1, HQ, device=dev)
    splits1 = tk.decode_num_splits(1, HK, keys, dev)
    decode_ms = time_graph(lambda: tk.paged_decode(q1, k_cache, v_cache, case.table, idx, idx, lens, splits1, scale,
                                                   out1, lse1, all_rows=True))
    decode_rel = rel(out1, ref1)
    outn, lsen = torch.empty(n, HQ, D, dtype=ACT, device=dev), torch.empty(n, HQ, device=dev)

    def groups():
        return tq.plan_query_groups([0, n], [n], [keys], [0], HK, dev)

    legacy = functools.partial(legacy_pass, groups(), qn, k_cache, v_cache, case.table, scale, outn, lsen)
    legacy_ms = time_graph(legacy)
    legacy_rel = rel(outn, refn)
    print(f"B=1 decode over {keys} keys: {decode_ms:.3f} ms (rel {decode_rel:.1e}, splits {splits1}); {n} queries' "
          f"pass before this change: {legacy_ms:.3f} ms ({legacy_ms / decode_ms:.2f}x, rel {legacy_rel:.1e}) "
          f"[{budget.elapsed():.0f} s]", flush=True)

    def measure(cfg: dict) -> dict:
        tk.CONFIG_OVERRIDES["query_groups"] = {k: v for k, v in cfg.items() if base.get(k) != v}
        grp = groups()
        ms = time_graph(lambda: tq.attend_query_groups(grp, qn, k_cache, v_cache, case.table, scale, outn, lsen))
        err = rel(outn, refn)
        return dict(ms=ms, over_decode=ms / decode_ms, rel=err, splits=grp[0].splits, valid=err < BF16_BOUND)

    rows, seen = [], set()
    print("kernels so far (decode, legacy pass):", new_kernel_stats(tk._paged_decode_kernel, seen))

    def stage(configs):
        for cfg in configs:
            if (rows and budget.left() < 6) or any(r["cfg"] == cfg for r in rows):   # today's always
                continue
            rows.append(dict(try_candidate(measure, cfg), kernels=new_kernel_stats(tk._paged_decode_kernel, seen)))
            print("   ", _row_text(rows[-1]), rows[-1]["kernels"], f"[{budget.elapsed():.0f} s]", flush=True)

    def best() -> dict:
        ok = [r for r in rows if r.get("valid")]
        return min(ok, key=lambda r: r["ms"]) if ok else dict(cfg=base)

    stage([base] + [dict(base, block_n=bn, num_warps=w, num_stages=st)
                    for bn, w, st in ((64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (32, 4, 2), (128, 4, 2),
                                      (64, 8, 3), (32, 8, 2), (128, 8, 3))])
    top = best()["cfg"]
    stage([dict(top, prefetch=f, page_tiles=p) for f, p in ((True, False), (False, True), (True, True))])
    top = best()["cfg"]
    stage([dict(top, waves=w) for w in (1, 4, 8)] + [dict(top, num_stages=1)])
    win = best()
    layer = {}
    if "ms" in win:   # the forks' whole prefix work in a layer: the pass and its one merge into the suffix rows
        tk.CONFIG_OVERRIDES["query_groups"] = {k: v for k, v in win["cfg"].items() if base.get(k) != v}
        grp, rows_dev = tq.into_step_rows(groups(), torch.arange(n), dev), torch.arange(n, device=dev)
        suffix_out, suffix_lse = torch.randn(n, HQ, D, device=dev).to(ACT), torch.randn(n, HQ, device=dev)

        def layer_fn():   # merges into the suffix rows in place: replays keep merging (the time is the same)
            tq.attend_query_groups(grp, qn, k_cache, v_cache, case.table, scale, suffix_out, suffix_lse,
                                   rows_R=rows_dev)

        layer = dict(ms=time_graph(layer_fn))
        layer["over_decode"] = layer["ms"] / decode_ms
    tk.CONFIG_OVERRIDES.clear()
    tk.CONFIG_OVERRIDES.update(saved)
    line = config_line("query_groups", win["cfg"], base)
    print(f"winner ({len(rows)} candidates in {budget.elapsed():.0f} s): {_row_text(win)}")
    if layer:
        print(f"a layer's prefix work with it (pass + one merge): {layer['ms']:.3f} ms "
              f"({layer['over_decode']:.2f}x the decode; before: pass alone {legacy_ms / decode_ms:.2f}x)")
    print("adopt: in cpattn/attention/backends/triton_decode.py CONFIG_OVERRIDES, replace the \"query_groups\" "
          "line with")
    print(line)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=device_name(),
                                   torch=torch.__version__, questions=n, prefix_keys=keys, decode_ms=decode_ms,
                                   decode_rel=decode_rel, legacy_ms=legacy_ms, legacy_rel=legacy_rel, base=base,
                                   rows=rows, winner=win, layer=layer, adopt_line=line), indent=1, default=str))
    print("wrote", out)
    return 0


def _row_text(row: dict) -> str:
    cfg = {k: row["cfg"][k] for k in ("block_n", "num_warps", "num_stages", "waves", "prefetch", "page_tiles")}
    if "error" in row:
        return f"{cfg} error {row['error']}"
    if "ms" not in row:
        return f"{cfg} (no valid candidate)"
    return (f"{cfg} {row['ms']:.3f} ms ({row['over_decode']:.2f}x the decode, splits {row['splits']}, "
            f"rel {row['rel']:.1e}){'' if row['valid'] else ' INVALID'}")


if __name__ == "__main__":
    raise SystemExit(main())
