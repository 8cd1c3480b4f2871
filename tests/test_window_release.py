"""Pages outside every window go back to the pools (ServiceConfig.release_pages_outside_window), checked on the
coordinator's state alone (no Ray): what each row owns after every commit, forks, the journal's round trip, a
shard's refill from replicas, quotas; random geometries and fresh seeds. The service test with attention
outputs against float64 is tests/test_service_window_release.py."""

from __future__ import annotations

import random

import pytest

from conftest import service_config
from cpattn.cluster.recovery import refill_copies
from cpattn.cluster.sequence_table import SequenceTable
from cpattn.errors import CapacityError, InvalidRequestError
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator, restore_allocator
from service_oracle import local_tokens   # counts positions: independent of cpattn's DCP arithmetic


def _table(**overrides) -> SequenceTable:
    return SequenceTable(service_config(**overrides))


def _step(table: SequenceTable, request: dict) -> None:
    seqs = [table.sequences[s] for s in request]
    growth = table.grow(seqs, [s.length + n for s, n in zip(seqs, request.values())])
    table.begin(seqs, 1)
    table.commit(list(request), [s.length + n for s, n in zip(seqs, request.values())], 1)
    table.finish(growth)   # copy on write: the committed step drops the shared pages it copied


def _check_rows(table: SequenceTable) -> None:
    """Every row owns exactly its pages from the first one holding a token at or after length - W, counted by
    brute force, and the pools hold exactly the owned pages, once per owner."""
    alloc, window, bs = table.allocator, table.limits.window, table.config.block_size
    owners: list[dict[int, int]] = [{} for _ in range(alloc.num_shards)]
    for seq in table.sequences.values():
        for shard, row, owner in alloc._entries(seq.rows):
            t = alloc.tables[shard]
            first = local_tokens(max(0, seq.length - window), alloc.num_shards, owner, alloc.interleave) // bs
            assert t.num_released[row] == min(first, t.num_blocks[row]), (seq.seq_id, shard, row)
            for page in t.owned(row):
                owners[shard][page] = owners[shard].get(page, 0) + 1
    for shard, pool in enumerate(alloc.pools):
        assert pool.num_used_blocks == len(owners[shard])
        assert all(pool.ref_count(p) == n for p, n in owners[shard].items())


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(6)])
def test_rows_own_only_their_window_and_grow_past_the_cache(seed):
    rng = random.Random(seed)
    shards = rng.choice([1, 2, 3, 4])
    replicas = rng.choice([1, 2]) if shards > 1 else 1
    interleave = rng.choice([1, 4])
    windows = [rng.randint(1, 24), rng.randint(1, 24)]
    table = _table(num_shards=shards, kv_replicas=replicas, dcp_interleave=interleave, sliding_window=windows,
                   num_blocks_per_shard=24)
    assert table.limits.window == max(windows)
    cache = table.limits.cache_tokens()
    a, b = table.add("c-1", "a"), table.add("c-1", "b")
    for _ in range(120):
        request = {"a": rng.choice([1, 1, 1, 5, 17])}
        if rng.random() < 0.5:
            request["b"] = rng.choice([1, 3])
        _step(table, request)
        _check_rows(table)
        if rng.random() < 0.1:   # b's pages (released ones included) go back; a new b reuses what a released
            table.remove(table.sequences["b"])
            table.add("c-1", "b")
            _check_rows(table)
    assert a.length > cache >= table.limits.held_tokens(a) + table.limits.held_tokens(b)
    used = sum(table.blocks_used())
    assert used <= replicas * shards * 2 * (-(-max(windows) // (shards * 4)) + 2 + 17 // 4 + 1)
    for seq in list(table.sequences.values()):
        table.remove(seq)
    assert table.blocks_used() == [0] * shards


def test_released_pages_survive_the_journal_round_trip():
    rng = random.Random()
    table = _table(num_shards=3, kv_replicas=2, sliding_window=9, num_blocks_per_shard=40)
    for i in range(3):
        table.add("c-1", f"s{i}")
        for _ in range(rng.randint(5, 30)):
            _step(table, {f"s{i}": rng.choice([1, 7])})
    alloc = table.allocator
    fresh = ShardedKVAllocator(3, 40, 4, 1, table.config.max_sequences, 2, alloc.max_blocks_per_row)
    journaled = [(s.rows, s.length, alloc.pages_of(s.rows)) for s in table.sequences.values()]
    assert any(p == -1 for _, _, pages in journaled for row in pages.values() for p in row)
    restore_allocator(fresh, journaled)
    for seq in table.sequences.values():
        for shard, row, _ in alloc._entries(seq.rows):
            assert fresh.tables[shard].owned(row) == alloc.tables[shard].owned(row)
            assert fresh.tables[shard].num_released[row] == alloc.tables[shard].num_released[row]
            assert fresh.tables[shard].num_blocks[row] == alloc.tables[shard].num_blocks[row]
    assert [p.num_used_blocks for p in fresh.pools] == [p.num_used_blocks for p in alloc.pools]


def test_a_refill_copies_only_owned_pages():
    """A released id may be another sequence's page by now: the refill of a lost shard must not copy into it."""
    table = _table(num_shards=3, kv_replicas=2, sliding_window=6, num_blocks_per_shard=24)
    table.add("c-1", "long")
    for _ in range(40):
        _step(table, {"long": 3})
    table.add("c-1", "new")          # takes pages "long" released
    _step(table, {"new": 20})
    alloc = table.allocator
    rows = [s.rows for s in table.sequences.values()]
    for rank in range(3):
        owned = {p for s in rows for shard, row, _ in alloc._entries(s) if shard == rank
                 for p in alloc.tables[shard].owned(row)}
        copies = refill_copies(alloc, rows, rank)
        dst = [p for c in copies for p in c.dst_blocks]
        assert sorted(dst) == sorted(owned)     # every owned page once, no released id


def test_forks_start_where_the_window_still_holds_pages():
    table = _table(sliding_window=[8, 5], num_blocks_per_shard=32)
    src = table.add("c-1", "src")
    for _ in range(10):
        _step(table, {"src": 6})
    rows_before = table.allocator.tables[0].num_free_rows
    used_before = table.blocks_used()
    with pytest.raises(InvalidRequestError, match=r"cannot fork sequence src at 40 tokens: it holds 60.*"
                                                  r"release_pages_outside_window=False"):
        table.fork(src, "c-1", "early", 40)
    assert table.allocator.tables[0].num_free_rows == rows_before and table.blocks_used() == used_before
    assert table.fork(src, "c-1", "empty", 0).length == 0   # shares no page
    fork = table.fork(src, "c-1", "late", 58)      # its first query (position 58) sees keys from 51 on
    _step(table, {"late": 3})
    _check_rows(table)
    table.remove(src)
    _check_rows(table)                              # the fork's shared pages are its own now
    assert fork.length == 61
    kept = _table(sliding_window=[8, 5], num_blocks_per_shard=32, release_pages_outside_window=False)
    src = kept.add("c-1", "src")
    for _ in range(10):
        _step(kept, {"src": 6})
    assert kept.fork(src, "c-1", "early", 4).length == 4


def test_without_a_window_on_every_layer_nothing_is_released():
    for overrides in ({"sliding_window": [None, 4]}, {"sliding_window": 4, "release_pages_outside_window": False},
                      {}):
        table = _table(num_blocks_per_shard=16, **overrides)
        assert table.limits.window is None
        seq = table.add("c-1", "s")
        for _ in range(5):
            _step(table, {"s": 9})
        assert sum(table.blocks_used()) == 12      # 45 tokens over 3 shards in pages of 4: 4 pages each
        with pytest.raises(CapacityError, match=r"45 \+ 150 tokens exceed the whole KV cache \(192 tokens"):
            table.limits.check_growth(seq, 150, "num_tokens", "in")


def test_limits_count_the_window_a_sequence_holds():
    table = _table(sliding_window=10, num_blocks_per_shard=8, max_tokens_per_client=30)
    seq = table.add("c-1", "s")
    for _ in range(20):
        _step(table, {"s": 5})
    assert seq.length == 100 > table.limits.cache_tokens() == 96
    assert table.limits.held_tokens(seq) == 10
    table.limits.check_quota(table.owned_by("c-1"), 20)
    with pytest.raises(CapacityError, match="client quota: holding 10 tokens, this step adds 21"):
        table.limits.check_quota(table.owned_by("c-1"), 21)
    with pytest.raises(CapacityError, match=r"the 10 tokens of its window \+ 87 exceed the whole KV cache \(96"):
        table.limits.check_growth(seq, 87, "num_tokens", "in")
    with pytest.raises(CapacityError, match="exceed the longest block-table row of a windowed sequence"):
        table.limits.check_growth(seq, table.limits.capacity_tokens(), "num_tokens", "in")


@pytest.mark.parametrize("shards,interleave", [(1, 1), (2, 1), (3, 4), (4, 2)])
def test_next_page_end_is_where_some_shard_first_leaves_a_page_behind(shards, interleave):
    alloc = ShardedKVAllocator(shards, 8, 4, interleave, 2)
    for position in range(0, 120):
        dead = [alloc.dead_pages(position, r) for r in range(shards)]
        end = alloc.next_page_end(position)
        assert end > position
        assert all(alloc.dead_pages(p, r) == dead[r] for p in range(position, end) for r in range(shards))
        assert any(alloc.dead_pages(end, r) > dead[r] for r in range(shards))
