"""Forked sequences through the running service (local Ray, CPU) against the independent float64 oracle:
fork / fork of a prefix, copy on write on both sides, rollback, freeing the source, PCP prefill onto a fork,
replicas, interleave 1 and 16, odd shard counts, GQA, sliding windows and soft caps; fp8 caches. Steps holding
several forks run the TORCH backend's cascade (each shard reads a shared prefix once per layer)."""

from __future__ import annotations

import random

import pytest

import cpattn
from conftest import service_config
from cpattn.errors import InvalidRequestError
from reliability_common import RPC_S, kill_shard, kv_checksums, wait_rank_replaced
from service_oracle import Oracle, local_tokens, run_step

# (num_shards, dcp_interleave, block_size, num_q_heads, num_kv_heads, kv_replicas, layer 1's window and soft cap)
CASES = [(3, 1, 4, 4, 2, 2, None), (3, 16, 16, 4, 1, 1, None), (5, 1, 4, 2, 2, 1, (5, 2.0))]


def separate_blocks(svc, lengths: dict[str, int]) -> list[int]:
    """Pages per shard the sequences would use as separate sequences (nothing shared)."""
    n, i, b = svc.config.num_shards, svc.config.dcp_interleave, svc.config.block_size
    # With two replicas shard r also keeps the copy of shard (r - max(1, n // 2)) % n's tokens.
    held = [[r] + ([(r - max(1, n // 2)) % n] if svc.config.kv_replicas == 2 else []) for r in range(n)]
    return [sum(-(-local_tokens(L, n, o, i) // b) for L in lengths.values() for o in held[r]) for r in range(n)]


@pytest.fixture(scope="module", params=CASES, ids=[f"N{c[0]}-I{c[1]}-Q{c[3]}K{c[4]}-R{c[5]}{'-window' if c[6] else ''}" for c in CASES])
def service(request, ray_session):
    n, interleave, block, hq, hk, replicas, window = request.param
    window_cfg = {} if window is None else {"sliding_window": [None, window[0]], "logits_soft_cap": [None, window[1]]}
    svc = cpattn.start(service_config(num_shards=n, dcp_interleave=interleave, block_size=block, num_q_heads=hq,
                                      num_kv_heads=hk, kv_replicas=replicas, pcp_enabled=True, pcp_min_tokens=6,
                                      num_blocks_per_shard=48, rpc_timeout_s=60.0, **window_cfg))
    try:
        yield svc
    finally:
        svc.shutdown()


def test_forks_match_the_oracle_and_share_pages(service):
    svc = service
    cfg = svc.config
    seed = 100 * cfg.num_shards + cfg.dcp_interleave
    rng = random.Random(seed)
    oracle = Oracle(cfg, seed)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: rng.randint(20, 40)})
    run_step(svc, oracle, {a: 1})
    used_before = [s["blocks_used"] for s in svc.stats()["shards"]]
    whole = svc.fork(a)
    cut = rng.randint(1, oracle.length(a) - 1)
    part = svc.fork(a, num_tokens=cut)
    oracle.fork(a, whole, oracle.length(a))
    oracle.fork(a, part, cut)
    assert svc.sequences() == {a: oracle.length(a), whole: oracle.length(a), part: cut}
    stats = svc.stats()
    assert [s["blocks_used"] for s in stats["shards"]] == used_before          # no page copied by a fork
    assert sum(s["blocks_shared"] for s in stats["shards"]) > 0
    # Every sequence writes next to (or into) shared pages: copies on write, on both sides of each share.
    for request in ({a: 1, whole: 1, part: 3}, {whole: 2, part: 1}, {a: 1, whole: 1, part: 1}):
        assert run_step(svc, oracle, request) <= 1e-10
    # A fork of a fork, then a long prefill onto it (PCP splits it over the shards).
    grand = svc.fork(whole, num_tokens=oracle.length(whole) - 1)
    oracle.fork(whole, grand, oracle.length(whole) - 1)
    assert run_step(svc, oracle, {grand: 17, a: 1}) <= 1e-10
    # Freeing the source leaves every fork intact.
    svc.free(a)
    oracle.drop(a)
    for request in ({whole: 1, part: 1, grand: 1}, {part: 5}):
        assert run_step(svc, oracle, request) <= 1e-10
    # Pages counted once: physical use never exceeds what separate sequences would need.
    stats = svc.stats()
    separate = separate_blocks(svc, {s: oracle.length(s) for s in (whole, part, grand)})
    assert all(s["blocks_used"] <= sep for s, sep in zip(stats["shards"], separate))
    assert sum(s["blocks_used"] for s in stats["shards"]) < sum(separate)
    for sid in (whole, part, grand):
        svc.free(sid)
    assert all(s["blocks_used"] == 0 and s["blocks_shared"] == 0 for s in svc.stats()["shards"])


def test_rollback_undoes_the_copy_on_write(service):
    svc = service
    oracle = Oracle(svc.config, 7)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 7})                # partly filled last pages on the shards holding token 7's page
    f = svc.fork(a)
    oracle.fork(a, f, 7)
    before = svc.stats()["shards"]
    with pytest.raises(KeyError):
        with svc.step({f: 1, a: 1}) as step:
            step.attend(0, *oracle.random_qkv(2))
            raise KeyError("caller gives up mid-step")
    assert svc.stats()["shards"] == before       # the copies' pages returned, the shared pages still shared
    assert svc.sequences() == {a: 7, f: 7}
    for request in ({f: 1}, {a: 2, f: 1}):
        assert run_step(svc, oracle, request) <= 1e-10
    for sid in (a, f):
        svc.free(sid)


def test_fork_arguments_are_checked_and_change_nothing(service):
    svc = service
    oracle = Oracle(svc.config, 8)
    a = svc.add_sequence()
    run_step(svc, oracle, {a: 5})
    before = svc.stats()
    for bad, match in ((6, r"num_tokens 6 must be an int in 0..5"), (-1, "num_tokens -1"), (True, "num_tokens True"),
                       (2.0, "num_tokens 2.0")):
        with pytest.raises(InvalidRequestError, match=match):
            svc.fork(a, num_tokens=bad)
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        svc.fork("seq-" + "A" * 22)
    with svc.step({a: 1}) as step:
        with pytest.raises(InvalidRequestError, match=r"is in open step \d+: fork it after that step ends"):
            svc.gateway.call("fork", a, None)   # the gateway's own calls wait for no commit: the step is open
        for layer in range(svc.config.num_layers):
            step.attend(layer, *oracle.random_qkv(1))
    after = svc.stats()
    assert [s["blocks_shared"] for s in after["shards"]] == [s["blocks_shared"] for s in before["shards"]]
    assert svc.sequences() == {a: 6}
    empty = svc.fork(a, num_tokens=0)
    assert svc.sequence_length(empty) == 0
    for sid in (a, empty):
        svc.free(sid)


def _same_step_outputs(svc, seq_a: str, seq_b: str, oracle: Oracle) -> float:
    """One decode of both sequences with identical q/k/v rows: equal KV histories give equal outputs."""
    worst = 0.0
    with svc.step({seq_a: 1, seq_b: 1}) as step:
        for layer in range(svc.config.num_layers):
            q, k, v = oracle.random_qkv(1)
            out = step.attend(layer, q.repeat(2, 1, 1), k.repeat(2, 1, 1), v.repeat(2, 1, 1))
            worst = max(worst, (out[0].double() - out[1].double()).abs().max().item())
    return worst


def test_fp8_cache_windows_and_refill_on_forks(start_service):
    """fp8 KV (float32 activations, dynamic scales) with a window of 6 on one layer and two replicas: a fork and
    its source, given the same new token, give exactly the same output (one copy of the prefix, each side copies
    the page it writes), both within fp8 of the float64 oracle; a killed shard's replacement is refilled with
    each shared page once and holds exactly the same values, and the forks go on."""
    svc = start_service(num_shards=3, dtype="float32", kv_cache_dtype="fp8_e4m3", num_layers=2, dcp_interleave=4,
                        sliding_window=[None, 6], kv_replicas=2, rpc_timeout_s=RPC_S, collective_timeout_s=5.0,
                        health_check_interval_s=1.0, start_timeout_s=120.0)
    oracle = Oracle(svc.config, 9)
    a = svc.add_sequence()
    assert run_step(svc, oracle, {a: 22}, check=False) < 0.15
    f = svc.fork(a)
    oracle.fork(a, f, 22)
    assert run_step(svc, oracle, {f: 3}, check=False) < 0.15
    assert _same_step_outputs(svc, a, svc.fork(f, num_tokens=22), oracle) == 0.0
    sums = kv_checksums(svc)
    wait_rank_replaced(svc, 1, kill_shard(svc, 1))
    assert kv_checksums(svc) == pytest.approx(sums, rel=1e-12)
    assert run_step(svc, oracle, {f: 1}, check=False) < 0.15
