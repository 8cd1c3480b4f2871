"""Hostile input, property-based: whatever a client sends, it gets a typed cpattn error and nothing changes.

One service serves every example. Before and after each hostile call we take every shard's KV checksum,
every client's sequences and lengths, and the per-shard and per-client usage; they must be identical.
Each example is followed by a valid step checked against the float64 oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpattn
from conftest import service_config
from cpattn.errors import CapacityError, CpattnError, IncompleteStepError, InvalidRequestError
from reliability_common import snapshot
from service_oracle import Oracle, checked_step

# The errors a hostile request may get: never a ServiceError (an internal failure wrapped on the way out).
REJECTED = (InvalidRequestError, CapacityError)
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True,
                    database=None)
TOL = 1e-10


@pytest.fixture(scope="module")
def env(ray_session):
    svc = cpattn.start(service_config(num_shards=3, num_layers=2, num_blocks_per_shard=512, rpc_timeout_s=60.0))
    other = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)   # a second client
    try:
        oracle = Oracle(svc.config, 11)
        a, b = svc.add_sequence(), svc.add_sequence()
        checked_step(svc, oracle, {a: 9, b: 5}, tol=TOL)
        freed = svc.add_sequence()
        checked_step(svc, oracle, {freed: 3}, tol=TOL)
        svc.free(freed)
        oracle.drop(freed)
        theirs = other.add_sequence()
        other.fill_synthetic(theirs, 6, seed=3)
        yield {"svc": svc, "other": other, "oracle": oracle, "a": a, "b": b, "freed": freed, "theirs": theirs}
    finally:
        other.close()
        svc.shutdown()


def _unchanged(env, before: dict, with_kv: bool = True) -> None:
    svc, oracle = env["svc"], env["oracle"]
    assert svc.gateway.open_step is None
    assert snapshot(svc, [env["other"]], with_kv) == before
    # ... and the service still computes exactly what the oracle (which never saw the hostile input) says.
    a, b = env["a"], env["b"]
    checked_step(svc, oracle, {a: 1, b: 1}, tol=TOL)


# --- step requests -----------------------------------------------------------------------------

def _foreign_ids():
    return st.one_of(
        st.text(max_size=40), st.binary(max_size=16), st.integers(), st.none(), st.floats(allow_nan=True),
        st.tuples(st.integers(), st.text(max_size=3)), st.just("seq-" + "A" * 22), st.just("seq-"),
        st.frozensets(st.integers(), max_size=2),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=22,
                max_size=22).map(lambda s: "seq-" + s),     # well-formed, never issued
        st.just("x" * 10_000))


def _bad_counts():
    return st.one_of(
        st.integers(max_value=0), st.integers(min_value=10**4, max_value=10**40),     # zero/negative, huge
        st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=4),
        st.just(torch.tensor(3)), st.just([1]), st.just(3.0), st.just(2**63), st.just(-2**63))


@st.composite
def hostile_requests(draw, ids: dict):
    kind = draw(st.sampled_from(["not-dict", "bad-id", "freed-id", "bad-count", "mixed"]))
    valid = {ids["a"]: draw(st.integers(1, 4)), ids["b"]: draw(st.integers(1, 4))}
    if kind == "not-dict":
        return draw(st.one_of(st.lists(st.sampled_from([ids["a"], ids["b"]]), max_size=3), st.none(), st.integers(),
                              st.text(max_size=8), st.just({}), st.just((ids["a"], 1)), st.just([(ids["a"], 1)]),
                              st.frozensets(st.integers(), max_size=2)))
    if kind == "bad-id":
        bad = draw(_foreign_ids())
        valid.pop(draw(st.sampled_from([ids["a"], ids["b"]])))
        return {**valid, bad: draw(st.integers(1, 3))}
    if kind == "freed-id":
        return {**valid, ids["freed"]: 1}
    if kind == "bad-count":
        victim = draw(st.sampled_from([ids["a"], ids["b"]]))
        return {**valid, victim: draw(_bad_counts())}
    # mixed: several bad things at once, the valid ids in any order
    return {ids["b"]: draw(_bad_counts()), draw(_foreign_ids()): 1, ids["a"]: 1}


@SETTINGS
@given(data=st.data())
def test_hostile_step_requests_change_nothing(env, data):
    svc = env["svc"]
    request = data.draw(hostile_requests(env))
    before = snapshot(svc, [env["other"]])
    with pytest.raises(REJECTED) as info:
        with svc.step(request):
            pytest.fail(f"the step {request!r} must not open")
    assert str(info.value)   # says what to change
    _unchanged(env, before)


@SETTINGS
@given(seq_id=st.one_of(_foreign_ids(), st.lists(st.integers(), max_size=2), st.just({})), count=st.one_of(_bad_counts(), st.integers(1, 3)),
       call=st.sampled_from(["free", "sequence_length", "fill_synthetic", "fill_synthetic_valid_id"]))
def test_hostile_sequence_calls_change_nothing(env, seq_id, count, call):
    svc = env["svc"]
    before = snapshot(svc, [env["other"]])
    with pytest.raises(REJECTED):
        if call == "free":
            svc.free(seq_id)
        elif call == "sequence_length":
            svc.sequence_length(seq_id)
        elif call == "fill_synthetic":
            svc.fill_synthetic(seq_id, count if isinstance(count, int) else 1)
        else:
            if isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= 3:
                count = 0
            svc.fill_synthetic(env["a"], count)
    _unchanged(env, before)


# --- attend() ----------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.complex128,
          torch.uint8]


@st.composite
def hostile_attends(draw):
    """(description, function(step, q, k, v) that makes the hostile call, layers attended validly first)."""
    kind = draw(st.sampled_from(["shape", "dtype", "device", "nonfinite", "layer", "twice", "type", "after-exit",
                                 "strides"]))
    target = draw(st.sampled_from(["q", "k", "v"]))

    def replace(q, k, v, x):
        return {"q": (x, k, v), "k": (q, x, v), "v": (q, k, x)}[target]

    def pick(q, k, v):
        return {"q": q, "k": k, "v": v}[target]

    if kind == "shape":
        dim = draw(st.integers(0, 2))
        delta = draw(st.sampled_from([-1, 1, 2, 7]))
        extra = draw(st.booleans())

        def call(step, q, k, v):
            x = pick(q, k, v)
            shape = list(x.shape)
            shape[dim] = max(0, shape[dim] + delta)
            if extra:
                shape.append(1)
            return step.attend(0, *replace(q, k, v, torch.zeros(shape, dtype=x.dtype)))
        return f"shape {target} dim {dim} {delta:+d} extra={extra}", call, 0
    if kind == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
        return f"dtype {target} {dtype}", (lambda step, q, k, v: step.attend(
            0, *replace(q, k, v, pick(q, k, v).to(dtype)))), 0
    if kind == "device":
        all_meta = draw(st.booleans())

        def call(step, q, k, v):
            if all_meta:   # consistent but unusable device
                return step.attend(0, q.to("meta"), k.to("meta"), v.to("meta"))
            return step.attend(0, *replace(q, k, v, pick(q, k, v).to("meta")))
        return f"device meta ({'all' if all_meta else target})", call, 0
    if kind == "nonfinite":
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        where = draw(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)))
        layer = draw(st.integers(0, 1))

        def call(step, q, k, v):
            x = pick(q, k, v).clone()
            x[tuple(w % s for w, s in zip(where, x.shape))] = value
            return step.attend(layer, *replace(q, k, v, x))
        return f"{value} in {target} layer {layer}", call, 0
    if kind == "layer":
        layer = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2), st.booleans(), st.none(),
                               st.floats(), st.text(max_size=3), st.just(torch.tensor(0)), st.just(1.0)))
        return f"layer {layer!r}", (lambda step, q, k, v: step.attend(layer, q, k, v)), 0
    if kind == "twice":
        return "layer 0 twice", (lambda step, q, k, v: step.attend(0, q, k, v)), 1
    if kind == "type":
        bad = draw(st.sampled_from(["list", "none", "numpy", "scalar"]))

        def call(step, q, k, v):
            x = pick(q, k, v)
            obj = {"list": x.tolist(), "none": None, "numpy": x.numpy(), "scalar": 1.0}[bad]
            return step.attend(0, *replace(q, k, v, obj))
        return f"{target} as {bad}", call, 0
    if kind == "strides":   # a valid non-contiguous view must be accepted and exact: not hostile, checked below
        return "non-contiguous", None, 0
    return "after-exit", "after-exit", 0


@SETTINGS
@given(case=hostile_attends(), n_a=st.integers(1, 4), n_b=st.integers(0, 3))
def test_hostile_attend_is_rejected_and_changes_nothing(env, case, n_a, n_b):
    svc, oracle, a, b = env["svc"], env["oracle"], env["a"], env["b"]
    what, call, num_valid_first = case
    request = {a: n_a, **({b: n_b} if n_b else {})}
    t = sum(request.values())
    if call is None:   # non-contiguous but valid tensors: accepted, exact
        def transposed(x):
            return x.transpose(0, 1).contiguous().transpose(0, 1)
        pending = {}
        with svc.step(request) as step:
            for layer in range(2):
                q, k, v = oracle.random_qkv(t)
                out = step.attend(layer, transposed(q), transposed(k), transposed(v))
                ref, kv = oracle.reference(request, layer, q, k, v)
                assert (out - ref).abs().max().item() <= TOL
                pending.update(kv)
        oracle.commit(pending)
        return
    # A valid layer attended before the bad call wrote KV into pages the rollback frees again; the
    # bytes of those free pages may differ, so then we compare everything but the raw KV checksum
    # (the exact step that follows proves the live KV is untouched).
    before = snapshot(svc, [env["other"]], with_kv=num_valid_first == 0)
    q, k, v = oracle.random_qkv(t)
    if call == "after-exit":
        step = svc.step(request)
        with pytest.raises(IncompleteStepError, match=r"layers \[0, 1\] never attended .* none of its tokens"):
            with step:
                pass                               # exits without attending: rolled back, and said so
        with pytest.raises(CpattnError, match="needs an open step"):
            step.attend(0, q, k, v)
        with pytest.raises(CpattnError, match="rolled_back"):
            step.__enter__()
    else:
        with pytest.raises(REJECTED) as info:
            with svc.step(request) as step:
                for layer in range(num_valid_first):
                    step.attend(layer, q, k, v)
                call(step, q, k, v)
                pytest.fail(f"{what}: accepted")
        assert str(info.value), what
    _unchanged(env, before, with_kv=num_valid_first == 0)


def test_nested_steps_and_closed_clients_are_rejected(env):
    svc, oracle, a, b = env["svc"], env["oracle"], env["a"], env["b"]
    before = snapshot(svc, [env["other"]])
    with pytest.raises(CpattnError, match="steps cannot nest|already open"):
        with svc.step({a: 1}):
            with svc.step({b: 1}):
                pass
    # The same sequence in two clients' steps at once: the second is refused (it is not theirs), the first
    # unaffected.
    other = env["other"]
    with pytest.raises(IncompleteStepError, match=r"layers \[0, 1\] never attended"):
        with svc.step({a: 1}):
            with pytest.raises(CpattnError, match="unknown or freed sequence"):
                with other.step({a: 1}):
                    pass
    _unchanged(env, before)
    third = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)
    third.close()
    before = snapshot(svc, [env["other"]])
    for call in (third.add_sequence, lambda: third.step({a: 1}), lambda: third.free(a),
                 lambda: third.fill_synthetic(a, 1)):
        with pytest.raises(CpattnError, match="closed"):
            call()
    _unchanged(env, before)
