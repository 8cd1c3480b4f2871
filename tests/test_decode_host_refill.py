"""A decode run's later steps fill the captured graphs' buffers from the host (DecodeGraphs.prepare_from_host, issue 18:
~15 device copies and fills per step became two): the buffers then hold exactly what building the step's plan and
refilling from it put there (prepare), for random runs (fresh seeds, random lengths, odd shard counts, interleave 1
and 16, GQA, kv_replicas 2, dynamic fp8 scales, sliding windows), and a step outside the captured bucket (more
splits, a wider table) takes the planned path. TRITON's builder plans on the CPU where triton imports; no kernel runs and nothing is
captured here (graphs.key is set as a capture would): tests/gpu/test_decode_graphs_gpu.py replays the graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()

from cpattn.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from cpattn.cluster.decode_graphs import DecodeGraphs  # noqa: E402
from cpattn.cluster.decode_run_plans import plan_decode_run  # noqa: E402
from cpattn.cluster.layer_runner import ShardLayerRunner  # noqa: E402
from cpattn.cluster.step_planner import table_gatherer  # noqa: E402
from cpattn.config import ServiceConfig  # noqa: E402
from cpattn.kvstore.run_growth import grow_decode_run  # noqa: E402
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator  # noqa: E402

BLOCK, BLOCKS = 16, 4096
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _runner(shards: int, replicas: int, kv: str, window: int | None = None) -> ShardLayerRunner:
    cfg = ServiceConfig(num_shards=shards, num_layers=1, num_q_heads=8, num_kv_heads=2, head_size=16,
                        block_size=BLOCK, num_blocks_per_shard=BLOCKS, device=DEVICE.type, dtype="bfloat16",
                        backend="TRITON", kv_replicas=replicas, kv_cache_dtype=kv, sliding_window=window)
    fp8 = kv != "auto"
    cache = torch.zeros(2, BLOCKS, BLOCK, 2, 16, device=DEVICE, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scales = [torch.ones(2, BLOCKS, 2, device=DEVICE)] if fp8 else None
    return ShardLayerRunner(cfg, TritonAttentionBackend, [cache], DEVICE, scales)


def _decode_run(rng: random.Random, shards: int, interleave: int, replicas: int, steps: int, short: bool = True):
    """A decode run of random sequences (``short``: some without keys on some shards)."""
    alloc = ShardedKVAllocator(shards, BLOCKS, BLOCK, interleave, max_rows=16, replicas=replicas)
    lengths = [rng.choice([0, 1, rng.randrange(1, 40), rng.randrange(200, 3000)]) if short else rng.randrange(64, 3000)
               for _ in range(rng.randrange(1, 6))]
    rows = [alloc.add_rows() for _ in lengths]
    alloc.finish(alloc.grow([(r, n) for r, n in zip(rows, lengths)], [0] * len(rows)))
    growths = grow_decode_run(alloc, rows, lengths, steps, first_step=0)
    return plan_decode_run(alloc, rows, lengths, list(range(steps)), table_gatherer(alloc, rows, {}), 0, None, None,
                           growths[0], False, 8)


def _planned_buffers(runner: ShardLayerRunner, graphs: DecodeGraphs, plan) -> dict:
    """What the planned path puts in the buffers: build the step's plan, then prepare (capturing nothing: the
    bucket's buffers are made as a capture would make them)."""
    md = runner._to_device(plan.metadata)
    attn_md = runner.builder.build(0, md)
    replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(DEVICE)
    assert graphs.prepare(attn_md, replica, plan.causal_pieces, None)
    return _buffers(graphs, attn_md.block_table.shape[1])


@pytest.fixture(autouse=True)
def no_capture(monkeypatch):
    """A "capture" makes the bucket's buffers and keys them, as DecodeGraphs._capture does, without CUDA graphs."""
    def capture(self, attn_metadata, key, prefix_pass=None):
        self.make_buffers(attn_metadata, key, prefix_pass)
        self.key = key

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)


def _buffers(graphs: DecodeGraphs, width: int) -> dict:
    s = graphs.static
    out = {"slots": s.slot_mapping, "kv_len": s.dec_kv_len, "table": s.block_table[:, :width],
           "dec_tok": s.dec_tok, "dec_req": s.dec_req}
    for w, (tok_starts, dec_starts, _) in s.window_starts.items():
        out[f"window{w}_tok"], out[f"window{w}_dec"] = tok_starts, dec_starts
    if graphs.replica is not None:
        out["replica"] = graphs.replica
    for i, w in enumerate(graphs.written or ()):
        out[f"written{i}"] = w
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(4)])
@pytest.mark.parametrize("shards, interleave, replicas, kv, window", [
    (1, 1, 1, "auto", None), (3, 1, 1, "auto", None), (3, 16, 2, "auto", None), (2, 16, 2, "fp8_e4m3", None),
    (1, 1, 1, "auto", 300), (3, 16, 1, "fp8_e4m3", 1000)])
def test_later_steps_fill_the_buffers_the_planned_path_fills(seed, shards, interleave, replicas, kv, window):
    rng = random.Random(seed)
    steps = rng.randrange(3, 40)
    runs = _decode_run(rng, shards, interleave, replicas, steps)
    for rank in range(shards):
        fast, planned = _runner(shards, replicas, kv, window), _runner(shards, replicas, kv, window)
        fast_graphs, planned_graphs = DecodeGraphs(fast), DecodeGraphs(planned)
        from_host = 0
        for j in range(steps):
            plan = runs.ranks[rank].plan(j)
            step_graphed = plan.rows is None and not plan.causal_pieces.numel()
            captured = fast_graphs.key
            step = fast.plan(plan, fast_graphs)
            if not step_graphed:   # a rank that computes some rows only: eager on both paths
                assert step.graphs is None and step.attn_metadata is not getattr(fast_graphs, "static", None)
                continue
            want = _planned_buffers(planned, planned_graphs, plan)
            assert step.graphs is fast_graphs
            taken = step.attn_metadata is fast_graphs.static
            # from the host exactly when the step's bucket (the planned path's) is the one captured; else planned
            # (the run's first step, or splits or the table's width grew) and "captured" anew
            assert taken == (planned_graphs.key == captured), (seed, rank, j)
            got = _buffers(fast_graphs, want["table"].shape[1])
            from_host += taken
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (seed, rank, j, name)
        graphed = sum(runs.ranks[rank].rows(j) is None for j in range(steps))
        assert from_host >= graphed - 3, (seed, rank, from_host, graphed)   # a run changes bucket rarely


def test_a_step_outside_the_bucket_is_planned():
    """More splits or a wider table than the captured bucket: prepare_from_host refuses and changes nothing."""
    runs = _decode_run(random.Random(3), 1, 1, 1, 2)
    runner = _runner(1, 1, "auto")
    graphs = DecodeGraphs(runner)
    plan = runs.ranks[0].plan(0)
    _planned_buffers(runner, graphs, plan)
    before = _buffers(graphs, 1)
    t, splits, width = graphs.key[:3]
    for other in ((t, splits * 2, width), (t, splits, width * 2)):
        graphs.key = other + graphs.key[3:]
        md = runner._to_device(runs.ranks[0].plan(1).metadata)
        assert not graphs.prepare_from_host(md, md.block_table_tensor, None)
        after = _buffers(graphs, 1)
        assert all(torch.equal(before[k], after[k]) for k in before)
