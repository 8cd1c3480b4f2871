"""The TRITON decode kernel's launch variants (triton_decode.DECODE_CONFIG / CONFIG_OVERRIDES: page-wise tile loads,
software prefetch, float16 dots, tile length, split factor) against float64, through Triton's interpreter on the CPU.

Every variant the sweeps (benchmarks/triton_decode_sweep.py --fp8-sweep, benchmarks/prefix_pass_sweep.py) may pick
is checked here on decodes that split KV (small tiles, one tile per split at least), on DCP context passes whose
few-query requests run as query groups, and on a forked decode step's prefix pass (a group covering the whole step:
its split partials merge in place), fp16 and fp8 caches alike.
    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch, triton> -m pytest tests/test_triton_decode_variants_interpret.py
"""

from __future__ import annotations

import os

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

from cpattn.attention.backends import triton_decode                                      # noqa: E402
from cpattn.attention.backends.triton_attn import TritonAttentionBackend                # noqa: E402
from tests.kernel_feature_cases import outlier_batch, rel, run_case                      # noqa: E402
from tests.test_triton_interpret import FP8_BOUND, KERNEL_TOL                            # noqa: E402

SPLITTING = dict(block_n=16, min_tiles=1)   # the test's short contexts still split KV into several partials
SHAPE = ([1, 6, 1, 3], [90, 70, 130, 0])     # decodes and query groups (6 and 3 queries) on each of 2 shards
VARIANTS = {
    "page_tiles": dict(page_tiles=True),
    "prefetch": dict(prefetch=True),
    "page_tiles_prefetch_f16": dict(page_tiles=True, prefetch=True, fp8_f16_dot=True),
    "block_32_split_x2": dict(block_n=32, split_factor=2, num_warps=8, num_stages=2),
    "split_half": dict(split_factor=0.5, page_tiles=True),
    "v_scaled": dict(fp8_v_scaled=True, page_tiles=True),
    "v_scaled_f16": dict(fp8_v_scaled=True, fp8_f16_dot=True, prefetch=True),
    # triton_decode_heads.py (fp8 decodes; the query groups keep the one-head kernel): both kv heads in one program
    "heads_f16": dict(heads_per_program=8, block_n=32, num_warps=2, fp8_f16_dot=True),
    # launch_splits doubling S (the fp8 override's fill_splits), the one-head and the heads kernel's grids
    "fill_splits": dict(fill_splits=True),
    "heads_f16_fill_splits": dict(heads_per_program=8, block_n=32, num_warps=2, fp8_f16_dot=True, fill_splits=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_variant_vs_float64(variant, fmt, monkeypatch):
    """The variant as the fp8 cache's or the query groups' override (each case's config applied where it belongs):
    decodes that split KV and few-query requests as query groups, on 2 DCP shards, vs TORCH float64."""
    monkeypatch.setattr(triton_decode, "DECODE_CONFIG", dict(triton_decode.DECODE_CONFIG, **SPLITTING))
    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": dict(VARIANTS[variant]),
                                                            "query_groups": dict(VARIANTS[variant])})
    if fmt is None:   # fp16 cache: only the query groups' override applies, so the plain decode path runs too
        monkeypatch.setitem(triton_decode.DECODE_CONFIG, "prefetch", variant == "prefetch")
    b = outlier_batch(*SHAPE, 8, 2, 32, 16, torch.float16, "cpu", seed=11)
    (out, lse), (same, same_lse), (exact, _) = run_case(TritonAttentionBackend, b, None, None, fmt, "cpu", 2, 16)
    assert rel(out, same) < KERNEL_TOL
    finite = ~same_lse.isinf()
    assert torch.equal(lse.isinf(), ~finite) and float((lse - same_lse)[finite].abs().max()) < 1e-3
    assert rel(out, exact) < (KERNEL_TOL if fmt is None else FP8_BOUND[fmt])


def test_page_tiles_fall_back_under_windows_and_odd_pages():
    """page_tiles needs tiles that start on pages: a window (first key anywhere) runs the per-key loads, and the
    result equals the default's bit for bit."""
    from cpattn.attention.backends.triton_decode import paged_decode

    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 40, 16, 2, 32, generator=g).half()
    q = torch.randn(1, 8, 32, generator=g).half()
    table = torch.randperm(40, generator=g)[None]
    idx = torch.zeros(1, dtype=torch.int32)
    lens, start = torch.tensor([600], dtype=torch.int32), torch.tensor([77], dtype=torch.int32)
    outs = []
    for page_tiles in (False, True):
        cfg = dict(triton_decode.DECODE_CONFIG, page_tiles=page_tiles, **SPLITTING)
        out, lse = torch.empty(1, 8, 32).half(), torch.empty(1, 8)
        old = triton_decode.DECODE_CONFIG
        triton_decode.DECODE_CONFIG = cfg
        try:
            paged_decode(q, cache[0], cache[1], table, idx, idx, lens, 4, 32 ** -0.5, out, lse, all_rows=True,
                         key_start=start)
        finally:
            triton_decode.DECODE_CONFIG = old
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("variant", ["page_tiles_prefetch_f16", "block_32_split_x2"])
def test_prefix_pass_variants_replay_the_eager_cascade_step(variant, monkeypatch):
    """A forked decode step's prefix pass (one query group = the whole pass: partials merged in place) under the
    variant, graphed vs eager vs float64 (tests/test_cascade_graphs_interpret.py's check)."""
    from tests.test_cascade_graphs_interpret import test_graph_buffers_replay_the_eager_cascade_step as check

    monkeypatch.setattr(triton_decode, "DECODE_CONFIG", dict(triton_decode.DECODE_CONFIG, **SPLITTING))
    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": {}, "query_groups": dict(VARIANTS[variant])})
    check(2, 16)


def test_config_overrides_apply_per_case(monkeypatch):
    monkeypatch.setattr(triton_decode, "CONFIG_OVERRIDES", {"fp8": dict(block_n=64, split_factor=2),
                                                            "query_groups": dict(num_warps=8)})
    assert triton_decode.decode_config() == triton_decode.DECODE_CONFIG
    assert triton_decode.decode_config(fp8=True)["block_n"] == 64
    both = triton_decode.decode_config(fp8=True, query_groups=True)
    assert (both["block_n"], both["num_warps"]) == (64, 8)
    assert [triton_decode.launch_splits(s, both) for s in (1, 32, 256)] == [2, 64, 256]
    assert triton_decode.launch_splits(1, dict(split_factor=0.5)) == 1


def test_fill_splits_doubles_only_a_floor_limited_plan():
    """fill_splits: S x 2 where S > 1 and 2 S programs fit in half the target (waves x 132 SMs on the CPU), never
    otherwise: not a single split (its direct write), not a plan that already fills the GPU."""
    cfg = dict(triton_decode.DECODE_CONFIG, fill_splits=True)
    cpu = torch.device("cpu")
    assert triton_decode.launch_splits(4, cfg, 8, cpu) == 8        # B=1 x 8 kv heads at 4,096 keys
    assert triton_decode.launch_splits(1, cfg, 8, cpu) == 1        # a short context keeps its one split
    assert triton_decode.launch_splits(32, cfg, 8, cpu) == 32      # 1M keys: 256 programs already
    assert triton_decode.launch_splits(2, cfg, 512, cpu) == 2      # B=64
    assert triton_decode.launch_splits(4, dict(cfg, fill_splits=False), 8, cpu) == 4
    assert triton_decode.launch_splits(4, cfg) == 4                # no programs given: the plan's S
