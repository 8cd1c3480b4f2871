"""Opening a decode run's later step on the client (issue 18): the in-process shard's plan hands its builder the
step's own host index tensors (no device copies made for it, so no blocking copy or read back per step: the GPU
side is tests/gpu/test_begin_syncs_gpu.py) and the run's one block table, copied once; the builder's metadata is
the one planned from ``md.to(device)`` before; StepRun times its opening by phase."""

from __future__ import annotations

import dataclasses

import torch

from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.cluster.client_run import BegunStep, Phases
from cpattn.cluster.decode_run_plans import plan_decode_run
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import table_gatherer
from cpattn.config import ServiceConfig
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

BLOCK = 4


def _run(lengths: list[int], steps: int):
    alloc = ShardedKVAllocator(1, 256, BLOCK, 1, max_rows=8)
    rows = [alloc.add_rows() for _ in lengths]
    alloc.finish(alloc.grow([(r, n) for r, n in zip(rows, lengths)], [0] * len(rows)))
    growths = grow_decode_run(alloc, rows, lengths, steps, first_step=0)
    return plan_decode_run(alloc, rows, lengths, list(range(steps)), table_gatherer(alloc, rows, {}), 0, None, None,
                           growths[0], False, 8)


def test_the_builder_plans_from_the_steps_host_tensors_and_the_runs_kept_table():
    cfg = ServiceConfig(num_shards=1, num_layers=1, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=BLOCK,
                        num_blocks_per_shard=256, device="cpu", dtype="float32", backend="TORCH")
    runner = ShardLayerRunner(cfg, TorchReferenceBackend, [torch.zeros(2, 256, BLOCK, 2, 8)], torch.device("cpu"))
    seen = []
    build = runner.builder.build
    runner.builder.build = lambda prefix_len, md: seen.append(md) or build(prefix_len, md)
    runs = _run([37, 5, 90], 5)
    copies = []
    to_device = runner._device_tables
    for j in range(5):
        plan = runs.ranks[0].plan(j)
        md = plan.metadata
        planned = runner.plan(plan)
        got = seen[-1]
        # The builder got the plan's own host tensors (nothing copied for them) and the table's kept copy.
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "seq_lens_cpu", "query_start_loc_cpu"):
            assert getattr(got, name) is getattr(md, name), name
        assert got.block_table_cpu is runs.ranks[0].table and len(to_device) == 1
        copies.append(next(iter(to_device.values()))[1])
        # ... and plans what it planned from md.to(device)
        again = build(0, md.to(runner.device))
        for f in dataclasses.fields(again):
            x, y = getattr(again, f.name), getattr(planned.attn_metadata, f.name)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name
    assert all(c is copies[0] for c in copies)   # the run's one table: one copy for all its steps


def test_phases_charge_each_interval_once():
    import time

    t0 = time.perf_counter()
    phases = Phases()
    assert phases.mark("a", 7) == 7
    time.sleep(0.01)
    phases.mark("b")
    phases.mark("a")
    elapsed = time.perf_counter() - t0
    assert set(phases) == {"a", "b"} and all(v >= 0 for v in phases.values())
    assert 0.01 <= phases["b"] and sum(phases.values()) <= elapsed   # the intervals tile the time, none twice
    assert BegunStep(1, 1, [], 0.0, None).parts == {}
