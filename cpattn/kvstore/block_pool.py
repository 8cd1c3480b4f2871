"""A shard's pool of KV pages: free list plus reference counts.

Question/command pairs (``can_allocate`` / ``allocate``) let callers check every shard before
changing any, so a request that does not fit leaves all pools exactly as they were.
"""

from __future__ import annotations

from collections import deque

from cpattn.errors import CapacityError, CpattnError, InvalidRequestError


class BlockPool:
    """Fixed set of block ids ``0 .. num_blocks-1``; a block is free when its refcount is 0."""

    def __init__(self, num_blocks: int, shard: int | None = None):
        if num_blocks < 1:
            raise InvalidRequestError(f"num_blocks {num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.shard = shard
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (refcount 1 each); all or nothing."""
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if not self.can_allocate(num_blocks):
            where = f"shard {self.shard}" if self.shard is not None else "block pool"
            raise CapacityError(
                f"{where}: needs {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}: "
                "free finished sequences, add shards, or raise num_blocks_per_shard",
                shard=self.shard, needed=num_blocks, free=len(self._free))
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def take(self, blocks: list[int]) -> None:
        """Mark specific free blocks as allocated (restoring persisted state)."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._ref_counts[b] != 0:
                raise CpattnError(f"cannot take block {b}: out of range or already in use")
        taken = set(blocks)
        self._free = deque(b for b in self._free if b not in taken)
        for b in blocks:
            self._ref_counts[b] = 1

    def incref(self, blocks: list[int]) -> None:
        """Share already-allocated blocks (e.g. a forked prefix)."""
        self._check_owned(blocks, "incref")
        for b in blocks:
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block returns to the pool at refcount 0.

        Freeing a block that is already free is an error, raised before any refcount changes.
        """
        self._check_owned(blocks, "free")
        seen: dict[int, int] = {}
        for b in blocks:
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self._ref_counts[b]:
                raise CpattnError(f"double free of block {b} (refcount {self._ref_counts[b]})")
        for b in blocks:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _check_owned(self, blocks: list[int], action: str) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise CpattnError(f"cannot {action} block {b}: ids run 0..{self.num_blocks - 1}")
            if self._ref_counts[b] == 0:
                raise CpattnError(f"cannot {action} block {b}: it is free (double free or stale id)")
