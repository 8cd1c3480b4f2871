"""A decode run planned all at once (cluster/decode_run_plans.py) equals its steps planned one by one
(step_planner.plan_step), field for field: random shard counts, interleaves, replicas, windows, batches."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch

from cpattn.cluster.decode_run import client_steps, later_plans
from cpattn.cluster.decode_run_plans import plan_decode_run
from cpattn.cluster.messages import StepPlans
from cpattn.cluster.step_planner import StepRequest, for_client, plan_step, table_gatherer
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator


def _same(a, b, where: str) -> None:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b), (where, a, b)
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (where, a, b)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("seed", range(12))
def test_run_plans_equal_step_by_step_plans(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 5])
    block_size = rng.choice([4, 16])
    _check_run(n, block_size, rng.choice([1, 3, block_size]), 2 if n >= 2 and rng.random() < 0.5 else 1,
               [rng.choice([0, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 4))], rng.randint(1, 9),
               rng.choice([None, 5, 64]))


def test_run_plans_with_rows_left_out_and_replicas():
    """A sequence starting empty and a short window: ranks without keys for a row leave it out (rows), and
    every rank keeps a replica's slots."""
    got = _check_run(3, 4, 1, 2, [0, 100, 7], 6, 5)
    assert any(p.rows is not None for s in got for p in s)
    assert all(p.replica_slot_mapping is not None for s in got for p in s)


def _check_run(n, block_size, interleave, replicas, lengths, num_steps, window):
    alloc = ShardedKVAllocator(n, 400, block_size, interleave, 8, replicas=replicas)
    num_seqs = len(lengths)
    rows = [alloc.add_rows() for _ in range(num_seqs)]
    alloc.grow([(r, n_ + num_steps) for r, n_ in zip(rows, lengths)], [0] * num_seqs)
    step_ids = list(range(40, 40 + num_steps))

    one_by_one_tables: dict = {}
    expected = [plan_step(alloc, [StepRequest(r, n_ + j, 1) for r, n_ in zip(rows, lengths)], sid, True, 8, 3, "s",
                          row_window=window, tables=one_by_one_tables)
                for j, sid in enumerate(step_ids)]
    got = plan_decode_run(alloc, rows, lengths, step_ids, table_gatherer(alloc, rows, {}), 3, "s", window, None,
                          True, 8)
    assert len(got) == num_steps and all(len(p) == n for p in got) and len(list(got)) == num_steps
    for j in range(num_steps):
        for rank in range(n):
            _same(got[j][rank], expected[j][rank], f"step {j} rank {rank}")
    # What travels (Ray pickles it): a remote shard's later steps and the client's, compact, equal once unpickled.
    local = [r for r in range(n) if r % 2 == 0]
    for rank in range(n):
        sent = later_plans(got, rank)
        _same(list(pickle.loads(pickle.dumps(sent))), [expected[j][rank] for j in range(1, num_steps)], f"later {rank}")
    first, later = client_steps(got, step_ids, local)
    assert first.local_plans.keys() == set(local)
    want = [StepPlans(sid, {r: for_client(expected[j][r]) for r in local},
                      {r: p.rows for r, p in enumerate(expected[j]) if r not in local and p.num_rows})
            for j, sid in enumerate(step_ids)]
    _same([pickle.loads(pickle.dumps(first)), *pickle.loads(pickle.dumps(later))], want, "client steps")
    assert len(pickle.dumps(later_plans(got, 0))) < 4096 + 200 * num_steps * len(lengths) + 8 * got[0][0].metadata.block_table_tensor.numel()
    return got


def test_run_plans_refuse_a_token_without_its_page():
    """The run's pages must all be allocated: a missing one fails as a step's would, naming the token."""
    alloc = ShardedKVAllocator(2, 50, 4, 1, 4)
    rows = [alloc.add_rows()]
    alloc.grow([(rows[0], 8)], [0])
    with pytest.raises(Exception, match="allocate its pages first|has no block"):
        plan_decode_run(alloc, rows, [8], [1, 2], table_gatherer(alloc, rows, {}), 0, None, None, None, True, 8)


@pytest.mark.parametrize("seed", range(100, 124))
def test_run_plans_equal_step_by_step_plans_fresh_seeds(seed):
    """More random runs (odd shard counts, interleave 1 and 16, replicas, windows) for the per-step rows built
    once per run (RankRun._step_rows)."""
    rng = random.Random(seed)
    n = rng.choice([1, 3, 5, 2])
    _check_run(n, 16, rng.choice([1, 16]), 2 if n >= 2 and rng.random() < 0.5 else 1,
               [rng.choice([0, 1, rng.randint(2, 700)]) for _ in range(rng.randint(1, 6))], rng.randint(1, 12),
               rng.choice([None, 3, 40]))


def test_run_plan_steps_own_their_tensors_and_the_cache_stays_home():
    """Each step's tensors are its own memory (as a clone per step gave): writing one step's leaves the others
    and the run as they were; the rows built for the plans do not travel (same bytes built or not)."""
    alloc = ShardedKVAllocator(2, 100, 4, 1, 4, replicas=2)
    rows = [alloc.add_rows() for _ in range(3)]
    alloc.grow([(r, n_ + 5) for r, n_ in zip(rows, [9, 0, 30])], [0] * 3)
    got = plan_decode_run(alloc, rows, [9, 0, 30], list(range(5)), table_gatherer(alloc, rows, {}), 0, "s", None,
                          None, True, 8)
    run = got.ranks[1]
    before = pickle.dumps(run)
    first, second = run.plan(1), run.plan(2)
    arrived = vars(pickle.loads(pickle.dumps(run)))
    assert len(pickle.dumps(run)) == len(before) and "_steps" not in arrived and "_computes_all" not in arrived
    want = run.seq_lens.clone()
    md = first.metadata
    for t in (md.seq_lens, md.query_start_loc, md.slot_mapping, md.query_positions_cpu, md.context_lens_cpu,
              first.replica_slot_mapping):
        t.fill_(-7)
    assert torch.equal(run.seq_lens, want) and torch.equal(md.seq_lens_cpu, want[1])
    assert torch.equal(second.metadata.seq_lens, want[2]) and torch.equal(second.metadata.query_start_loc,
                                                                          torch.arange(4))
    _same(run.plan(3), pickle.loads(pickle.dumps(run)).plan(3), "built here and built where it arrives")


def test_a_step_built_alone_equals_it_built_with_the_run():
    """The coordinator builds a run's first and last step alone (plan(j, whole_run=False)); the receivers all."""
    alloc = ShardedKVAllocator(3, 100, 4, 2, 4)
    rows = [alloc.add_rows() for _ in range(2)]
    alloc.grow([(r, n_ + 7) for r, n_ in zip(rows, [0, 21])], [0] * 2)
    got = plan_decode_run(alloc, rows, [0, 21], list(range(7)), table_gatherer(alloc, rows, {}), 0, "s", 3, None,
                          True, 8)
    for run in got.ranks:
        for j in range(7):
            _same(run.plan(j, whole_run=False), run.plan(j), f"rank {run.rank} step {j}")
    assert "_steps" in vars(got.ranks[0]) and any(p.rows is not None for run in got.ranks for p in [run.plan(0)])
