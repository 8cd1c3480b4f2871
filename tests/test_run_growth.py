"""A decode run's pages found at once (kvstore/run_growth.py) are exactly what growing it one step at a time with
ShardedKVAllocator.grow gives: the same growth records, tables and pools, on random shapes with forked prefixes
(copy on write), replicas, odd shard counts and pools that run out mid-run (the run is shortened at the same step).
"""

from __future__ import annotations

import random

import pytest

from cpattn.errors import CapacityError
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator


def _step_by_step(allocator, rows, lengths, num_steps):
    """The reference: what a run's steps 1.. got before, one grow per step, each from the committed lengths."""
    growths = []
    for j in range(1, num_steps):
        try:
            growths.append(allocator.grow([(r, n + j + 1) for r, n in zip(rows, lengths)], lengths))
        except CapacityError:
            break
    return growths


def _state(allocator):
    return ([(t.rows_RW.tolist(), t.num_blocks.tolist()) for t in allocator.tables],
            [(p._ring.tolist(), p._head, p._num_free, p._ref_counts.tolist(), p._num_shared) for p in allocator.pools])


def _records(growths):
    return [(g.rows, g.copies) for g in growths]


def _scenario(seed: int):
    """Two identical allocators holding random sequences (some forked mid-page), their lengths, a run length."""
    rng = random.Random(seed)
    shards = rng.randint(1, 5)
    replicas = rng.choice((1, 2)) if shards > 1 else 1
    block_size = rng.choice((1, 2, 4, 16))
    interleave = rng.choice((1, 2, block_size))
    num_blocks = rng.randint(8, 80)
    made = [ShardedKVAllocator(shards, num_blocks, block_size, interleave, max_rows=16, replicas=replicas)
            for _ in range(2)]
    ops, lengths = [], []
    for _ in range(rng.randint(1, 6)):
        sources = [i for i, n in enumerate(lengths) if n]
        if sources and rng.random() < 0.4:   # a fork of an earlier sequence, sharing a prefix (often mid-page)
            src = rng.choice(sources)
            ops.append(("fork", src, rng.randint(1, lengths[src])))
            lengths.append(ops[-1][2])
        else:
            ops.append(("add", None, rng.randint(0, 40)))
            lengths.append(ops[-1][2])
    results = []
    for allocator in made:
        rows = []
        try:
            for kind, src, n in ops:
                if kind == "fork":
                    rows.append(allocator.fork_rows(rows[src], n))
                else:
                    rows.append(allocator.add_rows())
                    allocator.grow([(rows[-1], n)])
        except CapacityError:
            return None
        results.append(rows)
    return made, results, lengths, rng.randint(2, 40)


@pytest.mark.parametrize("seed", range(200))
def test_a_run_grown_at_once_equals_growing_it_step_by_step(seed):
    scenario = _scenario(seed)
    if scenario is None:
        pytest.skip("the random sequences did not fit the random pools")
    (fast, slow), (rows_fast, rows_slow), lengths, num_steps = scenario
    # Step 0: a decode step's growth, found the fast way (run_growth) or by grow() (which raises when it does not fit).
    first_fast = grow_decode_run(fast, rows_fast, lengths, 1, first_step=0)
    try:
        first_slow = slow.grow([(r, n + 1) for r, n in zip(rows_slow, lengths)], lengths)
    except CapacityError:
        assert first_fast == [] and _state(fast) == _state(slow)
        pytest.skip("no room for the run's first step")
    assert _records(first_fast) == _records([first_slow]) and _state(fast) == _state(slow)
    expected = _step_by_step(slow, rows_slow, lengths, num_steps)
    got = grow_decode_run(fast, rows_fast, lengths, num_steps)
    assert _records(got) == _records(expected)
    assert _state(fast) == _state(slow)
    # Given back in reverse (a run ended early), every pool and table is as before the run's later steps.
    for a, growths in ((fast, got), (slow, expected)):
        for g in reversed(growths):
            a.undo(g)
    assert _state(fast) == _state(slow)


def test_runs_that_copy_and_run_out_are_among_the_cases():
    """The random cases above include copies on write in later steps and runs shortened by a full pool."""
    copies = shortened = 0
    for seed in range(200):
        scenario = _scenario(seed)
        if scenario is None:
            continue
        (fast, _), (rows, _), lengths, num_steps = scenario
        try:
            fast.grow([(r, n + 1) for r, n in zip(rows, lengths)], lengths)
        except CapacityError:
            continue
        growths = grow_decode_run(fast, rows, lengths, num_steps)
        copies += any(g.copies for g in growths)
        shortened += len(growths) < num_steps - 1
    assert copies >= 10 and shortened >= 10, (copies, shortened)
