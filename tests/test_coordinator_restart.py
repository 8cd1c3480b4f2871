"""A detached coordinator restarted by Ray keeps every sequence (issue 7), and the journal's restore
rebuilds pools and tables exactly, freeing pages of a step that never committed."""

from __future__ import annotations

import time

import pytest
import ray

import cpattn
from conftest import service_config
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator, restore_allocator
from service_oracle import Oracle, run_step



@pytest.mark.parametrize("replicas", [1, 2])
def test_restore_allocator_rebuilds_committed_state_and_frees_uncommitted_pages(replicas):
    alloc = ShardedKVAllocator(3, 40, 4, 1, max_rows=8, replicas=replicas)
    seqs = [alloc.add_rows() for _ in range(3)]
    lengths = [13, 0, 30]
    alloc.grow([(rows, n) for rows, n in zip(seqs, lengths)])
    committed = [(rows, n, alloc.pages_of(rows)) for rows, n in zip(seqs, lengths)]
    expected_free = [p.num_free_blocks for p in alloc.pools]
    # An uncommitted step grows sequence 0 further; the journal still says 13 tokens.
    alloc.grow([(seqs[0], 40)])
    journaled = [(rows, n, alloc.pages_of(rows)) for rows, n, _ in committed]

    fresh = ShardedKVAllocator(3, 40, 4, 1, max_rows=8, replicas=replicas)
    restore_allocator(fresh, journaled)
    assert [p.num_free_blocks for p in fresh.pools] == expected_free
    for rows, n, pages in committed:
        assert fresh.pages_of(rows) == pages
    # The restored allocator keeps working: a new sequence gets rows and pages nobody else holds.
    new = fresh.add_rows()
    fresh.grow([(new, 12)])
    for shard in range(3):
        mine = {b for (s, _), pages in fresh.pages_of(new).items() if s == shard for b in pages}
        others = {b for rows, _, _ in committed for (s, _), pages in fresh.pages_of(rows).items() if s == shard for b in pages}
        assert not mine & others


def test_restarted_coordinator_keeps_sequences_and_outputs_stay_exact(ray_session):
    cfg = service_config(detached=True, kv_replicas=2, health_check_interval_s=0.5, rpc_timeout_s=30.0)
    svc = cpattn.start(cfg)
    try:
        oracle = Oracle(cfg, seed=7)
        a, b = svc.add_sequence(), svc.add_sequence()
        run_step(svc, oracle, {a: 11, b: 3})
        run_step(svc, oracle, {a: 1, b: 1})
        before = svc.stats()
        ray.kill(svc.gateway.coordinator, no_restart=False)     # Ray restarts a detached coordinator
        deadline = time.monotonic() + 60
        while True:   # ray.kill is asynchronous: wait for the restarted instance, not the old one
            try:
                if svc.info()["restored"]:
                    break
            except cpattn.CpattnError:
                pass
            assert time.monotonic() < deadline, "coordinator did not come back within 60 s"
            time.sleep(0.5)
        after = svc.stats()
        assert svc.sequences() == {a: 12, b: 4}
        assert [s["blocks_used"] for s in after["shards"]] == [s["blocks_used"] for s in before["shards"]]
        run_step(svc, oracle, {a: 2, b: 5})          # continues exactly, same client and data plane
        c = svc.add_sequence()
        run_step(svc, oracle, {c: 6, a: 1})
    finally:
        svc.shutdown()
    names = [x["name"] for x in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(cfg.name)], names
