"""End to end through the running service (local Ray, CPU) against an independent float64 oracle."""

from __future__ import annotations

import random
import threading

import pytest

import cpattn
from cpattn.errors import InvalidRequestError
from service_oracle import Oracle, local_tokens, run_step


def random_workload(rng: random.Random, seq_ids: list[str], num_steps: int, max_prefill: int = 30):
    """Steps mixing prefill chunks (random sizes) and single-token decodes over random subsets of sequences."""
    prompt = {s: rng.randint(1, max_prefill) for s in seq_ids}
    done = dict.fromkeys(seq_ids, 0)
    for _ in range(num_steps):
        chosen = rng.sample(seq_ids, rng.randint(1, len(seq_ids)))
        request = {}
        for s in chosen:
            left = prompt[s] - done[s]
            request[s] = rng.randint(1, left) if left > 0 else 1
            done[s] += request[s]
        yield request


# (num_shards, dcp_interleave, num_q_heads, num_kv_heads, pcp_enabled, dtype); block_size is 4.
E2E_CASES = [
    (1, 1, 2, 2, True, "float64"),
    (2, 4, 4, 4, False, "float64"),
    (2, 1, 4, 2, True, "float32"),
    (3, 1, 4, 1, True, "float64"),
    (4, 4, 4, 2, True, "float64"),
]


@pytest.mark.parametrize("num_shards,interleave,hq,hk,pcp,dtype", E2E_CASES,
                         ids=[f"N{c[0]}-I{c[1]}-Q{c[2]}K{c[3]}-pcp{int(c[4])}-{c[5]}" for c in E2E_CASES])
def test_random_steps_match_reference(start_service, num_shards, interleave, hq, hk, pcp, dtype):
    svc = start_service(num_shards=num_shards, dcp_interleave=interleave, num_q_heads=hq, num_kv_heads=hk,
                        pcp_enabled=pcp, dtype=dtype)
    seed = 1000 * num_shards + 10 * interleave + hq // hk
    rng = random.Random(seed)
    oracle = Oracle(svc.config, seed)
    sids = [svc.add_sequence() for _ in range(3)]
    for request in random_workload(rng, sids, num_steps=7):
        run_step(svc, oracle, request)
    # A long prefill (PCP splits it when enabled) next to decodes of the others, in one step.
    extra = svc.add_sequence()
    run_step(svc, oracle, {sids[0]: 1, extra: 41, sids[2]: 1})
    run_step(svc, oracle, {extra: 1, sids[1]: 2})
    assert svc.sequences() == {s: oracle.length(s) for s in sids + [extra]}
    stats = svc.stats()
    assert stats["steps_committed"] == 9 and stats["steps_rolled_back"] == 0
    # Each shard holds exactly its DCP share of every sequence, in whole pages (slack under one block each).
    block_size = svc.config.block_size
    for shard in stats["shards"]:
        shares = [local_tokens(oracle.length(s), num_shards, shard["rank"], interleave) for s in sids + [extra]]
        assert shard["tokens"] == sum(shares)
        assert shard["blocks_used"] == sum(-(-n // block_size) for n in shares)
        assert shard["blocks_used"] + shard["blocks_free"] == svc.config.num_blocks_per_shard
        assert 0 <= shard["blocks_used"] * block_size - shard["tokens"] < block_size * len(shares)


@pytest.fixture(scope="module")
def two_shards(ray_session):
    """One 2-shard service (block_size 4) for the two tests below: a start was most of each one's time. The
    first leaves it empty (it frees everything and checks so); the second runs on it as on a fresh one."""
    from conftest import service_config

    svc = cpattn.start(service_config(num_shards=2, block_size=4))
    yield svc
    svc.shutdown()


def test_free_then_fresh_sequence_sees_no_stale_kv(two_shards):
    svc = two_shards
    assert svc.sequences() == {} and all(s["blocks_used"] == 0 for s in svc.stats()["shards"])
    oracle = Oracle(svc.config, 3)
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 13, b: 7})
    run_step(svc, oracle, {a: 1, b: 1})
    svc.free(a)
    oracle.drop(a)
    stats = svc.stats()
    for shard in stats["shards"]:
        expected = -(-local_tokens(8, 2, shard["rank"], 1) // 4)   # only b (8 tokens) remains
        assert shard["blocks_used"] == expected
        assert shard["tokens"] == local_tokens(8, 2, shard["rank"], 1)
    assert a not in svc.sequences()
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        svc.sequence_length(a)
    # The new sequence reuses a's rows and pages: it must see only its own tokens.
    c = svc.add_sequence()
    assert svc.sequence_length(c) == 0
    run_step(svc, oracle, {c: 3})
    run_step(svc, oracle, {c: 1, b: 1})
    run_step(svc, oracle, {c: 9})
    # Free everything: every page returns; a later sequence is again correct.
    svc.free(b)
    svc.free(c)
    oracle.drop(b)
    oracle.drop(c)
    assert all(s["blocks_used"] == 0 and s["tokens"] == 0 for s in svc.stats()["shards"])
    for _ in range(3):
        d = svc.add_sequence()
        run_step(svc, oracle, {d: 5})
        run_step(svc, oracle, {d: 1})
        svc.free(d)
        oracle.drop(d)


def test_several_clients_see_and_use_only_their_own_sequences(two_shards):
    svc1 = two_shards
    assert svc1.sequences() == {}
    svc2 = cpattn.connect(name=svc1.config.name, namespace=svc1.config.namespace)
    try:
        oracle = Oracle(svc1.config, 11)
        a = svc1.add_sequence()
        b = svc2.add_sequence()
        run_step(svc1, oracle, {a: 6})
        run_step(svc2, oracle, {b: 4})
        assert svc1.sequences() == {a: 6}
        assert svc2.sequences() == {b: 4}
        # Another client's id is unknown to a client (issue 12: ids are no longer shared capabilities).
        with pytest.raises(cpattn.errors.InvalidRequestError, match="unknown or freed sequence"):
            run_step(svc2, oracle, {a: 1, b: 1})
        with pytest.raises(cpattn.errors.InvalidRequestError, match="unknown or freed sequence"):
            svc2.sequence_length(a)
        run_step(svc2, oracle, {b: 1})
        run_step(svc1, oracle, {a: 3})
        assert svc1.sequence_length(a) == 9 and svc2.sequence_length(b) == 5
        assert svc1.sequences() == {a: 9} and svc2.sequences() == {b: 5}

        # Both clients stepping at the same time, each over its own data-plane group.
        oracles = {1: Oracle(svc1.config, 21), 2: Oracle(svc1.config, 22)}
        seqs = {1: svc1.add_sequence(), 2: svc2.add_sequence()}
        errors = []

        def worker(i, svc):
            try:
                rng = random.Random(i)
                for _ in range(5):
                    run_step(svc, oracles[i], {seqs[i]: rng.randint(1, 9)})
            except BaseException as exc:   # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(1, svc1)), threading.Thread(target=worker, args=(2, svc2))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads)
        assert svc2.sequences() == {b: 5, seqs[2]: oracles[2].length(seqs[2])}
    finally:
        svc2.close()
    # The service outlives a closed client.
    run_step(svc1, oracle, {a: 1})
