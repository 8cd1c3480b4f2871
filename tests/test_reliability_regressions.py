"""Regressions for silent-corruption classes, through the whole service path:

- wrong LSE base: a plugin backend reporting base-2 LSE (and saying so) stays exact; one that reports
  natural log but declares base 2 gives wrong outputs, so the declaration is really what the merge uses;
- -inf merges: sequences shorter than the shard count (empty shards, all -inf partials) never give NaN;
- stale block-table entries: pages freed (or rolled back) and reused by another sequence never leak
  the old KV into it.
"""

from __future__ import annotations

import pytest

import cpattn
from conftest import service_config
from cpattn.attention import register_backend
from reliability_plugins import PLUGINS
from service_oracle import Oracle, checked_step, local_tokens

TOL = 1e-10
NUM_BLOCKS = 12   # per shard; block_size 4 -> 48 tokens per shard


@pytest.fixture(scope="module")
def plugins(ray_session):
    """Register the test backends for this module only (other tests list the registered names)."""
    from cpattn.attention import registry

    with pytest.MonkeyPatch.context() as mp:
        for name in PLUGINS:
            mp.setitem(registry._paths, name, PLUGINS[name])
        register_backend("RELIA_BASE2", PLUGINS["RELIA_BASE2"], device_type="cpu")   # the public call
        yield
    registry._generation += 1   # drop cached selections of the plugin names


@pytest.fixture(scope="module")
def base2(plugins):
    svc = cpattn.start(service_config(num_shards=3, backend="RELIA_BASE2", num_blocks_per_shard=NUM_BLOCKS,
                                      pcp_min_tokens=6, rpc_timeout_s=60.0))
    try:
        yield svc
    finally:
        svc.shutdown()


def _workload(svc, oracle, tol):
    """Prefill chunks (PCP-split), a mixed step and decodes; returns the worst error seen."""
    a, b = svc.add_sequence(), svc.add_sequence()
    worst = 0.0
    for request in ({a: 10, b: 3}, {a: 8, b: 1}, {a: 1, b: 7}, {a: 1}, {b: 1}, {a: 2, b: 1}):
        worst = max(worst, checked_step(svc, oracle, request, tol=tol)[1])
    svc.free(a)
    svc.free(b)
    oracle.drop(a)
    oracle.drop(b)
    return worst


def test_base2_plugin_backend_is_converted_and_exact(base2):
    info = base2.info()["shards"]
    assert {s["backend"] for s in info} == {"RELIA_BASE2"} and {s["lse_base"] for s in info} == {"TWO"}
    worst = _workload(base2, Oracle(base2.config, 51), TOL)
    print(f"base-2 plugin through the service: max error {worst:.1e}")


def test_mislabelled_lse_base_gives_wrong_outputs(plugins):
    svc = cpattn.start(service_config(num_shards=3, backend="RELIA_MISLABELLED", pcp_min_tokens=6,
                                      rpc_timeout_s=60.0))
    try:
        assert svc.info()["shards"][0]["lse_base"] == "TWO"
        worst = _workload(svc, Oracle(svc.config, 51), tol=float("inf"))
    finally:
        svc.shutdown()
    print(f"natural-log LSE declared as base 2: max error {worst:.2f}")
    assert worst > 1e-2   # the merge weighted partials by the declared base, as it must


def test_sequences_shorter_than_the_shard_count_merge_without_nan(base2):
    svc = base2
    oracle = Oracle(svc.config, 52)
    # dcp_interleave 1 over 3 shards: a 1-token sequence leaves two shards empty, a 2-token one leaves one.
    one, two, long = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
    checked_step(svc, oracle, {one: 1}, tol=TOL)                 # every shard's context empty: causal part only
    checked_step(svc, oracle, {two: 2, long: 1}, tol=TOL)
    assert [local_tokens(2, 3, r, 1) for r in range(3)] == [1, 1, 0]
    checked_step(svc, oracle, {one: 1, two: 1, long: 1}, tol=TOL)  # queries against empty shards: -inf partials
    checked_step(svc, oracle, {long: 7}, tol=TOL)
    for sid in (one, two, long):
        svc.free(sid)
        oracle.drop(sid)


def test_freed_and_rolled_back_pages_never_leak_into_their_next_owner(base2):
    svc = base2
    oracle = Oracle(svc.config, 53)
    # An old owner fills nearly every page with keys scaled x40: if any of them were read by a later
    # sequence (stale table entry, slot past its length), its softmax would be dominated by them.
    old = svc.add_sequence()
    q, k, v = oracle.random_qkv(3 * 4 * NUM_BLOCKS - 12)
    request = {old: q.shape[0]}
    with svc.step(request) as step:
        for layer in range(svc.config.num_layers):
            step.attend(layer, q, 40 * k, 40 * v)
    assert max(s["blocks_free"] for s in svc.stats()["shards"]) <= 1
    # A step that writes every layer's KV and then rolls back leaves its pages dirty as well.
    spare = svc.add_sequence()
    with pytest.raises(RuntimeError, match="abandon"):
        with svc.step({spare: 9}) as step:
            q9, k9, v9 = oracle.random_qkv(9)
            step.attend(0, q9, 40 * k9, 40 * v9)
            step.attend(1, q9, 40 * k9, 40 * v9)
            raise RuntimeError("abandon")
    svc.free(old)
    svc.free(spare)
    assert {s["blocks_free"] for s in svc.stats()["shards"]} == {NUM_BLOCKS}
    # New sequences necessarily reuse those pages; partial pages (slots beyond each length) hold old bytes.
    x, y = svc.add_sequence(), svc.add_sequence()
    for request in ({x: 5, y: 1}, {x: 1, y: 6}, {x: 13}, {y: 1}, {x: 1, y: 1}, {x: 30, y: 2}, {y: 1}):
        checked_step(svc, oracle, request, tol=TOL)
    svc.free(x)
    svc.free(y)
