"""KV page bookkeeping of every sequence on every shard (the coordinator's side of the cache).

A sequence of length L holds ``dcp_local_seq_lens(L, N, r, I)`` tokens on shard r, in pages of
``block_size``. With two replicas, shard ``replica_holder(r)`` also keeps a copy of shard r's
tokens, in a second row laid out exactly like the primary (same local positions), so a lost
shard is refilled page for page. Growing a set of sequences is checked on every shard before
any pool changes, so a request that does not fit raises CapacityError and leaves all pools and
tables as they were. Each growth returns an undo record that restores them exactly (rollback).

Forked sequences (``fork_rows``) share their source's pages by reference count, on every shard and
replica row. A step that writes into a shared page (the partly filled last page of a shared prefix)
first gets a private copy of it (copy on write): ``grow`` allocates the copy and puts it in the row,
the step's plan tells the shard to copy the page's KV before writing, and the row's reference to the
shared page is dropped only when the step commits (``finish``), so a rollback puts it back untouched.

When every layer has a sliding window, pages holding only tokens no later query can see go back to the
pools as the sequence grows (``release_before``; block_table.py: the row keeps their ids, owns them no more),
so a sequence holds about its window, not its length, on each shard (vLLM's sliding-window manager does
the same). A fork may start only where its first query's window finds every page still held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpattn.errors import CapacityError
from cpattn.kvstore.block_pool import BlockPool
from cpattn.kvstore.block_table import PAD_BLOCK_ID, BlockTable
from cpattn.kvstore.sharding import dcp_local_seq_len


@dataclass(frozen=True)
class SequenceRows:
    """Block-table rows of one sequence: ``primary[r]`` on shard r; ``replica[s]`` on shard s holds
    the copy of shard ``primary_of(s)``'s tokens (None without replication)."""

    primary: tuple[int, ...]
    replica: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CopyOnWrite:
    """Row ``row`` of shard ``shard`` writes into page ``index``, which it shared (``shared``): it gets ``copy``."""

    shard: int
    row: int
    index: int
    shared: int
    copy: int


@dataclass
class Growth:
    """What one grow() allocated: (shard, row, previous number of blocks) per touched row, and the
    copy-on-write pages it put in place of shared ones."""

    rows: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[CopyOnWrite] = field(default_factory=list)

    def copies_on(self, shard: int) -> torch.Tensor:
        """[C, 2] int64 (shared page, its copy) the shard copies before the step writes (all layers)."""
        pairs = [(c.shared, c.copy) for c in self.copies if c.shard == shard]
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


class ShardedKVAllocator:
    def __init__(self, num_shards: int, blocks_per_shard: int, block_size: int, interleave: int,
                 max_rows: int, replicas: int = 1, max_blocks_per_row: int | None = None):
        """``max_blocks_per_row``: the longest row (default: the pool's size; longer where pages are released)."""
        if replicas not in (1, 2) or (replicas == 2 and num_shards < 2):
            raise ValueError(f"replicas {replicas} with {num_shards} shards: use 1, or 2 with at least 2 shards")
        self.num_shards = num_shards
        self.block_size = block_size
        self.interleave = interleave
        self.replicas = replicas
        self.pools = [BlockPool(blocks_per_shard, shard=r) for r in range(num_shards)]
        rows_per_shard = max_rows * replicas
        self.max_blocks_per_row = max_blocks_per_row or blocks_per_shard
        self.tables = [BlockTable(rows_per_shard, self.max_blocks_per_row) for _ in range(num_shards)]

    # Placement of replicas: half the ring away, so with ranks sorted by node the copy of a shard's
    # tokens sits on another node whenever nodes hold equal numbers of shards.
    def replica_holder(self, rank: int) -> int:
        return (rank + max(1, self.num_shards // 2)) % self.num_shards

    def primary_of(self, holder: int) -> int:
        return (holder - max(1, self.num_shards // 2)) % self.num_shards

    def local_tokens(self, seq_len: int, shard: int) -> int:
        return dcp_local_seq_len(seq_len, self.num_shards, shard, self.interleave)

    def blocks_for(self, seq_len: int, shard: int) -> int:
        return -(-self.local_tokens(seq_len, shard) // self.block_size)

    def _entries(self, rows: SequenceRows):
        """(shard, row, owner rank whose tokens the row holds) for every row of a sequence."""
        for r in range(self.num_shards):
            yield r, rows.primary[r], r
        if rows.replica is not None:
            for s in range(self.num_shards):
                yield s, rows.replica[s], self.primary_of(s)

    def can_add_row(self) -> bool:
        return all(t.num_free_rows >= self.replicas for t in self.tables)

    def pages_of(self, rows: SequenceRows) -> dict[tuple[int, int], list[int]]:
        """(shard, row) -> page ids for every row of a sequence, released ones as PAD_BLOCK_ID (what the journal
        persists: a released id may be another sequence's page by now)."""
        pages = {}
        for shard, row, _ in self._entries(rows):
            table = self.tables[shard]
            pages[(shard, row)] = [PAD_BLOCK_ID] * table.num_released[row] + table.owned(row)
        return pages

    def dead_pages(self, position: int, owner: int) -> int:
        """Pages of ``owner``'s tokens wholly before global ``position`` (the first key a query may still read)."""
        return self.local_tokens(max(0, position), owner) // self.block_size

    def next_page_end(self, position: int) -> int:
        """The smallest global position after ``position`` at which some shard's ``dead_pages`` grows: the position
        after the last token of the first page that ``position`` does not yet leave wholly behind, on any shard."""
        n, inter, bs = self.num_shards, self.interleave, self.block_size
        ends = []
        for owner in range(n):
            last = (self.dead_pages(position, owner) + 1) * bs - 1      # that page's last local token
            ends.append((last // inter) * n * inter + owner * inter + last % inter + 1)
        return min(ends)

    def release_before(self, rows: SequenceRows, position: int) -> int:
        """Every row of the sequence gives back its pages wholly before global ``position``; the number freed."""
        freed = 0
        for shard, row, owner in self._entries(rows):
            pages = self.tables[shard].release_prefix(row, self.dead_pages(position, owner))
            self.pools[shard].free(pages)
            freed += len(pages)
        return freed

    def released_past(self, rows: SequenceRows, position: int) -> bool:
        """Whether some row released a page holding a token at or after global ``position``."""
        return any(self.tables[shard].num_released[row] > self.dead_pages(position, owner)
                   for shard, row, owner in self._entries(rows))

    def add_rows(self) -> SequenceRows:
        """Rows on every shard for a new sequence (primary, and replica when replicated)."""
        primary = tuple(t.add_row() for t in self.tables)
        replica = tuple(t.add_row() for t in self.tables) if self.replicas == 2 else None
        return SequenceRows(primary, replica)

    def shared_page_written(self, shard: int, row: int, owner: int, old_len: int, new_len: int) -> int | None:
        """Index of a page the row shares with another sequence that growing old_len -> new_len writes into
        (its partly filled last page), else None. Only that page can be: later tokens go to new pages."""
        local_old = self.local_tokens(old_len, owner)
        if local_old % self.block_size == 0 or self.local_tokens(new_len, owner) == local_old:
            return None
        index = local_old // self.block_size
        table = self.tables[shard]
        if index >= table.num_blocks[row]:
            return None
        return index if self.pools[shard].ref_count(table.block_at(row, index)) > 1 else None

    def needed_blocks(self, growths: list[tuple[SequenceRows, int]],
                      old_lengths: list[int] | None = None) -> list[int]:
        """Blocks each shard must allocate to grow each (rows, new_len), copy-on-write pages included
        when the lengths before (``old_lengths``) are given."""
        need = [0] * self.num_shards
        for i, (rows, new_len) in enumerate(growths):
            for shard, row, owner in self._entries(rows):
                need[shard] += max(0, self.blocks_for(new_len, owner) - self.tables[shard].num_blocks[row])
                if old_lengths is not None:
                    need[shard] += self.shared_page_written(shard, row, owner, old_lengths[i], new_len) is not None
        return need

    def grow(self, growths: list[tuple[SequenceRows, int]], old_lengths: list[int] | None = None) -> Growth:
        """Give every (rows, new_len) the pages it needs; all shards or none. With ``old_lengths`` (each
        sequence's length before), a shared page the growth writes into is replaced by a copy."""
        need = self.needed_blocks(growths, old_lengths)
        for r, n in enumerate(need):
            if not self.pools[r].can_allocate(n):
                pool = self.pools[r]
                free, shared = pool.num_free_blocks, pool.num_shared_blocks
                raise CapacityError(
                    f"shard {r} needs {n} more KV blocks for this step but has {free} free "
                    f"(of {pool.num_blocks}; {shared} of its used blocks are shared by forked sequences and "
                    "count once): free finished sequences, shorten the step, "
                    "or raise num_blocks_per_shard / num_shards", shard=r, needed=n, free=free)
        undo = Growth()
        for i, (rows, new_len) in enumerate(growths):
            for shard, row, owner in self._entries(rows):
                index = None if old_lengths is None else self.shared_page_written(shard, row, owner,
                                                                                    old_lengths[i], new_len)
                if index is not None:
                    copy = self.pools[shard].allocate(1)[0]
                    shared = self.tables[shard].replace(row, index, copy)
                    undo.copies.append(CopyOnWrite(shard, row, index, shared, copy))
                have = self.tables[shard].num_blocks[row]
                extra = self.blocks_for(new_len, owner) - have
                if extra > 0:
                    self.tables[shard].append(row, self.pools[shard].allocate(extra))
                    undo.rows.append((shard, row, have))
        return undo

    def undo(self, growth: Growth) -> None:
        """Return what ``grow`` allocated; tables and pools end exactly as before it."""
        for r, row, had in reversed(growth.rows):
            self.pools[r].free(self.tables[r].truncate(row, had))
        for c in reversed(growth.copies):
            self.tables[c.shard].replace(c.row, c.index, c.shared)
            self.pools[c.shard].free([c.copy])
        growth.rows, growth.copies = [], []

    def finish(self, growth: Growth) -> None:
        """The growth's step committed: rows that copied a shared page drop their reference to it."""
        for c in growth.copies:
            self.pools[c.shard].free([c.shared])
        growth.rows, growth.copies = [], []

    def fork_rows(self, source: SequenceRows, num_tokens: int) -> SequenceRows:
        """Rows of a new sequence whose first ``num_tokens`` tokens are ``source``'s: the pages holding them
        are shared (one more reference each, on every shard and replica row), none is copied."""
        rows = self.add_rows()
        for (shard, src_row, owner), (_, dst_row, _) in zip(self._entries(source), self._entries(rows)):
            table = self.tables[shard]
            pages = table.row(src_row)[:self.blocks_for(num_tokens, owner)]
            released = min(table.num_released[src_row], len(pages))   # ids the source no longer owns: not shared
            self.pools[shard].incref(pages[released:])
            table.append(dst_row, pages)
            table.release_prefix(dst_row, released)
        return rows

    def release(self, rows: SequenceRows) -> None:
        """Free a sequence's pages on every shard and make its rows reusable."""
        for shard, row, _ in self._entries(rows):
            self.pools[shard].free(self.tables[shard].remove_row(row))


def restore_allocator(allocator: ShardedKVAllocator, sequences: list[tuple[SequenceRows, int, dict]]) -> None:
    """Fill a fresh allocator from persisted (rows, committed length, {(shard, row): pages}).

    Pages beyond what the committed length needs (a step that never committed) are dropped, so
    they return to the free pool. A page several sequences list (a forked prefix) gets one reference
    per sequence, so forks survive a restart exactly as they were shared. Released pages (PAD_BLOCK_ID,
    leading) stay released; their ids in the row become the row's first owned page (no kernel reads them).
    """
    taken: list[list[int]] = [[] for _ in range(allocator.num_shards)]
    for rows, length, pages in sequences:
        for shard, row, owner in allocator._entries(rows):
            keep = pages.get((shard, row), [])[:allocator.blocks_for(length, owner)]
            released = next((i for i, p in enumerate(keep) if p != PAD_BLOCK_ID), len(keep))
            owned = keep[released:]
            taken[shard] += owned
            table = allocator.tables[shard]
            table.claim_row(row)
            table.append(row, [owned[0] if owned else 0] * released + owned)
            table.release_prefix(row, released)
    for shard, blocks in enumerate(taken):
        allocator.pools[shard].take(blocks)
