"""A detached coordinator restarted by Ray keeps every sequence (issue 7), and the journal's restore
rebuilds pools and tables exactly, freeing pages of a step that never committed."""

from __future__ import annotations

import time

import pytest
import ray

import cpattn
from conftest import service_config
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator, restore_allocator
from cpattn.errors import StepFencedError
from reliability_common import kill_coordinator_and_wait_restored
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
        # Forks share pages by reference: the journal's page lists give each shared page one reference per
        # sequence again, so the forks (and a share token, signed with the journalled secret) survive.
        fa, fb = svc.fork(a), svc.fork(b, num_tokens=3)
        oracle.fork(a, fa, 12)
        oracle.fork(b, fb, 3)
        run_step(svc, oracle, {fa: 1})
        token = svc.share(a)
        before = svc.stats()
        assert sum(s["blocks_shared"] for s in before["shards"]) > 0
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
        assert svc.sequences() == {a: 12, b: 4, fa: 13, fb: 3}
        assert [(s["blocks_used"], s["blocks_shared"]) for s in after["shards"]] == [
            (s["blocks_used"], s["blocks_shared"]) for s in before["shards"]]
        run_step(svc, oracle, {a: 2, b: 5, fb: 2})   # continues exactly, same client and data plane
        fc = svc.fork_shared(token)
        oracle.fork(a, fc, 12)
        svc.free(a)
        oracle.drop(a)
        run_step(svc, oracle, {fa: 1, fc: 1})
        c = svc.add_sequence()
        run_step(svc, oracle, {c: 6, fa: 1})
    finally:
        svc.shutdown()
    names = [x["name"] for x in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(cfg.name)], names


def test_restart_during_an_open_step_fences_it_and_never_corrupts_another_client(ray_session):
    """Issue 12 item 1: client A has a step open when the coordinator restarts; the restored coordinator
    hands A's uncommitted pages to client B. A's remaining layers must never be written into them: the
    shards fence the old incarnation's step, A gets a clear error telling it to rerun, and both clients'
    outputs stay exact against the float64 oracle afterwards (A's rerun included)."""
    cfg = service_config(detached=True, num_layers=3, num_blocks_per_shard=16, health_check_interval_s=0.5,
                         rpc_timeout_s=30.0, collective_timeout_s=20.0)
    a = cpattn.start(cfg)
    b = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oa, ob = Oracle(cfg, seed=21), Oracle(cfg, seed=22)
        sa, sb = a.add_sequence(), b.add_sequence()
        run_step(a, oa, {sa: 5})
        run_step(b, ob, {sb: 3})
        free_before = [s["blocks_free"] for s in a.stats()["shards"]]
        # A opens a 24-token step (new pages on every shard) and attends its first layer only.
        step = a.step({sa: 24}).__enter__()
        q, k, v = oa.random_qkv(24)
        ref, _ = oa.reference({sa: 24}, 0, q, k, v)
        assert (step.attend(0, q, k, v).double() - ref).abs().max().item() <= 1e-10
        kill_coordinator_and_wait_restored(a)
        # The restored coordinator freed A's uncommitted pages; B's step takes them.
        assert [s["blocks_free"] for s in b.stats()["shards"]] == free_before
        run_step(b, ob, {sb: 24})
        # A goes on with its step: its next layer must not land in B's pages.
        q, k, v = oa.random_qkv(24)
        with pytest.raises(StepFencedError, match="run the step again"):
            step.attend(1, q, k, v)
        step.__exit__(None, None, None)
        run_step(b, ob, {sb: 2})            # exact on every layer: B's KV was not touched
        run_step(a, oa, {sa: 24})           # A reruns the step on the same client: exact
        run_step(b, ob, {sb: 1})
        assert a.sequences() == {sa: 29} and b.sequences() == {sb: 30}
    finally:
        b.close()
        a.shutdown()


def test_step_fence_refuses_old_incarnations_and_waits_for_writes_in_flight():
    """The shard-side rule, without Ray: raise_floor returns only after an old step's write ended."""
    import threading

    from cpattn.cluster.fencing import StepFence

    fence = StepFence()
    assert fence.admits(1) and fence.enter(1)          # an incarnation-1 step is writing a layer
    done = threading.Event()
    t = threading.Thread(target=lambda: (fence.raise_floor(2, timeout_s=10), done.set()))
    t.start()
    assert not done.wait(0.3)                          # the fence waits for that write ...
    fence.leave()
    assert done.wait(5)                                # ... and returns once it ended
    t.join()
    assert not fence.admits(1) and not fence.enter(1)  # incarnation 1 writes nothing more
    assert fence.enter(2)
    with pytest.raises(TimeoutError):                  # a write of incarnation 2 holds a fence at 3 back
        fence.raise_floor(3, timeout_s=0.2)
    fence.leave()
    assert fence.raise_floor(3, timeout_s=1)["floor"] == 3


def test_a_replacement_left_unfilled_by_a_dead_coordinator_is_replaced_again(ray_session):
    """A coordinator that dies while refilling a replacement shard leaves a live, named, half-empty shard. The
    restarted coordinator must not serve it (outputs would silently miss that shard's tokens): a replacement
    is 'ready' only once refilled, and an unready one is replaced (and refilled from the replicas) again."""
    from ray.util import get_placement_group

    from cpattn.cluster.journal import CoordinatorJournal
    from cpattn.cluster.shard_set import ShardSet, placement_group_name, shard_actor_name

    cfg = service_config(detached=True, kv_replicas=2, health_check_interval_s=60.0, rpc_timeout_s=30.0)
    svc = cpattn.start(cfg)
    try:
        oracle = Oracle(cfg, seed=8)
        a, b = svc.add_sequence(), svc.add_sequence()
        run_step(svc, oracle, {a: 14, b: 5})
        run_step(svc, oracle, {a: 1, b: 1})
        # What a coordinator dying mid-refill leaves behind: shard 1 replaced by an empty, unready one.
        bundle = svc.info()["shards"][1]["bundle_index"]
        old = ray.get_actor(shard_actor_name(cfg.name, bundle), namespace=cfg.namespace)
        ray.kill(old, no_restart=True)
        deadline = time.monotonic() + 60
        while True:   # the name is free once the old actor is gone
            try:
                ray.get_actor(shard_actor_name(cfg.name, bundle), namespace=cfg.namespace)
            except ValueError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        meta, _ = CoordinatorJournal(cfg.namespace, cfg.name).load()
        half = ShardSet(cfg, None, meta["shard_secret"])
        half._pg = get_placement_group(placement_group_name(cfg.name))
        unready = half._new_shard(bundle, ready=False)
        assert ray.get(unready.info.remote(meta["shard_secret"]), timeout=60).ready is False
        kill_coordinator_and_wait_restored(svc)
        run_step(svc, oracle, {a: 2, b: 3})        # exact: the unready shard was replaced and refilled
        assert svc.stats()["shards_replaced"] == 1
        run_step(svc, oracle, {a: 1})
        assert svc.sequences() == {a: 18, b: 9}
    finally:
        svc.shutdown()
