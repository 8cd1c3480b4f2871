"""A decode's own token is attended in the context pass of the rank that stores it (no causal pass, no merge).

The planner folds every one-token request into its owner's context pass (write K/V first, then attend over
local context + 1); these tests run the service's data path without Ray (planner, shard workers, runner,
row merge) on random shapes and compare every layer with the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.kvstore import dcp_local_seq_lens, dcp_owner_rank
from test_fp8_kv_cache import InProcessService, _oracle


def _config(num_shards, interleave, hq, hk, **kw):
    base = dict(num_shards=num_shards, num_layers=2, num_q_heads=hq, num_kv_heads=hk, head_size=8, block_size=4,
                dtype="float64", num_blocks_per_shard=96, pcp_min_tokens=6, dcp_interleave=interleave)
    base.update(kw)
    return ServiceConfig(**base)


def _layers(cfg, t, g):
    return [tuple(torch.randn(t, h, cfg.head_size, generator=g, dtype=torch.float64)
                  for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads)) for _ in range(cfg.num_layers)]


@pytest.mark.parametrize("seed", range(8))
def test_folded_decodes_match_float64(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    n = [1, 2, 3, 5][seed % 4]
    interleave = [1, 4, 2, 1][(seed // 2) % 4]
    hq, hk = [(4, 2), (6, 1), (4, 4)][seed % 3]
    window = [None, None, 9][seed % 3]
    cfg = _config(n, interleave, hq, hk, sliding_window=[None, window])
    svc = InProcessService(cfg)
    seqs = [svc.add() for _ in range(int(torch.randint(1, 5, (), generator=g)))]
    history = {}
    sinks = [None] * cfg.num_layers
    # Prefill random lengths (some empty: the first decode of a sequence has no context anywhere).
    prefill = {s: int(torch.randint(0, 23, (), generator=g)) for s in seqs}
    prefill = {s: c for s, c in prefill.items() if c}
    steps = ([prefill] if prefill else []) + [{s: 1 for s in seqs} for _ in range(3)]
    steps.append({s: (1 if i % 2 else int(torch.randint(2, 9, (), generator=g))) for i, s in enumerate(seqs)})
    steps.append({s: 1 for s in seqs})
    for request in steps:
        t = sum(request.values())
        layers = _layers(cfg, t, g)
        expected = _oracle(cfg, history, request, layers, sinks)
        got = svc.step(request, layers, sinks)
        for layer, (o, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(o, e, atol=1e-10, rtol=1e-10, msg=f"layer {layer} of {request}")


def test_decode_plan_has_no_causal_pass_and_the_owner_reads_its_token():
    cfg = _config(3, 2, 4, 2)
    svc = InProcessService(cfg)
    a, b = svc.add(), svc.add()
    svc.step({a: 7, b: 2}, _layers(cfg, 9, torch.Generator().manual_seed(0)), [None, None])
    reqs = [StepRequest(svc.rows[a], 7, 1), StepRequest(svc.rows[b], 2, 1)]
    svc.alloc.grow([(svc.rows[a], 8), (svc.rows[b], 3)])
    plans = plan_step(svc.alloc, reqs, 99, True, cfg.pcp_min_tokens)
    for rank, plan in enumerate(plans):
        assert plan.causal_pieces.numel() == 0
        before = dcp_local_seq_lens(torch.tensor([7, 2]), 3, rank, 2)
        owns = dcp_owner_rank(torch.tensor([7, 2]), 3, 2) == rank
        assert plan.metadata.seq_lens_cpu.tolist() == (before + owns.long()).tolist()
        assert plan.metadata.context_lens_cpu.tolist() == before.tolist()
