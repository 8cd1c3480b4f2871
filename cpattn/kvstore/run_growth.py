"""The pages of a decode run's later steps, found at once.

A decode run (cluster/decode_run.py) grows every sequence by one token per step. Grown one step at a time
(``ShardedKVAllocator.grow`` per step), each step asked every row of every sequence what it needs:
~1 ms per step at B=64 on the coordinator, the largest part of a batched run's plan. But one token changes
one rank's rows only (its owner's primary row and that rank's replica row), and it needs something only when
it opens a page (its local position is a multiple of block_size) or is the first token of the run on a rank
whose last page is shared (a forked prefix's partly filled page: copy on write). Those events are found for the
whole run with a few tensor operations; only they touch pools and tables.

The result is exactly what ``grow`` step by step gives (tests/test_run_growth.py): the same pages, in the
same order, the same undo records, the run shortened at the same step when a pool runs out.
Legend: S steps, B sequences.
"""

from __future__ import annotations

import torch

from cpattn.kvstore.sharded_allocator import CopyOnWrite, Growth, SequenceRows, ShardedKVAllocator


def grow_decode_run(allocator: ShardedKVAllocator, rows: list[SequenceRows], lengths: list[int],
                    num_steps: int, first_step: int = 1) -> list[Growth]:
    """Growths of a run's steps first_step .. num_steps-1 (step j adds the token at position ``lengths[b] + j``;
    the steps before first_step were grown already), each all shards or none; stops before the first step the
    pools cannot take (``first_step=0, num_steps=1``: one decode step's growth, or [] when it does not fit)."""
    if num_steps <= first_step or not rows:
        return []
    n, inter, bs = allocator.num_shards, allocator.interleave, allocator.block_size
    pos_SB = torch.tensor(lengths, dtype=torch.int64)[None, :] + torch.arange(num_steps, dtype=torch.int64)[:, None]
    owner_SB = (pos_SB // inter) % n
    local_SB = (pos_SB // (n * inter)) * inter + pos_SB % inter
    # Read as Python lists: indexing a tensor element by element cost ~1 us an element (most of a B=64 run's growth).
    owners, locals_ = owner_SB.tolist(), local_SB.tolist()
    events: list[list[tuple[int, int, int]]] = [[] for _ in range(num_steps)]   # per step: (seq, owner, local pos)
    for j, b in (local_SB[first_step:] % bs == 0).nonzero().tolist():   # a token that opens a page
        events[first_step + j].append((b, owners[first_step + j][b], locals_[first_step + j][b]))
    for j, b, owner, local in _first_tokens_mid_page(owner_SB, locals_, n, bs, first_step):
        if any(_shared_page(allocator, shard, row, local // bs) for shard, row in _rows_of(allocator, rows[b], owner)):
            events[j].append((b, owner, local))
    growths = []
    for j in range(first_step, num_steps):
        step = sorted(events[j])   # grow's order: sequences in order, then each one's rows
        if not _fits(allocator, rows, step):
            break
        growths.append(_grow_step(allocator, rows, step))
    return growths


def _first_tokens_mid_page(owner_SB: torch.Tensor, local_SB: list[list[int]], n: int, bs: int, first_step: int):
    """(step, seq, owner, local pos) of each sequence's first token of the run on a rank, from ``first_step`` on
    and inside a page: the only tokens that can write into a shared page (later ones write where it wrote)."""
    for r in range(n):
        on_r = owner_SB == r
        first_j = on_r.to(torch.int8).argmax(dim=0)   # the first step whose token lands on r (0 if none)
        first_of = first_j.tolist()
        for b in ((first_j >= first_step) & on_r.any(dim=0)).nonzero().flatten().tolist():
            j = first_of[b]
            local = local_SB[j][b]
            if local % bs:
                yield j, b, r, local


def _rows_of(allocator: ShardedKVAllocator, rows: SequenceRows, owner: int) -> list[tuple[int, int]]:
    """(shard, row) holding ``owner``'s tokens of a sequence: its primary row there, and the replica row."""
    held = [(owner, rows.primary[owner])]
    if rows.replica is not None:
        holder = allocator.replica_holder(owner)
        held.append((holder, rows.replica[holder]))
    return held


def _shared_page(allocator: ShardedKVAllocator, shard: int, row: int, index: int) -> bool:
    table = allocator.tables[shard]
    return index < table.num_blocks[row] and allocator.pools[shard].ref_count(table.block_at(row, index)) > 1


def _fits(allocator: ShardedKVAllocator, rows: list[SequenceRows], step: list[tuple[int, int, int]]) -> bool:
    """Every shard can give this step's pages and copies (one each: a token opening a page it lacks, a copy)."""
    need = [0] * allocator.num_shards
    for b, owner, local in step:
        for shard, row in _rows_of(allocator, rows[b], owner):
            need[shard] += bool(local % allocator.block_size) or local // allocator.block_size + 1 > \
                allocator.tables[shard].num_blocks[row]
    return all(allocator.pools[r].can_allocate(k) for r, k in enumerate(need))


def _grow_step(allocator: ShardedKVAllocator, rows: list[SequenceRows], step: list[tuple[int, int, int]]) -> Growth:
    bs = allocator.block_size
    growth = Growth()
    for b, owner, local in step:
        for shard, row in _rows_of(allocator, rows[b], owner):
            table, pool = allocator.tables[shard], allocator.pools[shard]
            if local % bs:   # copy on write of the shared page the token writes into
                copy = pool.allocate(1)[0]
                growth.copies.append(CopyOnWrite(shard, row, local // bs, table.replace(row, local // bs, copy), copy))
                continue
            have = table.num_blocks[row]
            if local // bs + 1 > have:
                table.append(row, pool.allocate(local // bs + 1 - have))
                growth.rows.append((shard, row, have))
    return growth
