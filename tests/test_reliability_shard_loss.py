"""Shard loss: kv_replicas=2 survives a killed or hung shard with exact outputs; kv_replicas=1 names the
sequences it lost, keeps the others exact and gets the shard's capacity back; shutdown always completes.

Every output is checked against the float64 oracle (float64 service, within 1e-10).
"""

from __future__ import annotations

import re
import time

import pytest
import ray

import cpattn
from conftest import service_config
from cpattn.errors import CpattnError, InvalidRequestError, ShardLostError
from reliability_common import (RPC_S, current_shards, kill_shard, kv_checksums, simulate_hang, wait_for,
                                wait_replaced)
from service_oracle import Oracle, checked_step, local_tokens

TIMEOUTS = dict(rpc_timeout_s=RPC_S, collective_timeout_s=5.0, health_check_interval_s=1.0, start_timeout_s=120.0)
TOL = 1e-10


# --- kv_replicas=2 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicated(ray_session):
    # Three layers: a shard hung after layer 0 still serves layer 1 (it is already waiting for it) and
    # stalls before layer 2, so the hang lands inside the step.
    svc = cpattn.start(service_config(num_shards=3, num_layers=3, kv_replicas=2, **TIMEOUTS))
    try:
        oracle = Oracle(svc.config, 21)
        seqs = [svc.add_sequence() for _ in range(3)]
        a, b, c = seqs
        checked_step(svc, oracle, {a: 12, b: 7}, tol=TOL)      # 12 >= pcp_min_tokens: split across shards
        checked_step(svc, oracle, {a: 8, c: 1, b: 1}, tol=TOL)
        yield svc, oracle, seqs
    finally:
        svc.shutdown()


def _all_continue(svc, oracle, seqs) -> None:
    a, b, c = seqs
    checked_step(svc, oracle, {a: 1, b: 2, c: 3}, tol=TOL)
    checked_step(svc, oracle, {c: 1}, tol=TOL)
    assert svc.sequences() == {s: oracle.length(s) for s in seqs}


def test_killed_between_steps_is_replaced_and_refilled_exactly(replicated):
    svc, oracle, seqs = replicated
    replaced = svc.stats()["shards_replaced"]
    sums = kv_checksums(svc)
    kill_shard(svc, 2)
    took = wait_replaced(svc, replaced + 1)
    print(f"shard 2 killed: replaced and refilled after {took:.1f}s")
    assert took < 60
    # Page-for-page refill: the replacement holds exactly the killed shard's bytes (primary and replica pages).
    assert kv_checksums(svc) == pytest.approx(sums, rel=1e-12)
    stats = svc.stats()
    assert all(s["alive"] for s in stats["shards"]) and stats["shards_replaced"] == replaced + 1
    _all_continue(svc, oracle, seqs)


def test_killed_right_before_a_step_is_rolled_back_and_replayed(replicated):
    svc, oracle, seqs = replicated
    a, b, c = seqs
    replaced = svc.stats()["shards_replaced"]
    kill_shard(svc, 0)
    t0 = time.monotonic()
    step, _ = checked_step(svc, oracle, {a: 2, b: 1, c: 1}, tol=TOL)
    took = time.monotonic() - t0
    print(f"step right after the kill: {took:.1f}s, recoveries {step.recoveries}")
    # Known cost: the first collective waits up to collective_timeout_s for the dead peer.
    assert took < TIMEOUTS["collective_timeout_s"] + 60
    assert svc.stats()["shards_replaced"] == replaced + 1
    _all_continue(svc, oracle, seqs)


def test_killed_between_layers_replays_the_step(replicated):
    svc, oracle, seqs = replicated
    a, b, c = seqs
    replaced = svc.stats()["shards_replaced"]

    def kill_after_first_layer(step, layer):
        if layer == 0:
            kill_shard(svc, 1)

    step, _ = checked_step(svc, oracle, {a: 3, b: 1, c: 2}, after_layer=kill_after_first_layer, tol=TOL)
    assert step.recoveries >= 1   # layer 1 or the commit found the dead peer; layer 0 was replayed
    wait_replaced(svc, replaced + 1)
    _all_continue(svc, oracle, seqs)


def test_hung_shard_is_replaced_within_the_timeouts(replicated):
    svc, oracle, seqs = replicated
    a, b, c = seqs
    replaced = svc.stats()["shards_replaced"]
    simulate_hang(svc, 2)
    took = wait_replaced(svc, replaced + 1)
    print(f"hung shard (between steps) replaced after {took:.1f}s")
    assert took < 3 * TIMEOUTS["health_check_interval_s"] + 60
    _all_continue(svc, oracle, seqs)

    # Hung mid-step: the next layer's collective stalls until the health thread replaces the shard
    # (or collective_timeout_s); the step then replays.
    def hang_after_first_layer(step, layer):
        if layer == 0:
            simulate_hang(svc, 0)

    t0 = time.monotonic()
    step, _ = checked_step(svc, oracle, {a: 1, c: 4}, after_layer=hang_after_first_layer, tol=TOL)
    took = time.monotonic() - t0
    print(f"step with a shard hung mid-step: {took:.1f}s, recoveries {step.recoveries}")
    assert step.recoveries >= 1
    assert took < TIMEOUTS["collective_timeout_s"] + 60
    assert svc.stats()["shards_replaced"] == replaced + 2
    _all_continue(svc, oracle, seqs)


def test_killed_while_the_client_rejoins_is_replaced_and_the_join_retried(replicated, monkeypatch):
    """A shard dying while the client's new group forms (CI's chaos run: killed just after a replacement) is one
    more replaced shard, never an error the caller sees."""
    from cpattn.cluster import client_group

    svc, oracle, seqs = replicated
    replaced, epoch = svc.stats()["shards_replaced"], svc.gateway.epoch
    real, calls = client_group.create_group, []

    def kill_while_forming(*args, **kwargs):
        calls.append(args[1])   # the group's name
        if len(calls) == 1:
            kill_shard(svc, 1)   # its join was sent; it never connects
        return real(*args, **kwargs)

    monkeypatch.setattr(client_group, "create_group", kill_while_forming)
    svc.gateway.rejoin()
    assert len(calls) == 2 and calls[0] != calls[1], calls   # the first group failed, a fresh one formed
    assert svc.stats()["shards_replaced"] == replaced + 1 and svc.gateway.epoch > epoch
    _all_continue(svc, oracle, seqs)


# --- kv_replicas=1 ---------------------------------------------------------------------------------

NUM_BLOCKS = 16      # per shard; block_size 4, dcp_interleave 4: token p lives on shard (p // 4) % 3


@pytest.fixture(scope="module")
def single(ray_session):
    svc = cpattn.start(service_config(num_shards=3, kv_replicas=1, dcp_interleave=4, num_blocks_per_shard=NUM_BLOCKS,
                                      **TIMEOUTS))
    try:
        yield svc
    finally:
        t0 = time.monotonic()
        svc.shutdown()   # idempotent: the last test may have shut it down already
        assert time.monotonic() - t0 < 60


def test_single_replica_loss_names_sequences_keeps_others_and_returns_capacity(single):
    svc = single
    oracle = Oracle(svc.config, 31)
    a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
    checked_step(svc, oracle, {a: 40, b: 3, c: 9}, tol=TOL)
    checked_step(svc, oracle, {a: 40, c: 1}, tol=TOL)
    # b lives on shard 0 only; a and c also on shard 2.
    assert local_tokens(oracle.length(b), 3, 2, 4) == 0
    assert local_tokens(oracle.length(a), 3, 2, 4) > 0 and local_tokens(oracle.length(c), 3, 2, 4) > 0
    replaced = svc.stats()["shards_replaced"]
    kill_shard(svc, 2)
    wait_replaced(svc, replaced + 1)

    for sid in (a, c):
        with pytest.raises(ShardLostError, match=r"shard 2\b") as info:
            checked_step(svc, oracle, {sid: 1}, tol=TOL)
        assert sid in info.value.sequences and sid in str(info.value)
        assert info.value.sequences == [sid]
        with pytest.raises(ShardLostError, match=sid):
            svc.sequence_length(sid)
    with pytest.raises(ShardLostError) as info:   # a step mixing lost and live sequences names only the lost
        checked_step(svc, oracle, {b: 1, a: 1, c: 2}, tol=TOL)
    assert sorted(info.value.sequences) == sorted([a, c]) and b not in info.value.sequences
    assert svc.sequence_length(b) == oracle.length(b)

    # The lost sequences' pages came back on every shard: only b's remain.
    stats = svc.stats()
    for s in stats["shards"]:
        held = local_tokens(oracle.length(b), 3, s["rank"], 4)
        assert s["blocks_used"] == -(-held // 4), s
        assert s["blocks_free"] == NUM_BLOCKS - s["blocks_used"]
    assert svc.sequences() == {b: oracle.length(b)}
    checked_step(svc, oracle, {b: 2}, tol=TOL)

    # Capacity is really usable: a new sequence takes almost every page a and c held.
    d = svc.add_sequence()
    checked_step(svc, oracle, {d: 3 * 4 * (NUM_BLOCKS - 2)}, tol=TOL)
    checked_step(svc, oracle, {b: 1, d: 1}, tol=TOL)
    # Freeing a lost sequence forgets it; afterwards it is just unknown.
    svc.free(a)
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        svc.sequence_length(a)
    svc.free(c)
    svc.free(d)
    oracle.drop(d)


def test_single_replica_unaffected_step_in_flight_is_reported_then_reruns_exactly(single):
    svc = single
    oracle = Oracle(svc.config, 32)
    b = svc.add_sequence()
    checked_step(svc, oracle, {b: 3}, tol=TOL)   # shard 0 only
    replaced = svc.stats()["shards_replaced"]

    def kill_after_first_layer(step, layer):
        if layer == 0:
            kill_shard(svc, 1)

    with pytest.raises(CpattnError, match="rolled back") as info:   # 2 tokens: a plain step (no decode run)
        checked_step(svc, oracle, {b: 2}, after_layer=kill_after_first_layer, tol=TOL)
    assert not isinstance(info.value, ShardLostError)   # b lost nothing: rerun it
    wait_replaced(svc, replaced + 1)
    assert svc.sequence_length(b) == oracle.length(b)
    oracle_len = oracle.length(b)
    checked_step(svc, oracle, {b: 1}, tol=TOL)
    assert oracle.length(b) == oracle_len + 1
    svc.free(b)


def test_single_replica_shard_lost_inside_a_decode_run_loses_nothing_committed(single):
    """A shard holding none of b's tokens dies inside b's decode run. Its steps need nothing from it, so they
    may go on until the group or the run's commit meets the loss; then a typed "run it again" error, never a
    wrong output, never ShardLostError, and the decode loop (running failed steps again) ends exact."""
    svc = single
    oracle = Oracle(svc.config, 34)
    b = svc.add_sequence()
    checked_step(svc, oracle, {b: 3}, tol=TOL)   # interleave 4: tokens 0-3 on shard 0, 4-7 on shard 1
    replaced = svc.stats()["shards_replaced"]
    checked_step(svc, oracle, {b: 1}, tol=TOL)
    checked_step(svc, oracle, {b: 1}, tol=TOL)
    assert svc.gateway.run is not None and svc.gateway.run.index == 2
    kill_shard(svc, 2)   # none of b's 5 tokens
    wait_replaced(svc, replaced + 1)
    steps, failures = 0, 0
    while steps < 6:
        try:
            checked_step(svc, oracle, {b: 1}, tol=TOL)   # checks each output; commits the oracle only if it held
            steps += 1
        except CpattnError as exc:
            assert not isinstance(exc, ShardLostError) and re.search("rolled back|run (the step|it) again", str(exc))
            failures += 1
            assert failures <= 3, exc
    assert svc.sequence_length(b) == oracle.length(b) == 5 + steps
    svc.free(b)


def test_shutdown_completes_with_a_hung_shard_and_an_open_step(single):
    svc = single
    oracle = Oracle(svc.config, 33)
    s = svc.add_sequence()
    checked_step(svc, oracle, {s: 5}, tol=TOL)
    shards = current_shards(svc)
    step = svc.step({s: 2})
    step.__enter__()
    step.attend(0, *oracle.random_qkv(2))
    ray.get(shards[0].simulate_hang.remote(svc.operator_credential, True), timeout=RPC_S)
    t0 = time.monotonic()
    svc.shutdown()
    took = time.monotonic() - t0
    print(f"shutdown with a hung shard and an open step: {took:.2f}s")
    assert took < 30
    # The abandoned step's exit reports a typed error (the service is gone) or nothing; never hangs.
    t0 = time.monotonic()
    try:
        step.__exit__(None, None, None)
    except CpattnError:
        pass
    assert time.monotonic() - t0 < 2 * TIMEOUTS["rpc_timeout_s"]
    for h in shards:
        wait_for(lambda h=h: _dead(h), 60, "every shard of the stopped service to be gone")


def _dead(handle) -> bool:
    try:
        ray.get(handle.ping.remote(), timeout=RPC_S)
        return False
    except ray.exceptions.RayTaskError:   # alive: it refused a caller without the secret
        return False
    except ray.exceptions.RayActorError:
        return True
