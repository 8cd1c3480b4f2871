"""Rollback and bad input through the running service: a rejected or abandoned step changes nothing.

Every case is followed by a full step checked against the float64 oracle built without the rejected
tokens, so "nothing changed" is proven by results, not only by counters.
"""

from __future__ import annotations

import math

import pytest
import ray
import torch

import cpattn
from cpattn.errors import CapacityError, IncompleteStepError, InvalidRequestError, ServiceError
from conftest import service_config
from service_oracle import Oracle, run_step, tolerance

NUM_BLOCKS = 16   # per shard; block_size 4, 3 shards -> 64 tokens per shard


@pytest.fixture(scope="module")
def env(ray_session):
    svc = cpattn.start(service_config(num_shards=3, num_blocks_per_shard=NUM_BLOCKS, block_size=4))
    try:
        oracle = Oracle(svc.config, 5)
        a, b = svc.add_sequence(), svc.add_sequence()
        run_step(svc, oracle, {a: 9, b: 5})
        yield svc, oracle, a, b
    finally:
        svc.shutdown()


def snapshot(svc, seq_ids, with_kv: bool = True) -> dict:
    stats = svc.stats()
    snap = {"lengths": {s: svc.sequence_length(s) for s in seq_ids},
            "sequences": svc.sequences(),
            "shards": [(s["blocks_used"], s["blocks_free"], s["tokens"]) for s in stats["shards"]]}
    if with_kv:
        snap["kv"] = ray.get([h.kv_checksum.remote(svc.operator_credential) for h in svc.gateway.shards], timeout=30)
    return snap


def prove_unchanged(env, before: dict, with_kv: bool = True) -> None:
    svc, oracle, a, b = env
    assert snapshot(svc, [a, b], with_kv) == before
    run_step(svc, oracle, {a: 1, b: 3})   # later steps behave as if the rejected one never happened


# --- rollback ---------------------------------------------------------------------------------

def test_exception_inside_step_rolls_back(env):
    svc, oracle, a, b = env
    before = snapshot(svc, [a, b], with_kv=False)
    rolled = svc.stats()["steps_rolled_back"]
    with pytest.raises(RuntimeError, match="user code failed"):
        with svc.step({a: 21, b: 1}) as step:      # 21 new tokens allocate new pages on every shard
            q, k, v = oracle.random_qkv(22)
            step.attend(0, q, k, v)                 # layer 0's KV was written into the new pages
            during = [s["blocks_used"] for s in svc.stats()["shards"]]
            assert sum(during) > sum(u for u, _, _ in before["shards"])
            raise RuntimeError("user code failed")
    assert svc.stats()["steps_rolled_back"] == rolled + 1
    prove_unchanged(env, before, with_kv=False)


@pytest.mark.parametrize("num_layers_attended", [0, 1])
def test_step_exited_early_rolls_back(env, num_layers_attended):
    svc, oracle, a, b = env
    before = snapshot(svc, [a, b], with_kv=False)
    missing = ", ".join(str(layer) for layer in range(num_layers_attended, svc.config.num_layers))
    with pytest.raises(IncompleteStepError, match=rf"layers \[{missing}\] never attended"):
        with svc.step({a: 6, b: 2}) as step:
            for layer in range(num_layers_attended):
                step.attend(layer, *oracle.random_qkv(8))
    assert snapshot(svc, [a, b], with_kv=False) == before
    prove_unchanged(env, before, with_kv=False)


def test_rolled_back_first_step_of_new_sequence(env):
    svc, oracle, a, b = env
    c = svc.add_sequence()
    with pytest.raises(KeyError):
        with svc.step({c: 13}) as step:
            step.attend(0, *oracle.random_qkv(13))
            raise KeyError("abandon")
    assert svc.sequence_length(c) == 0
    run_step(svc, oracle, {c: 7, a: 1})
    run_step(svc, oracle, {c: 1})
    svc.free(c)
    oracle.drop(c)


# --- bad input at attend(): rejected before anything is written --------------------------------

def _bad_attend_cases():
    def shape_t(q, k, v): return 0, q[:-1], k, v
    def shape_heads(q, k, v): return 0, q, k.repeat(1, 2, 1), v
    def head_size(q, k, v): return 0, q, k, torch.cat([v, v], dim=-1)
    def dtype(q, k, v): return 0, q.float(), k, v
    def not_tensor(q, k, v): return 0, q, k.tolist(), v
    def nan_q(q, k, v): q = q.clone(); q[1, 0, 0] = math.nan; return 0, q, k, v
    def nan_k(q, k, v): k = k.clone(); k[-1, -1, -1] = math.nan; return 0, q, k, v
    def inf_v(q, k, v): v = v.clone(); v[0, 0, 3] = math.inf; return 0, q, k, v
    def layer_neg(q, k, v): return -1, q, k, v
    def layer_high(q, k, v): return 2, q, k, v
    def layer_str(q, k, v): return "0", q, k, v
    def layer_bool(q, k, v): return True, q, k, v
    return [
        (shape_t, r"q has shape \(3, 4, 8\), expected \(4, 4, 8\)"),
        (shape_heads, r"k has shape \(4, 4, 8\), expected \(4, 2, 8\)"),
        (head_size, r"v has shape \(4, 2, 16\), expected \(4, 2, 8\)"),
        (dtype, r"q has dtype torch.float32, the service runs float64"),
        (not_tensor, r"k must be a torch.Tensor"),
        (nan_q, r"q holds NaN or inf"),
        (nan_k, r"k holds NaN or inf"),
        (inf_v, r"v holds NaN or inf"),
        (layer_neg, r"layer -1 out of range: use an int in 0..1"),
        (layer_high, r"layer 2 out of range"),
        (layer_str, r"layer '0' out of range"),
        (layer_bool, r"layer True out of range"),
    ]


@pytest.mark.parametrize("make_bad,match", _bad_attend_cases(), ids=lambda x: getattr(x, "__name__", "m"))
def test_bad_attend_input_changes_nothing(env, make_bad, match):
    svc, oracle, a, b = env
    before = snapshot(svc, [a, b])
    with pytest.raises(InvalidRequestError, match=match):
        with svc.step({a: 1, b: 3}) as step:
            step.attend(*make_bad(*oracle.random_qkv(4)))
    prove_unchanged(env, before)


def test_bad_input_on_a_later_layer_rolls_back_the_step(env):
    svc, oracle, a, b = env
    before = snapshot(svc, [a, b], with_kv=False)
    with pytest.raises(InvalidRequestError, match="layer 0 was already attended"):
        with svc.step({a: 2, b: 1}) as step:
            q, k, v = oracle.random_qkv(3)
            step.attend(0, q, k, v)
            step.attend(0, q, k, v)
    with pytest.raises(InvalidRequestError, match="holds NaN"):
        with svc.step({a: 2}) as step:
            q, k, v = oracle.random_qkv(2)
            step.attend(1, q, k, v)
            step.attend(0, q, k, v * math.nan)
    prove_unchanged(env, before, with_kv=False)


# --- bad requests at step(): rejected by the coordinator before any allocation ------------------

@pytest.mark.parametrize("make_request,match", [
    (lambda a, b: {"seq-does-not-exist": 1}, r"unknown or freed sequence 'seq-does-not-exist'"),
    (lambda a, b: {a: 2, "seq-nope": 1}, r"unknown or freed sequence 'seq-nope'"),
    (lambda a, b: {a: 0}, r"num_new_tokens 0 must be an int >= 1"),
    (lambda a, b: {a: 1, b: -2}, r"num_new_tokens -2 must be an int >= 1"),
    (lambda a, b: {a: 1.5}, r"num_new_tokens 1.5 must be an int >= 1"),
    (lambda a, b: {a: "3"}, r"num_new_tokens '3' must be an int >= 1"),
    (lambda a, b: {a: True}, r"num_new_tokens True must be an int >= 1"),
    (lambda a, b: {}, r"a step needs a non-empty \{seq_id: num_new_tokens\} dict, got \{\}"),
    (lambda a, b: [a], r"a step needs a non-empty \{seq_id: num_new_tokens\} dict"),
    (lambda a, b: {7: 1}, r"unknown or freed sequence 7"),
], ids=["unknown", "unknown-with-valid", "zero", "negative", "float", "str", "bool", "empty", "list", "int-id"])
def test_bad_request_changes_nothing(env, make_request, match):
    svc, oracle, a, b = env
    before = snapshot(svc, [a, b])
    with pytest.raises(InvalidRequestError, match=match):
        with svc.step(make_request(a, b)):
            pytest.fail("the step must not open")
    assert svc.gateway.open_step is None
    prove_unchanged(env, before)


def test_freed_sequence_is_rejected(env):
    svc, oracle, a, b = env
    c = svc.add_sequence()
    run_step(svc, oracle, {c: 5})
    svc.free(c)
    oracle.drop(c)
    before = snapshot(svc, [a, b])
    for call in (lambda: svc.step({c: 1}).__enter__(), lambda: svc.step({a: 1, c: 1}).__enter__(),
                 lambda: svc.free(c), lambda: svc.sequence_length(c)):
        with pytest.raises(InvalidRequestError, match=f"unknown or freed sequence '{c}'"):
            call()
    prove_unchanged(env, before)


def test_nested_step_is_rejected_and_outer_step_still_commits(env):
    svc, oracle, a, b = env
    request = {a: 2, b: 1}
    with svc.step(request) as step:
        with pytest.raises(InvalidRequestError, match="a step is already open on this client"):
            svc.step({b: 1})
        with pytest.raises(InvalidRequestError, match="this step is open"):
            step.__enter__()
        pending = {}
        for layer in range(2):
            q, k, v = oracle.random_qkv(3)
            out = step.attend(layer, q, k, v)
            ref, kv = oracle.reference(request, layer, q, k, v)
            assert (out - ref).abs().max().item() <= tolerance(svc.config)
            pending.update(kv)
    oracle.commit(pending)
    assert svc.sequence_length(a) == oracle.length(a)
    run_step(svc, oracle, {b: 1})


def test_step_reused_after_exit_is_rejected(env):
    svc, oracle, a, b = env
    step = svc.step({a: 1})
    with step:
        pending = {}
        for layer in range(2):
            q, k, v = oracle.random_qkv(1)
            step.attend(layer, q, k, v)
            pending.update(oracle.reference({a: 1}, layer, q, k, v)[1])
    oracle.commit(pending)
    before = snapshot(svc, [a, b])
    with pytest.raises(InvalidRequestError, match="this step is committed: start a new one"):
        with step:
            pass
    with pytest.raises(InvalidRequestError, match=r"attend\(\) needs an open step \(this one is committed\)"):
        step.attend(0, *oracle.random_qkv(1))
    aborted = svc.step({b: 1})
    with pytest.raises(IncompleteStepError):
        with aborted:
            pass
    with pytest.raises(InvalidRequestError, match="this step is rolled_back"):
        aborted.__enter__()
    with pytest.raises(InvalidRequestError, match="needs an open step"):
        aborted.attend(0, *oracle.random_qkv(1))
    prove_unchanged(env, before)


# --- capacity --------------------------------------------------------------------------------

def test_capacity_error_names_shard_needed_free_and_changes_nothing(env):
    svc, oracle, a, b = env
    c = svc.add_sequence()
    before = snapshot(svc, [a, b])
    free = {s["rank"]: s["blocks_free"] for s in svc.stats()["shards"]}
    with pytest.raises(CapacityError, match=r"shard \d+ needs \d+ more KV blocks for this step but has \d+ free") as info:
        with svc.step({c: 3 * 4 * NUM_BLOCKS, a: 1}):
            pytest.fail("the step must not open")
    err = info.value
    assert err.shard in free and err.free == free[err.shard] and err.needed > err.free
    assert f"shard {err.shard} needs {err.needed} " in str(err) and f"has {err.free} free" in str(err)
    assert svc.sequence_length(c) == 0
    prove_unchanged(env, before)
    svc.free(c)


def test_a_local_failure_in_attend_rolls_back_and_says_what_to_change(env, monkeypatch):
    """The client's own work failing mid-step (the merge here; an in-process shard's kernel on a GPU) is not a
    lost shard: the step rolls back with that error and advice that can work, no shard is replaced, and the
    next step runs exactly on the same shards (the group, whose partials were in flight, is rebuilt). It was a
    WireError: "no shard was lost: run the step again". Other errors, and no replay with two replicas:
    tests/test_step_run_losses.py."""
    from cpattn.cluster import gateway

    svc, oracle, a, b = env
    failure = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    lengths, epoch = (svc.sequence_length(a), svc.sequence_length(b)), svc.gateway.epoch
    real_merge, calls = gateway.merge_rows, []

    def failing_merge(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:   # layer 1: layer 0's outputs were handed out, its KV is in the step
            raise failure
        return real_merge(*args, **kwargs)

    monkeypatch.setattr(gateway, "merge_rows", failing_merge)
    with pytest.raises(ServiceError) as info:
        run_step(svc, oracle, {a: 1, b: 3})
    message = str(info.value)
    assert "layer 1" in message and "OutOfMemoryError" in message and "rolled back" in message, message
    assert "max_tokens_per_step" in message and "replaced" not in message and "did not finish" not in message
    assert info.value.__cause__ is failure
    assert (svc.sequence_length(a), svc.sequence_length(b)) == lengths   # nothing committed
    monkeypatch.setattr(gateway, "merge_rows", real_merge)
    run_step(svc, oracle, {a: 1, b: 3})
    run_step(svc, oracle, {a: 1, b: 1})
    assert svc.gateway.epoch == epoch   # no shard was replaced
