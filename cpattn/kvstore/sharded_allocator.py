"""KV page bookkeeping of every sequence on every shard (the coordinator's side of the cache).

A sequence of length L holds ``dcp_local_seq_lens(L, N, r, I)`` tokens on shard r, in pages of
``block_size``. With two replicas, shard ``replica_holder(r)`` also keeps a copy of shard r's
tokens, in a second row laid out exactly like the primary (same local positions), so a lost
shard is refilled page for page. Growing a set of sequences is checked on every shard before
any pool changes, so a request that does not fit raises CapacityError and leaves all pools and
tables as they were. Each growth returns an undo record that restores them exactly (rollback).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpattn.errors import CapacityError
from cpattn.kvstore.block_pool import BlockPool
from cpattn.kvstore.block_table import BlockTable
from cpattn.kvstore.sharding import dcp_local_seq_len


@dataclass(frozen=True)
class SequenceRows:
    """Block-table rows of one sequence: ``primary[r]`` on shard r; ``replica[s]`` on shard s holds
    the copy of shard ``primary_of(s)``'s tokens (None without replication)."""

    primary: tuple[int, ...]
    replica: tuple[int, ...] | None = None


@dataclass
class Growth:
    """What one grow() allocated: (shard, row, previous number of blocks) per touched row."""

    rows: list[tuple[int, int, int]] = field(default_factory=list)


class ShardedKVAllocator:
    def __init__(self, num_shards: int, blocks_per_shard: int, block_size: int, interleave: int,
                 max_rows: int, replicas: int = 1):
        if replicas not in (1, 2) or (replicas == 2 and num_shards < 2):
            raise ValueError(f"replicas {replicas} with {num_shards} shards: use 1, or 2 with at least 2 shards")
        self.num_shards = num_shards
        self.block_size = block_size
        self.interleave = interleave
        self.replicas = replicas
        self.pools = [BlockPool(blocks_per_shard, shard=r) for r in range(num_shards)]
        rows_per_shard = max_rows * replicas
        self.tables = [BlockTable(rows_per_shard, blocks_per_shard) for _ in range(num_shards)]

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
        """(shard, row) -> page ids for every row of a sequence (what the journal persists)."""
        return {(shard, row): self.tables[shard].row(row) for shard, row, _ in self._entries(rows)}

    def add_rows(self) -> SequenceRows:
        """Rows on every shard for a new sequence (primary, and replica when replicated)."""
        primary = tuple(t.add_row() for t in self.tables)
        replica = tuple(t.add_row() for t in self.tables) if self.replicas == 2 else None
        return SequenceRows(primary, replica)

    def needed_blocks(self, growths: list[tuple[SequenceRows, int]]) -> list[int]:
        """Blocks each shard must allocate to grow each (rows, new_len)."""
        need = [0] * self.num_shards
        for rows, new_len in growths:
            for shard, row, owner in self._entries(rows):
                need[shard] += max(0, self.blocks_for(new_len, owner) - self.tables[shard].num_blocks[row])
        return need

    def grow(self, growths: list[tuple[SequenceRows, int]]) -> Growth:
        """Give every (rows, new_len) the pages it needs; all shards or none."""
        need = self.needed_blocks(growths)
        for r, n in enumerate(need):
            if not self.pools[r].can_allocate(n):
                free = self.pools[r].num_free_blocks
                raise CapacityError(
                    f"shard {r} needs {n} more KV blocks for this step but has {free} free "
                    f"(of {self.pools[r].num_blocks}): free finished sequences, shorten the step, "
                    "or raise num_blocks_per_shard / num_shards", shard=r, needed=n, free=free)
        undo = Growth()
        for rows, new_len in growths:
            for shard, row, owner in self._entries(rows):
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

    def release(self, rows: SequenceRows) -> None:
        """Free a sequence's pages on every shard and make its rows reusable."""
        for shard, row, _ in self._entries(rows):
            self.pools[shard].free(self.tables[shard].remove_row(row))


def restore_allocator(allocator: ShardedKVAllocator, sequences: list[tuple[SequenceRows, int, dict]]) -> None:
    """Fill a fresh allocator from persisted (rows, committed length, {(shard, row): pages}).

    Pages beyond what the committed length needs (a step that never committed) are dropped, so
    they return to the free pool.
    """
    for rows, length, pages in sequences:
        for shard, row, owner in allocator._entries(rows):
            keep = pages.get((shard, row), [])[:allocator.blocks_for(length, owner)]
            allocator.pools[shard].take(keep)
            allocator.tables[shard].claim_row(row)
            allocator.tables[shard].append(row, keep)
