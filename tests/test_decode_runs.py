"""Decode runs (cluster/decode_run.py, cluster/client_run.py): several decode steps per begin_step.

Every step is checked against the float64 oracle; what a run must never change is the state: lengths,
pages in use and step counts are those of the same steps run one by one.
"""

from __future__ import annotations

import time

import pytest
import torch

from cpattn.errors import CapacityError
from service_oracle import Oracle, checked_step, run_step


def blocks_needed(svc, lengths: dict[str, int]) -> int:
    """Pages the sequences' committed tokens need on all shards (token p on shard (p // I) % N)."""
    cfg = svc.config
    total = 0
    for n in lengths.values():
        for rank in range(cfg.num_shards):
            local = sum(1 for p in range(n) if (p // cfg.dcp_interleave) % cfg.num_shards == rank)
            total += -(-local // cfg.block_size)
    return total


def check_state(svc, oracle: Oracle, sids: list[str]) -> None:
    stats = svc.stats()   # ends the run: what it reserved ahead is given back
    assert svc.gateway.run is None and stats["open_steps"] == 0
    lengths = svc.sequences()
    assert {s: lengths[s] for s in sids} == {s: oracle.length(s) for s in sids}
    assert sum(s["blocks_used"] for s in stats["shards"]) == blocks_needed(svc, lengths)


def fail_after_first_layer(svc, oracle: Oracle, sid: str) -> None:
    """A step of ``sid`` whose caller fails after its first layer (the step rolls back)."""
    with pytest.raises(RuntimeError, match="model failed"):
        with svc.step({sid: 1}) as step:
            q, k, v = oracle.random_qkv(1)
            step.attend(0, q, k, v)
            raise RuntimeError("model failed")


def fail_after_last_layer(svc, oracle: Oracle, sid: str) -> None:
    """A step of ``sid`` whose caller fails after every layer was attended (a run's shards wait for a header)."""
    with pytest.raises(RuntimeError, match="after the last layer"):
        with svc.step({sid: 1}) as step:
            for layer in range(svc.config.num_layers):
                q, k, v = oracle.random_qkv(1)
                step.attend(layer, q, k, v)
            raise RuntimeError("after the last layer")


@pytest.fixture(scope="module")
def runs_svc(ray_session):
    import cpattn

    from conftest import service_config

    # Runs not extended here: these tests count each run's steps (extensions: tests/test_run_extension.py).
    svc = cpattn.start(service_config(num_shards=3, dcp_interleave=2, decode_run_steps=4, block_size=2,
                                      decode_run_extend=False))
    yield svc
    svc.shutdown()


def test_run_steps_exact_and_state_as_one_by_one(runs_svc):
    svc = runs_svc
    oracle = Oracle(svc.config, seed=int(torch.randint(0, 10_000, ()).item()))
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 5, b: 3})
    committed = svc.stats()["steps_committed"]
    for _ in range(6):   # a run of 4, then one of 2 left early by the next request
        run_step(svc, oracle, {a: 1, b: 1})
        assert svc.gateway.run is None or svc.gateway.run.num_steps == 4
    run_step(svc, oracle, {b: 1})   # another request: the run ends, its 2 unused steps' pages return
    check_state(svc, oracle, [a, b])
    assert svc.stats()["steps_committed"] == committed + 7 and svc.stats()["steps_rolled_back"] == 0


def test_reads_keep_the_run_writes_end_it(runs_svc):
    svc = runs_svc
    oracle = Oracle(svc.config, seed=7)
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 3, b: 2})
    run_step(svc, oracle, {a: 1, b: 1})
    run = svc.gateway.run
    assert run is not None and run.index == 1
    assert svc.sequence_length(a) == oracle.length(a) and svc.sequences()[b] == oracle.length(b)
    run_step(svc, oracle, {a: 1, b: 1})
    assert svc.gateway.run is run and run.index == 2   # the reads above did not end it
    svc.free(b)   # b is in the run: the run ends first, then b is freed
    oracle.drop(b)
    assert svc.gateway.run is None
    run_step(svc, oracle, {a: 1})
    check_state(svc, oracle, [a])


def test_error_in_a_runs_step_rolls_back_that_step_only(runs_svc):
    svc = runs_svc
    oracle = Oracle(svc.config, seed=11)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 4})
    run_step(svc, oracle, {a: 1})
    run_step(svc, oracle, {a: 1})
    rolled_back = svc.stats()["steps_rolled_back"]
    run_step(svc, oracle, {a: 1})
    fail_after_first_layer(svc, oracle, a)   # the run's 2nd step
    assert svc.gateway.run is None and svc.sequence_length(a) == oracle.length(a)
    for _ in range(5):
        run_step(svc, oracle, {a: 1})
    fail_after_last_layer(svc, oracle, a)
    run_step(svc, oracle, {a: 1})
    check_state(svc, oracle, [a])
    assert svc.stats()["steps_rolled_back"] == rolled_back + 2


def test_idle_run_ends_by_itself(runs_svc):
    svc = runs_svc
    oracle = Oracle(svc.config, seed=13)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 2})
    run_step(svc, oracle, {a: 1})
    assert svc.gateway.run is not None
    deadline = time.monotonic() + 10
    while svc.gateway.run is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert svc.gateway.run is None   # the reaper ended it (its shards hold no thread)
    run_step(svc, oracle, {a: 1})
    check_state(svc, oracle, [a])


def test_run_is_shortened_not_refused_when_pages_run_out(start_service):
    # 3 shards x 3 pages x 2 tokens = 18 tokens; a sequence of 16 has room for 2 more: a run of 2, then 1.
    svc = start_service(num_shards=3, num_blocks_per_shard=3, block_size=2, decode_run_steps=8,
                        decode_run_extend=False)
    oracle = Oracle(svc.config, seed=3)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 16})
    run_step(svc, oracle, {a: 1})
    assert svc.gateway.run is not None and svc.gateway.run.num_steps == 2
    run_step(svc, oracle, {a: 1})
    with pytest.raises(CapacityError):
        svc.step({a: 1}).__enter__()
    check_state(svc, oracle, [a])


def test_no_run_when_it_would_hold_the_last_shard_thread(start_service):
    import cpattn

    svc = start_service(num_shards=2, max_open_steps=2, decode_run_steps=4)
    oracle = Oracle(svc.config, seed=5)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 2})
    run_step(svc, oracle, {a: 1})
    assert svc.gateway.run is not None   # alone on the service: runs are granted
    svc.stats()
    second = cpattn.connect(svc.config.name, namespace=svc.config.namespace)
    try:
        run_step(svc, oracle, {a: 1})
        assert svc.gateway.run is None   # a second client needs the other thread: no run
        b = second.add_sequence()
        with second.step({b: 1}) as step:
            for layer in range(svc.config.num_layers):
                x = torch.randn(1, svc.config.num_q_heads, svc.config.head_size, dtype=torch.float64)
                kv = torch.randn(1, svc.config.num_kv_heads, svc.config.head_size, dtype=torch.float64)
                step.attend(layer, x, kv, kv)
    finally:
        second.close()


def test_runs_double_while_finished_and_interleave_1(start_service):
    svc = start_service(num_shards=2, dcp_interleave=1, num_q_heads=4, num_kv_heads=1, decode_run_steps=6,
                        decode_run_extend=False)
    oracle = Oracle(svc.config, seed=21)
    seqs = [svc.add_sequence() for _ in range(3)]
    run_step(svc, oracle, {s: 2 + i for i, s in enumerate(seqs)})
    lengths = []
    for _ in range(12):
        checked_step(svc, oracle, {s: 1 for s in seqs})
        lengths.append(svc.gateway.run.num_steps if svc.gateway.run else 0)
    # 4 steps (the last one ends the run), then 6 (8 capped by decode_run_steps), then 6 again
    assert lengths == [4, 4, 4, 0, 6, 6, 6, 6, 6, 0, 6, 6]
    run_step(svc, oracle, {seqs[0]: 1})   # left early: the next run starts at 4 again
    checked_step(svc, oracle, {s: 1 for s in seqs})
    assert svc.gateway.run.num_steps == 4
    check_state(svc, oracle, seqs)
