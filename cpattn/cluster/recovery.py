"""What to copy when a shard is replaced: pure bookkeeping, no Ray (tested alone).

With two replicas, shard r's tokens also live on ``replica_holder(r)`` in rows laid out like the
primary, so refilling is a page-for-page copy: the holder's replica pages -> the new shard's
primary pages, and the primary pages of ``primary_of(r)`` -> the new shard's replica pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.kvstore.sharded_allocator import SequenceRows, ShardedKVAllocator


@dataclass
class PageCopy:
    """Copy pages ``src_blocks`` of shard ``src`` into pages ``dst_blocks`` of the replaced shard."""

    src: int
    src_blocks: list[int]
    dst_blocks: list[int]


def refill_copies(allocator: ShardedKVAllocator, rows: list[SequenceRows], rank: int) -> list[PageCopy]:
    """Copies that rebuild shard ``rank`` (primary and replica pages) from the surviving shards."""
    holder, owner = allocator.replica_holder(rank), allocator.primary_of(rank)
    primary = PageCopy(holder, [], [])
    replica = PageCopy(owner, [], [])
    for seq in rows:
        if seq.replica is None:
            raise ValueError("refill needs replicated sequences (kv_replicas=2)")
        dst = allocator.tables[rank].row(seq.primary[rank])
        src = allocator.tables[holder].row(seq.replica[holder])
        primary.src_blocks += src[:len(dst)]
        primary.dst_blocks += dst[:len(src)]
        dst = allocator.tables[rank].row(seq.replica[rank])
        src = allocator.tables[owner].row(seq.primary[owner])
        replica.src_blocks += src[:len(dst)]
        replica.dst_blocks += dst[:len(src)]
    return [c for c in (primary, replica) if c.dst_blocks]
