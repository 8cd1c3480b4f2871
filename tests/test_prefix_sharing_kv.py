"""Forked sequences in the page bookkeeping: shared pages by reference count, copy on write, rollback, restore.

Pure kvstore (no Ray). Positions are counted independently: token p lives on shard (p // I) % N.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpattn.errors import CapacityError
from cpattn.kvstore import copy_pages
from cpattn.cluster.recovery import refill_copies
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator, restore_allocator
from service_oracle import local_tokens

BLOCK = 4


def pages(alloc, rows):
    return {k: list(v) for k, v in alloc.pages_of(rows).items()}


def snapshot(alloc):
    return ([alloc.pools[s].num_free_blocks for s in range(alloc.num_shards)],
            [[alloc.pools[s].ref_count(b) for b in range(alloc.pools[s].num_blocks)] for s in range(alloc.num_shards)],
            [{r: t.row(r) for r in range(t.rows_RW.shape[0]) if t.num_blocks[r]} for t in alloc.tables])


@pytest.mark.parametrize("num_shards,interleave,replicas", [(3, 1, 1), (3, 16, 1), (2, 1, 2), (5, 16, 2), (1, 1, 1)])
def test_fork_shares_pages_and_copies_only_the_written_shared_page(num_shards, interleave, replicas):
    rng = random.Random(num_shards * 100 + interleave)
    alloc = ShardedKVAllocator(num_shards, 200, BLOCK, interleave, max_rows=8, replicas=replicas)
    src = alloc.add_rows()
    length = rng.randint(40, 120)
    alloc.finish(alloc.grow([(src, length)], [0]))
    used = [p.num_used_blocks for p in alloc.pools]
    cut = rng.randint(1, length)
    fork = alloc.fork_rows(src, cut)
    assert [p.num_used_blocks for p in alloc.pools] == used           # nothing allocated, nothing copied
    for (shard, row), fp in pages(alloc, fork).items():
        owner = shard if row in fork.primary and fork.primary[shard] == row else alloc.primary_of(shard)
        assert len(fp) == -(-local_tokens(cut, num_shards, owner, interleave) // BLOCK)
    for key_f, key_s in zip(pages(alloc, fork), pages(alloc, src)):
        fp, sp = pages(alloc, fork)[key_f], pages(alloc, src)[key_s]
        assert fp == sp[:len(fp)]
        assert all(alloc.pools[key_f[0]].ref_count(b) == 2 for b in fp)
    # The fork's next token: on its owner shard it writes local position local_tokens(cut); a copy exactly when
    # that position falls inside a page it shares (a partly covered page), on the primary and its replica.
    before = snapshot(alloc)
    growth = alloc.grow([(fork, cut + 1)], [cut])
    owner = (cut // interleave) % num_shards
    local = local_tokens(cut, num_shards, owner, interleave)
    expect_copy = local % BLOCK != 0
    holders = {owner} | ({alloc.replica_holder(owner)} if replicas == 2 else set())
    assert {c.shard for c in growth.copies} == (holders if expect_copy else set())
    for c in growth.copies:
        assert c.index == local // BLOCK and alloc.pools[c.shard].ref_count(c.shared) == 2   # released at commit
        assert growth.copies_on(c.shard).tolist() == [[c.shared, c.copy]]
    alloc.undo(growth)
    assert snapshot(alloc) == before                                      # rollback: exactly as before
    growth = alloc.grow([(fork, cut + 1)], [cut])
    alloc.finish(growth)
    for c in growth.copies:
        assert alloc.pools[c.shard].ref_count(c.shared) == 1 and alloc.pools[c.shard].ref_count(c.copy) == 1
    # Freeing the source leaves the fork's pages (only its copies and shared prefix) allocated.
    alloc.release(src)
    fork_pages = {(s, b) for (s, _), bs in pages(alloc, fork).items() for b in bs}
    used_now = {(s, b) for s in range(num_shards) for b in range(200) if alloc.pools[s].ref_count(b)}
    assert used_now == fork_pages
    alloc.release(fork)
    assert all(p.num_free_blocks == 200 and p.num_shared_blocks == 0 for p in alloc.pools)


def test_both_sides_copy_and_a_full_page_is_never_copied():
    alloc = ShardedKVAllocator(2, 50, BLOCK, 1, max_rows=4)
    a = alloc.add_rows()
    alloc.finish(alloc.grow([(a, 6)], [0]))        # 3 tokens a shard: one partly filled page each
    b = alloc.fork_rows(a, 6)
    assert [p.num_shared_blocks for p in alloc.pools] == [1, 1]
    growth = alloc.grow([(a, 7), (b, 7)], [6, 6])  # both write token 6 (shard 0, local position 3)
    assert [(c.shard, c.index) for c in growth.copies] == [(0, 0), (0, 0)]
    alloc.finish(growth)
    assert alloc.pools[0].num_shared_blocks == 0 and alloc.pools[0].num_used_blocks == 2
    c = alloc.fork_rows(b, 8)                       # 4 tokens a shard: full pages, later tokens on new pages
    assert alloc.grow([(c, 9)], [8]).copies == []


def test_capacity_error_counts_shared_pages_and_changes_nothing():
    alloc = ShardedKVAllocator(1, 3, BLOCK, 1, max_rows=4)
    a = alloc.add_rows()
    alloc.finish(alloc.grow([(a, 10)], [0]))       # 3 pages, the last partly filled
    b = alloc.fork_rows(a, 10)
    before = snapshot(alloc)
    with pytest.raises(CapacityError, match=r"shard 0 needs 1 more KV blocks .* 0 free \(of 3; 3 of its used blocks "
                                            r"are shared by forked sequences"):
        alloc.grow([(b, 11)], [10])
    assert snapshot(alloc) == before


def test_restore_keeps_forks_with_their_references():
    alloc = ShardedKVAllocator(3, 60, BLOCK, 16, max_rows=6, replicas=2)
    a = alloc.add_rows()
    alloc.finish(alloc.grow([(a, 100)], [0]))
    b = alloc.fork_rows(a, 70)
    alloc.finish(alloc.grow([(b, 75)], [70]))
    c = alloc.fork_rows(b, 75)
    seqs = [(a, 100, pages(alloc, a)), (b, 75, pages(alloc, b)), (c, 75, pages(alloc, c))]
    fresh = ShardedKVAllocator(3, 60, BLOCK, 16, max_rows=6, replicas=2)
    restore_allocator(fresh, seqs)
    assert snapshot(fresh)[:2] == snapshot(alloc)[:2]
    assert [p.num_shared_blocks for p in fresh.pools] == [p.num_shared_blocks for p in alloc.pools]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_copy_pages_copies_bits_of_every_cache_dtype(dtype):
    cache = torch.randn(2, 6, 4, 2, 3, dtype=torch.float64).to(dtype)
    expected = cache.clone()
    expected[:, 4], expected[:, 1] = cache[:, 0], cache[:, 3]
    copy_pages(cache, torch.tensor([[0, 4], [3, 1]]))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_refill_rebuilds_each_shared_page_once():
    alloc = ShardedKVAllocator(3, 60, BLOCK, 1, max_rows=6, replicas=2)
    a = alloc.add_rows()
    alloc.finish(alloc.grow([(a, 50)], [0]))
    forks = [alloc.fork_rows(a, n) for n in (50, 31, 7)]
    alloc.finish(alloc.grow([(forks[1], 33)], [31]))
    rows = [a] + forks
    for rank in range(3):
        for copy in refill_copies(alloc, rows, rank):
            assert len(copy.dst_blocks) == len(set(copy.dst_blocks))       # each page rebuilt once
            primary = copy.src == alloc.replica_holder(rank)
            needed = {b for r in rows for b in alloc.tables[rank].row(r.primary[rank] if primary else r.replica[rank])}
            assert set(copy.dst_blocks) == needed                          # and every page of the shard rebuilt
