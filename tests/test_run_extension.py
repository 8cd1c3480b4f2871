"""Decode runs extended while they run (cluster/coordinator_runs.py, run_extension.py, shard_runs.py).

Through a service with remote shards over gloo, every step is checked against the float64 oracle, and what the
extensions must never change is the state: lengths, pages in use and step counts are those of the same steps
run one by one, whether the run goes on into its extensions, is left with one asked for, fails in one, or is
refused one. The ledger's and the shard queue's parts are tested alone first.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from conftest import service_config
from cpattn.cluster.decode_run_plans import RunSteps
from cpattn.cluster.generations import Generations
from cpattn.cluster.open_steps import RUN_ID_SPAN, OpenSteps
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.cluster.shard_runs import LiveRuns
from cpattn.cluster.step_ledger import StepLedger
from cpattn.errors import CapacityError
from service_oracle import Oracle, checked_step, run_step
from test_decode_runs import check_state, fail_after_first_layer, fail_after_last_layer
from test_step_ledger import Metrics


def _ledger(**overrides):
    cfg = service_config(**{"num_shards": 2, "num_blocks_per_shard": 8, "block_size": 4, "max_open_steps": 4,
                            **overrides})
    steps = OpenSteps(cfg.max_open_steps, pending=lambda refs: [])
    return StepLedger(cfg, SequenceTable(cfg), steps, Metrics(), lambda count=1: steps.new_id(count)[0]), Generations()


def _open_run(ledger, gen, client="c-1", seqs=("a",), ahead=4):
    for s in seqs:
        ledger.table.add(client, s)
    admitted = ledger.admit(client, {s: 1 for s in seqs}, ahead, 1)
    return ledger.open(admitted, (), gen, group_name=f"{client}-g")[0]


# The ledger alone ---------------------------------------------------------------------------------------------
def test_an_extension_continues_the_run_and_its_close_undoes_it():
    ledger, gen = _ledger()
    step = _open_run(ledger, gen)
    seq = ledger.table.get("a")
    assert step.id_span == RUN_ID_SPAN and step.group_name == "c-1-g" and step.new_lengths == [4]
    growths, plans = ledger.extend(step, 4, gen, 1)
    assert len(growths) == 4 and step.num_substeps == 8 and step.new_lengths == [8]
    assert plans.ranks[0].step_ids == list(range(step.step_id + 4, step.step_id + 8))
    assert plans.ranks[0].positions[:, 0].tolist() == [4, 5, 6, 7]   # after the run's last planned token (3)
    assert ledger.table.blocks_used() == [1, 1]   # 8 tokens, interleave 1, pages of 4
    ledger.advance(step, ledger.num_kept(step, True, 6))   # its commits go on into the extension
    assert seq.length == 6 and seq.last_step == step.step_id + 5 and seq.in_step == step.step_id
    step.done = 6
    ledger.close(step, committed=True)   # the client left after 6 of its 8 steps
    assert seq.length == 6 and seq.in_step is None and ledger.steps.num_committed == 6
    assert ledger.table.blocks_used() == [1, 1]   # 6 tokens: 3 a shard, one page each


def test_a_withdrawn_extension_gives_its_pages_back_and_keeps_the_run():
    ledger, gen = _ledger()
    step = _open_run(ledger, gen, seqs=("a", "b"))
    before = ledger.table.blocks_used()
    growths, _ = ledger.extend(step, 16, gen, 1)
    assert ledger.table.blocks_used() != before and len(growths) == 16
    version = ledger.table.get("a").pages_version
    ledger.withdraw(step, growths)
    assert ledger.table.blocks_used() == before and step.num_substeps == 4 and step.new_lengths == [4, 4]
    assert ledger.table.get("a").in_step == step.step_id and ledger.table.get("a").pages_version > version


def test_an_extension_whose_planning_fails_gives_its_pages_back(monkeypatch):
    from cpattn.cluster import decode_run

    ledger, gen = _ledger()
    step = _open_run(ledger, gen, seqs=("a", "b"))
    before = ledger.table.blocks_used()

    def broken(*args, **kwargs):
        raise RuntimeError("planner broke")
    monkeypatch.setattr(decode_run, "plan_steps", broken)
    with pytest.raises(RuntimeError, match="planner broke"):
        ledger.extend(step, 16, gen, 1)
    assert ledger.table.blocks_used() == before and step.num_substeps == 4 and step.new_lengths == [4, 4]


def test_an_extension_is_refused_without_room_threads_or_its_epoch():
    ledger, gen = _ledger(max_tokens_per_client=10)
    step = _open_run(ledger, gen)
    growths, _ = ledger.extend(step, 16, gen, 1)
    assert len(growths) == 6 and step.new_lengths == [10]   # the quota counts the run's planned tokens
    assert ledger.extend(step, 4, gen, 1) is None and step.num_substeps == 10

    ledger, gen = _ledger()
    step = _open_run(ledger, gen)
    assert ledger.extend(step, 4, gen, num_clients=4) is None   # 3 free threads for 3 other clients: none spare
    assert ledger.extend(step, 1, gen, 1) is None             # one step saves nothing
    gen.shard_replaced()
    assert ledger.extend(step, 4, gen, 1) is None and step.num_substeps == 4
    assert ledger.table.blocks_used() == [1, 1]

    ledger, gen = _ledger()   # 2 shards x 8 pages x 4 tokens = 64 tokens: the last extension is shortened
    step = _open_run(ledger, gen)
    for _ in range(4):
        ledger.extend(step, 16, gen, 1)
    assert step.new_lengths == [64] and ledger.extend(step, 16, gen, 1) is None
    step.id_span = step.num_substeps   # (what a withdrawal sets: never again)
    assert ledger.extend(step, 16, gen, 1) is None


def test_another_clients_step_ids_are_never_inside_a_run():
    ledger, gen = _ledger()
    run = _open_run(ledger, gen)
    ledger.table.add("c-2", "z")
    plain, _ = ledger.open(ledger.admit("c-2", {"z": 3}, 1, 2), (), gen, group_name="c-2-g")
    assert plain.step_id >= run.step_id + RUN_ID_SPAN and plain.id_span == 1
    run.id_span = 12   # a run extends as far as its ids go, and no further
    growths, plans = ledger.extend(run, 256, gen, 2)
    assert len(growths) == 8 and plans.ranks[0].step_ids[-1] == run.step_id + 11
    assert ledger.extend(run, 256, gen, 2) is None


def test_the_clients_tables_after_an_extension_are_the_runs_whole_tables():
    """The in-process shards' block tables travel as deltas (page_delta.py): after the extension's deltas the client's
    tables are the coordinator's, pages for every step of the extension, each step's plan reading them."""
    from cpattn.cluster.client_run import DecodeRun
    from cpattn.cluster.coordinator_runs import extension_reply
    from cpattn.cluster.decode_run_plans import use_block_tables
    from cpattn.cluster.page_delta import PageCache
    from cpattn.cluster.run_extension import adopt_extension

    ledger, gen = _ledger(num_shards=3, block_size=2, num_blocks_per_shard=64, dcp_interleave=1)
    seqs = [ledger.table.add("c-1", s) for s in ("a", "b", "c")]
    for seq, n in zip(seqs, (5, 17, 30)):   # committed lengths: partly filled pages
        ledger.table.grow([seq], [n])
        seq.length = n
    admitted = ledger.admit("c-1", {"a": 1, "b": 1, "c": 1}, 4, 1)
    step, runs = ledger.open(admitted, (0, 2), gen, group_name="c-1-g")
    reply = ledger.reply(step, admitted.seqs, admitted.request, runs, None, gen.epoch)
    pages = PageCache()
    tables = {r: pages.apply(r, reply.seq_ids, reply.local_pages[r]) for r in (0, 2)}
    use_block_tables(reply.later, tables)
    run = DecodeRun(dict(admitted.request), reply, reply.later, reply.num_tokens, index=4)
    for n in range(2):   # two extensions, one after the other
        growths, plans = ledger.extend(step, 8, gen, 1)
        extension = extension_reply(ledger.table, step, plans, pages.held(reply.seq_ids, [0, 2]))
        assert all(start > 0 for r in (0, 2) for _v, start, _p in extension.local_pages[r])   # only the new pages
        steady = SimpleNamespace(template=f"template of segment {n}") if n == 0 else None
        run.steady = steady
        adopt_extension(pages, run, extension)
        # the previous segment's steady template is kept for the extension's later steps (None: it had none)
        assert run.steady is None and run.steady_template == (None if steady is None else steady.template)
        local = extension.steps.ranks   # the client's copies: a segment's first two steps build only their own rows
        run.next_step(), run.next_step()
        assert not any("_steps" in local[r].__dict__ for r in (0, 2))
        run.next_step()
        assert all("_steps" in local[r].__dict__ for r in (0, 2))
        run.index -= 3
        for r in (0, 2):
            whole = plans.ranks[r].table
            for j in range(len(growths)):
                got = run.next_step().local_plans[r].metadata.block_table_tensor
                assert torch.equal(got[:, :whole.shape[1]], whole) and bool((got[:, whole.shape[1]:] < 0).all())
            run.index -= len(growths)
        run.index += len(growths)
    assert run.num_steps == 4 + 8 + 8 and run.segment_start == 12


# The shard's queue alone --------------------------------------------------------------------------------------
def test_a_live_run_takes_its_own_extensions_in_order_until_it_ends():
    runs = LiveRuns()
    queue = runs.start("c-1-g", 10, iter(["s10", "s11"]))
    ext = RunSteps(lambda steps, j: f"e{j}", [type("R", (), {"step_ids": [12, 13]})()], 0)
    assert not runs.extend("c-1-g", 11, ext) and not runs.extend("c-2-g", 10, ext)   # another run, another group
    assert not runs.extend("c-1-g", 10, ["not", "a run"])
    assert [queue.next(), queue.next(), queue.next()] == ["s10", "s11", None]   # nothing taken yet
    assert runs.extend("c-1-g", 10, ext)
    assert [queue.next(), queue.next(), queue.next()] == ["e0", "e1", None]
    runs.finish("c-1-g", queue)
    assert not runs.extend("c-1-g", 10, ext)   # the run's thread ended it


# Through the service ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ext_svc(ray_session):
    import cpattn

    svc = cpattn.start(service_config(num_shards=3, dcp_interleave=2, decode_run_steps=4, block_size=2))
    yield svc
    svc.shutdown()


def _decode(svc, oracle, seqs, steps: int) -> None:
    for _ in range(steps):
        checked_step(svc, oracle, {s: 1 for s in seqs})


def test_a_long_decode_loop_is_one_run_exact_and_as_one_by_one(ext_svc):
    svc = ext_svc
    oracle = Oracle(svc.config, seed=int(torch.randint(0, 10_000, ()).item()))
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 5, b: 3})
    committed = svc.stats()["steps_committed"]
    checked_step(svc, oracle, {a: 1, b: 1})
    run = svc.gateway.run
    first, segments = run.first_step_id, set()
    for _ in range(29):
        checked_step(svc, oracle, {a: 1, b: 1})
        assert svc.gateway.run is run and run.first_step_id == first   # no begin_step: the same run goes on
        segments.add(run.segment_start)
    assert len(segments) >= 6 and run.num_steps >= 30   # 4-step segments (decode_run_steps=4), one after another
    check_state(svc, oracle, [a, b])
    stats = svc.stats()
    assert stats["steps_committed"] == committed + 30 and stats["steps_rolled_back"] == 0


def test_a_run_left_with_its_extension_asked_gives_every_page_back(ext_svc):
    svc = ext_svc
    oracle = Oracle(svc.config, seed=31)
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 3, b: 4})
    _decode(svc, oracle, [a, b], 3)   # 4-step run: its extension was asked at its second step
    run = svc.gateway.run
    assert run.asked and run.extension is not None and run.segment_start == 0
    time.sleep(0.5)   # the coordinator planned the extension and handed it to the shards meanwhile
    run_step(svc, oracle, {b: 1})   # another request: the run ends, its extension's pages return with it
    check_state(svc, oracle, [a, b])
    _decode(svc, oracle, [a, b], 9)   # into an extension, then left again
    assert svc.gateway.run.segment_start > 0
    run_step(svc, oracle, {a: 2})
    check_state(svc, oracle, [a, b])


def test_an_extension_not_there_in_time_is_left_and_undone(ext_svc):
    import ray

    @ray.remote
    def late():
        time.sleep(5)

    svc = ext_svc
    oracle = Oracle(svc.config, seed=47)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 3})
    _decode(svc, oracle, [a], 3)   # the 4-step run's extension was asked at its second step
    run = svc.gateway.run
    assert ray.get(run.extension, timeout=30) is not None   # granted: the coordinator and the shards hold 4 more
    run.extension = late.remote()   # ... but as if its answer were late
    _decode(svc, oracle, [a], 1)    # the run's last step: it ends there, its commit undoes the extension
    assert svc.gateway.run is None
    check_state(svc, oracle, [a])
    _decode(svc, oracle, [a], 6)
    check_state(svc, oracle, [a])


def test_errors_in_an_extended_step_roll_back_that_step_only(ext_svc):
    svc = ext_svc
    oracle = Oracle(svc.config, seed=37)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 4})
    _decode(svc, oracle, [a], 6)
    assert svc.gateway.run.segment_start > 0
    rolled_back = svc.stats()["steps_rolled_back"]
    _decode(svc, oracle, [a], 1)
    fail_after_first_layer(svc, oracle, a)   # an extension's last step
    assert svc.gateway.run is None and svc.sequence_length(a) == oracle.length(a)
    _decode(svc, oracle, [a], 7)
    assert svc.gateway.run.segment_start > 0
    fail_after_last_layer(svc, oracle, a)
    _decode(svc, oracle, [a], 2)
    check_state(svc, oracle, [a])
    assert svc.stats()["steps_rolled_back"] == rolled_back + 2


def test_an_idle_extended_run_ends_by_itself(ext_svc):
    svc = ext_svc
    oracle = Oracle(svc.config, seed=41)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 2})
    _decode(svc, oracle, [a], 7)   # into its extension, the next one asked
    assert svc.gateway.run is not None and svc.gateway.run.segment_start > 0
    deadline = time.monotonic() + 10
    while svc.gateway.run is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert svc.gateway.run is None   # the reaper ended it, extension and all
    _decode(svc, oracle, [a], 2)
    check_state(svc, oracle, [a])


def test_another_client_cannot_extend_a_run(ext_svc):
    import cpattn
    import ray

    svc = ext_svc
    oracle = Oracle(svc.config, seed=43)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 2})
    _decode(svc, oracle, [a], 1)
    run = svc.gateway.run
    other = cpattn.connect(svc.config.name, namespace=svc.config.namespace)
    try:
        ref = svc.gateway.coordinator.extend_run.remote(other.gateway.credential, run.first_step_id, 4)
        assert ray.get(ref, timeout=30) is None   # its step is unknown to them: nothing granted
    finally:
        other.close()
    _decode(svc, oracle, [a], 5)
    check_state(svc, oracle, [a])


def test_a_run_meets_the_end_of_the_cache_then_capacity_error(start_service):
    # 3 shards x 3 pages x 2 tokens = 18 tokens: a run from 6 goes on in extensions to 18, then the cache is full.
    svc = start_service(num_shards=3, num_blocks_per_shard=3, block_size=2, decode_run_steps=4)
    oracle = Oracle(svc.config, seed=3)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 6})
    _decode(svc, oracle, [a], 1)
    run = svc.gateway.run
    _decode(svc, oracle, [a], 11)
    assert svc.sequence_length(a) == 18 and svc.gateway.run is None and run.num_steps == 12
    with pytest.raises(CapacityError):
        svc.step({a: 1}).__enter__()
    check_state(svc, oracle, [a])
