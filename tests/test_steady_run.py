"""A decode run's steady steps (cluster/steady_run.py) open from the run's rows on the device: the graphs' buffers
then hold exactly what planning the step and refilling from its plan put there, for random runs (fresh seeds, random
lengths, one to three shards, one or two of them in-process, interleave 1 and 16, kv_replicas 2, dynamic fp8 scales,
sliding windows); a step is served exactly when its bucket is the captured one and every shard computes every row;
nothing is served after the graphs changed. TRITON's builder plans on the CPU where triton imports (no kernel runs,
nothing is captured: graphs.key is set as a capture would); the GPU replays them in tests/gpu/test_decode_graphs_gpu.py
and through the service in tests/gpu/test_steady_run_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()

from cpattn.cluster import decode_run  # noqa: E402
from cpattn.cluster.decode_graphs import DecodeGraphs  # noqa: E402
from cpattn.cluster.decode_run_plans import RunSteps, client_step, use_block_tables  # noqa: E402
from cpattn.cluster.gateway import StepWire  # noqa: E402
from cpattn.cluster.steady_run import SteadyRun, keys_of_steps  # noqa: E402
from cpattn.cluster.step_planner import table_gatherer  # noqa: E402
from cpattn.kvstore.run_growth import grow_decode_run  # noqa: E402
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator  # noqa: E402
from cpattn.cluster.decode_run_plans import plan_decode_run  # noqa: E402
from test_decode_host_refill import (BLOCK, BLOCKS, _buffers, _decode_run, _planned_buffers,  # noqa: E402,F401
                                     _runner, no_capture)


def _case(seed: int, shards: int, local: tuple[int, ...], interleave: int, replicas: int, kv: str,
          window: int | None = None):
    rng = random.Random(seed)
    steps = rng.randrange(4, 48)
    # a decode loop's sequences, mostly with keys on every shard (a short one among them in half the runs)
    runs = _decode_run(rng, shards, interleave, replicas, steps, short=seed % 2 == 0)
    first, later = decode_run.client_steps(runs, list(range(steps)), list(local))
    tables = {r: runs.ranks[r].table for r in local}   # the gateway's page cache gives the same tables
    use_block_tables([first], tables)
    use_block_tables(later, tables)
    runners = {r: _runner(shards, replicas, kv, window) for r in local}
    graphs = {r: DecodeGraphs(runner) for r, runner in runners.items()}
    return runs, first, later, runners, graphs


def _open_planned(info, runners, graphs) -> StepWire:
    """What Gateway._open makes of a step's plans (its local shards planned, graphs refilled)."""
    local = {r: runners[r].plan(p, graphs[r]) for r, p in info.local_plans.items()}
    num_tokens = next(iter(info.local_plans.values())).num_tokens
    return StepWire(info.step_id, num_tokens, local, dict(info.remote_rows))


SEEDS = [2 * random.randrange(10**5), 2 * random.randrange(10**5) + 1, random.randrange(10**6)]   # an even, an odd


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shards, local, interleave, replicas, kv, window", [
    (1, (0,), 1, 1, "auto", None), (3, (0,), 1, 1, "auto", None), (2, (0, 1), 16, 2, "auto", None),
    (3, (0,), 16, 2, "fp8_e4m3", None), (1, (0,), 1, 1, "auto", 300), (3, (0, 2), 16, 1, "fp8_e4m3", 1000)])
def test_steady_steps_fill_the_buffers_planning_fills(seed, shards, local, interleave, replicas, kv, window):
    runs, first, later, runners, graphs = _case(seed, shards, local, interleave, replicas, kv, window)
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    steady = SteadyRun.of(later, template, graphs)
    served = _check_steady(runs, lambda j: later[j - 1], template, steady, runners, graphs,
                           (seed, shards, local, replicas, kv, window))
    if seed % 2:   # long sequences: a bucket serves most of the run (splits change a few times at most)
        assert served >= len(runs) - 2 - 4, (seed, served, len(runs))


@pytest.mark.parametrize("seed", SEEDS)
def test_an_extension_opens_steady_as_a_run_does(seed):
    """An extension's steps come as RunSteps from their first (start 0: coordinator_runs.extend_run), step j of the
    segment its j-th: its second step is the template and its later steps fill the buffers as planning does."""
    runs, _, _, runners, graphs = _case(seed, 3, (0, 2), 16, 1, "fp8_e4m3", 1000)
    ext = RunSteps(client_step, [r.for_client() for r in runs.ranks], 0, (0, 2))
    use_block_tables(ext, {r: runs.ranks[r].table for r in (0, 2)})
    _open_planned(ext[0], runners, graphs)
    template = _open_planned(ext[1], runners, graphs)
    steady = SteadyRun.of(ext, template, graphs)
    served = _check_steady(runs, lambda j: ext[j], template, steady, runners, graphs,
                           (seed, 3, (0, 2), 1, "fp8_e4m3", 1000))
    if seed % 2:   # long sequences, every shard computing every row: most of the segment is served
        assert served >= len(runs) - 2 - 4, (seed, served, len(runs))


def _check_steady(runs, step_of, template, steady, runners, graphs, case) -> int:
    """Steps 2.. of ``runs`` (``step_of(j)``: the client's step j) opened by ``steady`` where it serves them, else
    planned; each served one's buffers are the planned path's. Returns how many were served."""
    seed, shards, local, replicas, kv, window = case
    planned = {r: _runner(shards, replicas, kv, window) for r in local}
    planned_graphs = {r: DecodeGraphs(p) for r, p in planned.items()}
    captured = {r: g.key for r, g in graphs.items()}   # the fast graphs' bucket (a planned step recaptures)
    remote = [r for r in range(shards) if r not in local]
    template_ok = (all(p.graphs is not None for p in template.local.values()) and sorted(template.remote_rows) == remote
                   and all(runs.ranks[r].rows(1) is None for r in range(shards)))
    assert (steady is not None) == template_ok, seed
    served = 0
    for j in range(len(runs)):
        want, in_bucket = {}, True
        for r in local:
            plan = runs.ranks[r].plan(j)
            graphed = plan.rows is None and not plan.causal_pieces.numel()
            want[r] = _planned_buffers(planned[r], planned_graphs[r], plan) if graphed else None
            in_bucket &= graphed and planned_graphs[r].key == captured[r]
        every_row = all(runs.ranks[r].rows(j) is None for r in range(shards))
        if j < 2:
            continue
        wire = None if steady is None else steady.open(j, graphs)
        # served exactly when every shard computes every row and every in-process bucket is the captured one
        assert (wire is not None) == (steady is not None and in_bucket and every_row), (seed, j)
        if wire is None:   # planned, as the gateway then does (capturing the step's bucket)
            _open_planned(step_of(j), runners, graphs)
            captured = {r: g.key for r, g in graphs.items()}
            continue
        served += 1
        assert wire.step_id == runs.ranks[0].step_ids[j] and wire.local is template.local and wire.broken == []
        assert wire.graphs is None
        for r in local:
            got = _buffers(graphs[r], want[r]["table"].shape[1])
            for name in want[r]:
                assert torch.equal(got[name], want[r][name]), (seed, r, j, name)
    return served


def test_nothing_is_served_after_the_graphs_changed():
    runs, first, later, runners, graphs = _case(11, 1, (0,), 1, 1, "auto")
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    steady = SteadyRun.of(later, template, graphs)
    assert steady is not None and steady.open(2, graphs) is not None
    assert steady.open(3, {0: DecodeGraphs(runners[0])}) is None      # a rejoin made new graphs
    graphs[0].key = graphs[0].key[:1] + (graphs[0].key[1] * 2,) + graphs[0].key[2:]
    assert steady.open(3, graphs) is None                               # another bucket captured than step 3's
    assert steady.open(len(runs), graphs) is None and steady.open(-1, graphs) is None


def _forked_run(rng: random.Random, shards: int, interleave: int, replicas: int, steps: int):
    """A decode run of 2-5 forks of one document (its pages shared: fork_rows) with a few tokens of their own."""
    alloc = ShardedKVAllocator(shards, BLOCKS, BLOCK, interleave, max_rows=16, replicas=replicas)
    document = alloc.add_rows()
    prefix = rng.randrange(300, 2500)
    alloc.finish(alloc.grow([(document, prefix)], [0]))
    forks = [alloc.fork_rows(document, prefix) for _ in range(rng.randrange(2, 6))]
    lengths = [prefix + rng.randrange(0, 40) for _ in forks]
    alloc.finish(alloc.grow(list(zip(forks, lengths)), [prefix] * len(forks)))   # copies the shared last page
    growths = grow_decode_run(alloc, forks, lengths, steps, first_step=0)
    return plan_decode_run(alloc, forks, lengths, list(range(steps)), table_gatherer(alloc, forks, {}), 0, None, None,
                           growths[0], False, 8)


def _prefix_buffers(graphs: DecodeGraphs) -> dict:
    p = graphs.prefix.plan
    return {"prefix_rows": graphs.prefix.rows.clone(), "prefix_kv_len": p.dec_kv_len.clone(),
            "prefix_table": p.block_table.clone()}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shards, local, interleave, replicas, kv", [
    (1, (0,), 1, 1, "auto"), (3, (0, 2), 16, 1, "auto"), (2, (0,), 1, 2, "fp8_e4m3")])
def test_forks_steps_open_steady_over_their_shared_prefix(seed, shards, local, interleave, replicas, kv):
    """Forks' steps read their shared prefix in a prefix pass (cascade_plan): a steady step refills the suffix pass's
    buffers as planning the step does (its key counts the run's less the prefix's) and leaves the prefix pass's as
    the template's planning made them, which planning every step would make too."""
    rng = random.Random(seed)
    runs = _forked_run(rng, shards, interleave, replicas, rng.randrange(6, 40))
    first, later = decode_run.client_steps(runs, list(range(len(runs))), list(local))
    tables = {r: runs.ranks[r].table for r in local}
    use_block_tables([first], tables)
    use_block_tables(later, tables)
    runners = {r: _runner(shards, replicas, kv) for r in local}
    graphs = {r: DecodeGraphs(runner) for r, runner in runners.items()}
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    assert all(p.prefix_pass is not None and p.graphs is graphs[r] for r, p in template.local.items()), seed
    steady = SteadyRun.of(later, template, graphs)
    every_row = [all(runs.ranks[r].rows(j) is None for r in range(shards)) for j in range(len(runs))]
    assert (steady is not None) == every_row[1], seed
    planned = {r: _runner(shards, replicas, kv) for r in local}
    planned_graphs = {r: DecodeGraphs(p) for r, p in planned.items()}
    served = 0
    for j in range(len(runs)):
        want = {}
        for r in local:
            step = planned[r].plan(runs.ranks[r].plan(j), planned_graphs[r])
            want[r] = None if step.graphs is None else {**_buffers(planned_graphs[r], step.attn_metadata.block_table
                                                                   .shape[1]), **_prefix_buffers(planned_graphs[r])}
        if j < 2:
            continue
        in_bucket = all(want[r] is not None and planned_graphs[r].key == graphs[r].key for r in local)
        wire = None if steady is None else steady.open(j, graphs)
        assert (wire is not None) == (steady is not None and in_bucket and every_row[j]), (seed, j)
        if wire is None:
            _open_planned(later[j - 1], runners, graphs)
            continue
        served += 1
        for r in local:
            got = {**_buffers(graphs[r], want[r]["table"].shape[1]), **_prefix_buffers(graphs[r])}
            assert got.keys() == want[r].keys()
            for name in want[r]:
                assert torch.equal(got[name], want[r][name]), (seed, r, j, name)
    if steady is not None:
        assert served >= len(runs) - 2 - 4, (seed, served, len(runs))


def test_a_steady_step_is_planned_once_the_graphs_hold_another_prefix_pass():
    runs = _forked_run(random.Random(5), 1, 1, 1, 8)
    first, later = decode_run.client_steps(runs, list(range(8)), [0])
    use_block_tables([first], {0: runs.ranks[0].table})
    use_block_tables(later, {0: runs.ranks[0].table})
    runners = {0: _runner(1, 1, "auto")}
    graphs = {0: DecodeGraphs(runners[0])}
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    steady = SteadyRun.of(later, template, graphs)
    assert steady is not None and steady.open(2, graphs) is not None
    graphs[0].prefix_source = None   # another step's prefix pass refilled the buffers
    assert steady.open(3, graphs) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_of_steps_asks_few_keys_and_gives_every_one(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    values = sorted(rng.choice([1, 2, 4, 8, 16]) for _ in range(n))   # split counts that only grow
    asked = []

    def key_of(j):
        asked.append(j)
        return (3, values[j], 64)
    assert keys_of_steps(key_of, n) == [(3, v, 64) for v in values]
    changes = len(set(values))
    assert len(asked) <= 2 + 2 * changes * max(1, n.bit_length()), (n, changes, len(asked))
    assert keys_of_steps(key_of, 0) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_of_steps_with_inputs_that_turn_gives_every_key(seed):
    """Keys whose parts are monotone functions of inputs that grow, stay and shrink (a window's keys inside it as
    it slides past a shard's): every key as asked one by one, each stretch where every input is monotone asked
    about 2 log2(n) times per change of key in it."""
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    grows = sorted(rng.randrange(0, 5000) for _ in range(n))
    turns, v = [], rng.randrange(0, 400)
    for _ in range(n):   # a random walk: runs of steps up, flat or down
        v = max(0, v + rng.choice([-3, -1, 0, 0, 1, 2]) * (rng.random() < 0.5))
        turns.append(v)
    buckets, coarse = sorted(rng.sample(range(1, 5000), 6)), rng.choice([1, 3, 10])

    def part(x):   # a monotone step function, as decode_num_splits is of keys
        return sum(x >= b for b in buckets)
    asked = []

    def key_of(j):
        asked.append(j)
        return (7, (part(grows[j]), ("w", turns[j] // coarse)), 64)
    want = [(7, (part(g), ("w", t // coarse)), 64) for g, t in zip(grows, turns)]
    assert keys_of_steps(key_of, n, [grows, turns]) == want, seed
    assert len(asked) == len(set(asked))   # an end shared by two stretches is asked once
    moves = [b > a for a, b in zip(turns, turns[1:]) if b != a]   # up or down, flat steps left out
    stretches = 1 + sum(a != b for a, b in zip(moves, moves[1:]))
    changes = sum(a != b for a, b in zip(want, want[1:]))
    assert len(asked) <= 2 * stretches + 2 * changes * max(1, n.bit_length()) + 2, (n, stretches, changes, len(asked))


def _two_segments(rng: random.Random, shards: int, interleave: int, replicas: int, first: int, second: int):
    """A decode run's first segment and an extension planned from its end (as StepLedger.extend does: the pages of
    the extension's steps grown after the segment's, its tables gathered anew)."""
    alloc = ShardedKVAllocator(shards, BLOCKS, BLOCK, interleave, max_rows=16, replicas=replicas)
    lengths = [rng.randrange(64, 3000) for _ in range(rng.randrange(1, 6))]
    rows = [alloc.add_rows() for _ in lengths]
    alloc.finish(alloc.grow([(r, n) for r, n in zip(rows, lengths)], [0] * len(rows)))
    growths = grow_decode_run(alloc, rows, lengths, first, first_step=0)
    segment = plan_decode_run(alloc, rows, lengths, list(range(first)), table_gatherer(alloc, rows, {}), 0, None,
                              None, growths[0], False, 8)
    for g in growths:
        alloc.finish(g)
    later = [n + first for n in lengths]
    more = grow_decode_run(alloc, rows, later, second, first_step=0)
    for g in more:
        alloc.finish(g)
    extension = plan_decode_run(alloc, rows, later, list(range(first, first + second)),
                                table_gatherer(alloc, rows, {}), 0, None, None, None, False, 8)
    return segment, extension


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shards, local, interleave, replicas, kv", [
    (1, (0,), 1, 1, "auto"), (3, (0, 2), 16, 2, "fp8_e4m3"), (2, (0,), 1, 1, "fp8_e4m3")])
def test_an_extension_opens_steady_from_the_previous_segments_template(seed, shards, local, interleave, replicas, kv):
    """An extension's first step is planned (it brings the graphs the extension's table); its later steps open from
    the previous segment's template (client_run: DecodeRun.steady_template), none of them planned as a template,
    each one's buffers what planning it would make."""
    rng = random.Random(seed)
    segment, extension = _two_segments(rng, shards, interleave, replicas, rng.randrange(4, 12), rng.randrange(6, 40))
    first, later = decode_run.client_steps(segment, list(range(len(segment))), list(local))
    use_block_tables([first], {r: segment.ranks[r].table for r in local})
    use_block_tables(later, {r: segment.ranks[r].table for r in local})
    runners = {r: _runner(shards, replicas, kv) for r in local}
    graphs = {r: DecodeGraphs(runner) for r, runner in runners.items()}
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    ext = RunSteps(client_step, [r.for_client() for r in extension.ranks], 0, tuple(local))
    use_block_tables(ext, {r: extension.ranks[r].table for r in local})
    _open_planned(ext[0], runners, graphs)
    steady = SteadyRun.of(ext, template, graphs)
    every_row = [all(extension.ranks[r].rows(j) is None for r in range(shards)) for j in range(len(extension))]
    # every sequence has keys on every shard (64 and more each), so every step computes every row
    assert all(every_row) and SteadyRun.of(later, template, graphs) is not None and steady is not None, seed
    planned = {r: _runner(shards, replicas, kv) for r in local}
    planned_graphs = {r: DecodeGraphs(p) for r, p in planned.items()}
    served = 0
    for j in range(len(extension)):
        want = {r: _planned_buffers(planned[r], planned_graphs[r], extension.ranks[r].plan(j)) for r in local}
        if j == 0:
            continue
        in_bucket = all(planned_graphs[r].key == graphs[r].key for r in local)
        wire = steady.open(j, graphs)
        assert (wire is not None) == (in_bucket and every_row[j]), (seed, j)
        if wire is None:
            _open_planned(ext[j], runners, graphs)
            continue
        served += 1
        assert wire.step_id == extension.ranks[0].step_ids[j] and wire.local is template.local
        for r in local:
            got = _buffers(graphs[r], want[r]["table"].shape[1])
            for name in want[r]:
                assert torch.equal(got[name], want[r][name]), (seed, r, j, name)
    assert served >= len(extension) - 1 - 4, (seed, served, len(extension))


def test_rows_unlike_the_step_buffers_leave_the_run_planned(monkeypatch, caplog):
    """A builder whose buffers' dtypes differ from the run's rows: SteadyRun.of serves nothing (steps are planned),
    with a warning, rather than failing the caller's step."""
    runs, first, later, runners, graphs = _case(11, 1, (0,), 1, 1, "auto")
    _open_planned(first, runners, graphs)
    template = _open_planned(later[0], runners, graphs)
    builder = type(runners[0].builder)
    monkeypatch.setattr(builder, "step_rows", staticmethod(lambda slots, kv, w: [slots, kv.to(torch.int64)]))
    with caplog.at_level("WARNING", logger="cpattn"):
        assert SteadyRun.of(later, template, graphs) is None
    assert "do not fit the graphs' step buffers" in caplog.text
