"""KV page bookkeeping of every sequence on every shard (the coordinator's side of the cache).

A sequence of length L holds ``dcp_local_seq_lens(L, N, r, I)`` tokens on shard r, in pages of
``block_size``. Growing a set of sequences is checked on every shard before any pool changes, so
a request that does not fit raises CapacityError and leaves all pools and tables as they were.
Each growth returns an undo record; undoing it restores pools and tables exactly (step rollback).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpattn.errors import CapacityError
from cpattn.kvstore.block_pool import BlockPool
from cpattn.kvstore.block_table import BlockTable
from cpattn.kvstore.sharding import dcp_local_seq_lens


@dataclass
class Growth:
    """What one grow() allocated: (shard, row, previous number of blocks) per touched row."""

    rows: list[tuple[int, int, int]] = field(default_factory=list)


class ShardedKVAllocator:
    def __init__(self, num_shards: int, blocks_per_shard: int, block_size: int, interleave: int,
                 max_rows: int):
        self.num_shards = num_shards
        self.block_size = block_size
        self.interleave = interleave
        self.pools = [BlockPool(blocks_per_shard, shard=r) for r in range(num_shards)]
        self.tables = [BlockTable(max_rows, blocks_per_shard) for _ in range(num_shards)]

    def local_tokens(self, seq_len: int, shard: int) -> int:
        return int(dcp_local_seq_lens([seq_len], self.num_shards, shard, self.interleave)[0])

    def blocks_for(self, seq_len: int, shard: int) -> int:
        return -(-self.local_tokens(seq_len, shard) // self.block_size)

    def can_add_row(self) -> bool:
        return all(t.can_add_row() for t in self.tables)

    def add_rows(self) -> list[int]:
        """One row per shard for a new sequence."""
        return [t.add_row() for t in self.tables]

    def needed_blocks(self, growths: list[tuple[list[int], int]]) -> list[int]:
        """Blocks each shard must allocate to grow each (rows, new_len)."""
        need = [0] * self.num_shards
        for rows, new_len in growths:
            for r in range(self.num_shards):
                need[r] += max(0, self.blocks_for(new_len, r) - self.tables[r].num_blocks[rows[r]])
        return need

    def grow(self, growths: list[tuple[list[int], int]]) -> Growth:
        """Give every (rows, new_len) the pages it needs; all shards or none."""
        need = self.needed_blocks(growths)
        for r, n in enumerate(need):
            if not self.pools[r].can_allocate(n):
                free = self.pools[r].num_free_blocks
                raise CapacityError(
                    f"shard {r} needs {n} more KV blocks for this step but has {free} free "
                    f"(of {self.pools[r].num_blocks}): free finished sequences, shorten the step, "
                    "or raise num_blocks_per_shard / num_shards", shard=r, needed=n, free=free)
            widest = max((self.blocks_for(new_len, r) for _, new_len in growths), default=0)
            if widest > self.tables[r].max_blocks_per_row:
                raise CapacityError(f"shard {r}: a sequence would need {widest} blocks, more than the pool holds",
                                    shard=r, needed=widest, free=self.pools[r].num_free_blocks)
        undo = Growth()
        for rows, new_len in growths:
            for r in range(self.num_shards):
                have = self.tables[r].num_blocks[rows[r]]
                extra = self.blocks_for(new_len, r) - have
                if extra > 0:
                    self.tables[r].append(rows[r], self.pools[r].allocate(extra))
                    undo.rows.append((r, rows[r], have))
        return undo

    def undo(self, growth: Growth) -> None:
        """Return what ``grow`` allocated; tables and pools end exactly as before it."""
        for r, row, had in reversed(growth.rows):
            self.pools[r].free(self.tables[r].truncate(row, had))

    def release(self, rows: list[int]) -> None:
        """Free a sequence's pages on every shard and make its rows reusable."""
        for r in range(self.num_shards):
            self.pools[r].free(self.tables[r].remove_row(rows[r]))
