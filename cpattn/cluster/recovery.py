"""What to copy when a shard is replaced: pure bookkeeping, no Ray (tested alone).

With two replicas, shard r's tokens also live on ``replica_holder(r)`` in rows laid out like the
primary, so refilling is a page-for-page copy: the holder's replica pages -> the new shard's
primary pages, and the primary pages of ``primary_of(r)`` -> the new shard's replica pages.
A page forked sequences share is listed once (its rows share it on the holder too), so a shared
prefix is rebuilt once, not once per fork.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpattn.kvstore.block_table import BlockTable
from cpattn.kvstore.sharded_allocator import SequenceRows, ShardedKVAllocator


@dataclass
class PageCopy:
    """Copy pages ``src_blocks`` of shard ``src`` into pages ``dst_blocks`` of the replaced shard."""

    src: int
    src_blocks: list[int]
    dst_blocks: list[int]
    seen: set[int] = field(default_factory=set, repr=False)
    """Pages of ``dst_blocks`` (a shared page is rebuilt once)."""


def refill_copies(allocator: ShardedKVAllocator, rows: list[SequenceRows], rank: int) -> list[PageCopy]:
    """Copies that rebuild shard ``rank`` (primary and replica pages) from the surviving shards."""
    holder, owner = allocator.replica_holder(rank), allocator.primary_of(rank)
    primary = PageCopy(holder, [], [])
    replica = PageCopy(owner, [], [])
    for seq in rows:
        if seq.replica is None:
            raise ValueError("refill needs replicated sequences (kv_replicas=2)")
        _add_pairs(primary, allocator.tables[holder], seq.replica[holder], allocator.tables[rank], seq.primary[rank])
        _add_pairs(replica, allocator.tables[owner], seq.primary[owner], allocator.tables[rank], seq.replica[rank])
    return [c for c in (primary, replica) if c.dst_blocks]


def _add_pairs(copy: PageCopy, src_table: BlockTable, src_row: int, dst_table: BlockTable, dst_row: int) -> None:
    """Page i of the source row -> page i of the destination row, for the pages ``copy`` does not rebuild yet.
    Released pages (a windowed sequence's, released alike in both rows) are skipped: their ids may be other
    sequences' pages by now."""
    seen = copy.seen
    skip = max(src_table.num_released[src_row], dst_table.num_released[dst_row])
    for s, d in zip(src_table.row(src_row)[skip:], dst_table.row(dst_row)[skip:]):
        if d not in seen:
            seen.add(d)
            copy.src_blocks.append(s)
            copy.dst_blocks.append(d)
