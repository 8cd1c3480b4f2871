"""Capacity and isolation between clients: CapacityError before anything is written, per-client quotas,
no client can evict or corrupt another's KV, per-client stats, unguessable and private sequence ids, sharing a
prefix only by its owner's token.
"""

from __future__ import annotations

import math
import re
import time

import pytest

import cpattn
from conftest import service_config
from cpattn.errors import AccessDeniedError, CapacityError, CpattnError, InvalidRequestError
from reliability_common import snapshot
from service_oracle import Oracle, checked_step, local_tokens

NUM_BLOCKS = 16   # per shard; block_size 4, 3 shards, dcp_interleave 1 -> 64 tokens per shard
TOL = 1e-10


@pytest.fixture(scope="module")
def two_clients(ray_session):
    svc = cpattn.start(service_config(num_shards=3, num_blocks_per_shard=NUM_BLOCKS, block_size=4, rpc_timeout_s=60.0))
    other = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)
    try:
        yield svc, other
    finally:
        other.close()
        svc.shutdown()


@pytest.fixture(autouse=True)
def _free_everything(request):
    """Each test starts and ends with no sequences, whatever it left behind when it failed."""
    yield
    if "two_clients" in request.fixturenames:
        for client in request.getfixturevalue("two_clients"):
            for sid in client.sequences():
                client.free(sid)


def _pages_needed(length: int, new: int) -> int:
    """Most new pages any shard needs to grow a sequence from ``length`` to ``length + new`` tokens."""
    return max(math.ceil(local_tokens(length + new, 3, r, 1) / 4) - math.ceil(local_tokens(length, 3, r, 1) / 4)
               for r in range(3))


def test_capacity_error_names_shard_needed_free_before_anything_is_written(two_clients):
    svc, other = two_clients
    oracle = Oracle(svc.config, 41)
    a = svc.add_sequence()
    checked_step(svc, oracle, {a: 20}, tol=TOL)
    c = svc.add_sequence()
    before = snapshot(svc, [other])
    free = {s["rank"]: s["blocks_free"] for s in svc.stats()["shards"]}
    for request in ({c: 3 * 4 * NUM_BLOCKS}, {a: 1, c: 3 * 4 * NUM_BLOCKS - 20}, {c: 5, a: 3 * 4 * NUM_BLOCKS - 22}):
        with pytest.raises(CapacityError, match=r"shard \d+ needs \d+ more KV blocks .* has \d+ free") as info:
            with svc.step(request):
                pytest.fail(f"the step {request} must not open")
        err = info.value
        assert err.shard in free and err.free == free[err.shard] and err.needed > err.free
        assert snapshot(svc, [other]) == before   # KV bytes, lengths, pages: nothing was written
    # Counts beyond the whole cache (up to absurd ones) are refused up front, with the same guarantee.
    for n in (3 * 4 * NUM_BLOCKS + 1, 10**9, 2**63, 10**30):
        with pytest.raises(CapacityError, match=r"exceed the whole KV cache \(192 tokens over 3 shards\)"):
            with svc.step({c: 1, a: n}):
                pytest.fail("the step must not open")
        assert snapshot(svc, [other]) == before
    checked_step(svc, oracle, {a: 1, c: 2}, tol=TOL)
    svc.free(a)
    svc.free(c)


def test_a_client_filling_the_service_cannot_evict_or_corrupt_another(two_clients):
    svc, other = two_clients
    oracle = Oracle(svc.config, 42)
    mine = [svc.add_sequence() for _ in range(2)]
    checked_step(svc, oracle, {mine[0]: 17, mine[1]: 6}, tol=TOL)
    # The other client fills every page it can get, in chunks, until the service is full.
    theirs, filled = [], 0
    while True:
        sid = other.add_sequence()
        theirs.append(sid)
        try:
            while True:
                other.fill_synthetic(sid, 8, seed=len(theirs))
                filled += 8
        except CapacityError:
            break
        finally:
            if other.sequences()[sid] == 0:
                other.free(sid)
                theirs.pop()
    stats = svc.stats(admin=True)
    assert min(s["blocks_free"] for s in stats["shards"]) <= 2, stats["shards"]
    assert stats["clients"][other.client_id] == {"sequences": len(theirs), "tokens": filled}
    assert stats["clients"][svc.client_id] == {"sequences": 2, "tokens": 23}
    # Mine are intact: same lengths, exact outputs for steps that fit in the pages they already own.
    assert svc.sequences() == {s: oracle.length(s) for s in mine}
    decoded = 0
    for sid in mine:
        while _pages_needed(oracle.length(sid), 1) == 0 and decoded < 4:
            checked_step(svc, oracle, {sid: 1}, tol=TOL)
            decoded += 1
    assert decoded >= 1
    # Needing a page now fails for me with CapacityError; nothing of mine was taken to make room.
    sid = mine[0]
    with pytest.raises(CapacityError):
        with svc.step({sid: 12}):
            pass
    # The other client frees; my sequences continue exactly, also across new pages.
    for t in theirs:
        other.free(t)
    assert other.sequences() == {}
    checked_step(svc, oracle, {mine[0]: 12, mine[1]: 5}, tol=TOL)
    checked_step(svc, oracle, {mine[0]: 1, mine[1]: 1}, tol=TOL)
    assert svc.stats()["clients"] == {svc.client_id: {"sequences": 2, "tokens": oracle.length(mine[0]) +
                                                     oracle.length(mine[1])}}
    for sid in mine:
        svc.free(sid)


def test_sequence_ids_are_unguessable_and_private(two_clients):
    svc, other = two_clients
    ids = [svc.add_sequence() for _ in range(200)]
    theirs = other.add_sequence()
    try:
        assert len(set(ids)) == len(ids)
        for sid in ids:
            # "seq-" + 16 random bytes, urlsafe base64: 128 bits, not a counter, not derived from the client.
            assert re.fullmatch(r"seq-[A-Za-z0-9_-]{22}", sid), sid
            assert svc.client_id not in sid
        # No shared structure: every position takes many values across ids (a counter or timestamp would not).
        for pos in range(4, 25):   # the last character carries only 2 random bits
            assert len({sid[pos] for sid in ids}) >= 20, pos
        # A counter or timestamp shares long prefixes; random ids share 4 characters after "seq-" with a successor
        # in ~1 of 80,000 runs of 200 ids (it happened once on CI, 2026-12-01), 5 in ~1 of 5 million. The pair is
        # printed so that a structural cause would show.
        longest = max(zip(ids, ids[1:]), key=lambda pair: len(_common_prefix(*pair)))
        assert len(_common_prefix(*longest)) < 4 + 5, longest
        # Listing shows only the caller's own sequences.
        assert set(svc.sequences()) == set(ids) and theirs not in svc.sequences()
        assert other.sequences() == {theirs: 0}
        # A guessed id in the right format is just unknown, and touches nothing.
        before = snapshot(svc, [other])
        for guess in (ids[0][:-1] + ("A" if ids[0][-1] != "A" else "B"), "seq-" + "A" * 22):
            with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
                with svc.step({guess: 1}):
                    pass
        assert snapshot(svc, [other]) == before
    finally:
        for sid in ids:
            svc.free(sid)
        other.free(theirs)


def _common_prefix(x: str, y: str) -> str:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


QUOTA = 40


@pytest.fixture(scope="module")
def quota_service(ray_session):
    svc = cpattn.start(service_config(num_shards=2, max_tokens_per_client=QUOTA, max_sequences_per_client=3,
                                       rpc_timeout_s=60.0))
    other = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)
    try:
        yield svc, other
    finally:
        other.close()
        svc.shutdown()


def test_per_client_quota_is_enforced_per_client_and_changes_nothing(quota_service):
    svc, other = quota_service
    oracle = Oracle(svc.config, 43)
    a, b = svc.add_sequence(), svc.add_sequence()
    checked_step(svc, oracle, {a: 25, b: 10}, tol=TOL)
    before = snapshot(svc, [other])
    with pytest.raises(CapacityError, match=rf"client quota: holding 35 tokens, this step adds 6, "
                                            rf"max_tokens_per_client is {QUOTA}"):
        with svc.step({a: 3, b: 3}):
            pass
    # The quota covers every way of adding KV, fill_synthetic included.
    with pytest.raises(CapacityError, match="client quota"):
        svc.fill_synthetic(a, 6)
    assert snapshot(svc, [other]) == before
    # Another client's quota is its own: my 35 tokens do not count against it.
    theirs = other.add_sequence()
    assert other.fill_synthetic(theirs, QUOTA) == QUOTA
    with pytest.raises(CapacityError, match="client quota"):
        other.fill_synthetic(theirs, 1)
    stats = svc.stats(admin=True)["clients"]
    assert stats[svc.client_id]["tokens"] == 35 and stats[other.client_id]["tokens"] == QUOTA
    checked_step(svc, oracle, {a: 3, b: 2}, tol=TOL)   # exactly up to the quota
    svc.free(b)
    oracle.drop(b)
    checked_step(svc, oracle, {a: 12}, tol=TOL)         # freeing gives quota back
    # Rows are a quota of their own: an empty sequence holds no tokens but does hold one of max_sequences' rows.
    extra = [svc.add_sequence(), svc.add_sequence()]
    before = snapshot(svc, [other])
    with pytest.raises(CapacityError, match="client quota: holding 3 sequences, max_sequences_per_client is 3"):
        svc.add_sequence()
    with pytest.raises(CapacityError, match="client quota"):   # (a holds the whole token quota too)
        svc.fork(a, 8)
    assert snapshot(svc, [other]) == before
    mine = other.add_sequence()                          # another client's rows are its own
    for seq in extra:
        svc.free(seq)
    other.free(mine)
    other.free(theirs)
    svc.free(a)


def test_forks_and_fills_inside_an_open_step_count_its_tokens(quota_service):
    """The open step's pages are held: a fork or fill made inside it took the client past its quota (50 of 40)."""
    svc, other = quota_service
    oracle = Oracle(svc.config, 44)
    a, c = svc.add_sequence(), svc.add_sequence()
    svc.fill_synthetic(c, 15)

    def in_step(step, layer):
        if layer == 0:
            before = snapshot(svc, [other])
            with pytest.raises(CapacityError, match="client quota: holding 35 tokens, this step adds 15"):
                svc.fork(c)
            with pytest.raises(CapacityError, match="client quota: holding 35 tokens, this step adds 6"):
                svc.fill_synthetic(c, 6)
            assert snapshot(svc, [other]) == before

    checked_step(svc, oracle, {a: 20}, after_layer=in_step, tol=TOL)
    assert svc.fill_synthetic(c, 5) == 20   # exactly up to the quota once the step committed
    svc.free(a)
    svc.free(c)


def test_a_client_closed_inside_its_step_gets_typed_errors_and_keeps_its_sequences(quota_service):
    """close() inside an open step (shutdown() too: an operator stops a service whatever its clients do): the step's
    next attend raised AttributeError ('NoneType' object has no attribute 'send_own_layers')."""
    svc, _ = quota_service
    client = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)
    oracle = Oracle(client.config, 45)
    s = client.add_sequence()
    checked_step(client, oracle, {s: 4}, tol=TOL)
    step = client.step({s: 2})
    step.__enter__()
    step.attend(0, *oracle.random_qkv(2))
    client.close()
    with pytest.raises(InvalidRequestError, match="this client was closed or shut down while the step was open"):
        step.attend(1, *oracle.random_qkv(2))
    try:
        step.__exit__(None, None, None)
    except CpattnError:   # (the service ended the client: a typed error or nothing)
        pass
    back = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace, credential=client.credential)
    try:
        assert back.sequences() == {s: 4}   # close() keeps its sequences; the step was rolled back
        checked_step(back, oracle, {s: 3}, tol=TOL)
    finally:
        back.free(s)
        back.close()


def test_sharing_needs_the_owners_token_and_survives_the_owner_freeing(two_clients):
    """Another client sees nothing of a sequence without its owner's share token; with it, it gets a fork of its
    own (the owner's KV untouched by the fork's writes); forged, altered and expired tokens are refused and
    change nothing; once the owner frees the sequence its tokens grant nothing more, and forks made before
    keep their KV (they hold references to its pages)."""
    svc, other = two_clients
    oracle = Oracle(svc.config, 43)
    a = svc.add_sequence()
    checked_step(svc, oracle, {a: 10}, tol=TOL)   # partly filled last pages: the fork's first write copies one
    before = snapshot(svc, [other])
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        other.fork(a)
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        other.share(a)
    token = svc.share(a)
    for forged, match in ((token[:-1] + ("0" if token[-1] != "0" else "1"), "not issued by this service"),
                          (token.replace("|10|", "|9|"), "not issued by this service"),
                          (token.replace(svc.client_id, other.client_id), "not issued by this service"),
                          ("share|" + "|".join(token.split("|")[1:5]) + "|" + "0" * 64, "not issued by this service"),
                          ("seq-" + "A" * 22, "not a share token"), (None, "not a share token")):
        with pytest.raises(AccessDeniedError, match=match):
            other.fork_shared(forged)
    expired = svc.share(a, ttl_s=0.01)
    time.sleep(0.05)
    with pytest.raises(AccessDeniedError, match=r"the share token expired \d+s ago"):
        other.fork_shared(expired)
    assert snapshot(svc, [other]) == before       # nothing a refused request touched
    theirs = other.fork_shared(token)
    oracle.fork(a, theirs, 10)
    assert other.sequences() == {theirs: 10} and theirs not in svc.sequences()
    with pytest.raises(InvalidRequestError, match="unknown or freed sequence"):
        with svc.step({theirs: 1}):               # the owner has no access to the grantee's fork either
            pass
    checked_step(other, oracle, {theirs: 3}, tol=TOL)
    checked_step(svc, oracle, {a: 2}, tol=TOL)    # the owner's pages were copied from, never written
    svc.free(a)
    oracle.drop(a)
    with pytest.raises(InvalidRequestError, match="the shared sequence was freed by its owner"):
        other.fork_shared(token)
    checked_step(other, oracle, {theirs: 1}, tol=TOL)
    other.free(theirs)
    assert all(s["blocks_used"] == 0 for s in svc.stats()["shards"])
