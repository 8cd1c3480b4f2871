"""A shard's pool of KV pages: free list plus reference counts, as compact arrays.

Question/command pairs (``can_allocate`` / ``allocate``) let callers check every shard before
changing any, so a request that does not fit leaves all pools exactly as they were.

The coordinator keeps one pool per shard for the service's lifetime, so a pool costs 8 bytes per
block (an int32 reference count and an int32 slot of the free ring), never a Python object per block:
a million-block shard is 8 MB, not hundreds (config.COORDINATOR_BOOKKEEPING_BYTES).
"""

from __future__ import annotations

from array import array

from cpattn.errors import CapacityError, CpattnError, InvalidRequestError

MAX_BLOCKS = 2**31 - 1   # ids are int32 here (and in the kernels' block tables)


class BlockPool:
    """Fixed set of block ids ``0 .. num_blocks-1``; a block is free when its refcount is 0.

    Free blocks form a FIFO ring (``_ring[_head : _head + _num_free]``, modulo num_blocks): a freed block
    goes to the back, allocation takes from the front, so recently freed pages are reused last.
    """

    def __init__(self, num_blocks: int, shard: int | None = None):
        if not 1 <= num_blocks <= MAX_BLOCKS:
            raise InvalidRequestError(f"num_blocks {num_blocks} must be in 1..{MAX_BLOCKS}")
        self.num_blocks = num_blocks
        self.shard = shard
        self._ring = array("i", range(num_blocks))
        self._head = 0
        self._num_free = num_blocks
        self._ref_counts = array("i", bytes(4 * num_blocks))
        self._num_shared = 0   # blocks with refcount >= 2 (pages forked sequences share)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_shared_blocks(self) -> int:
        """Used blocks referenced more than once (a forked prefix): each counts once in ``num_used_blocks``."""
        return self._num_shared

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self._num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (refcount 1 each); all or nothing."""
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if not self.can_allocate(num_blocks):
            where = f"shard {self.shard}" if self.shard is not None else "block pool"
            raise CapacityError(
                f"{where}: needs {num_blocks} KV blocks, {self._num_free} free of {self.num_blocks}: "
                "free finished sequences, add shards, or raise num_blocks_per_shard",
                shard=self.shard, needed=num_blocks, free=self._num_free)
        blocks = self._ring_range(self._head, num_blocks)
        self._head = (self._head + num_blocks) % self.num_blocks
        self._num_free -= num_blocks
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def _push_free(self, block: int) -> None:
        self._ring[(self._head + self._num_free) % self.num_blocks] = block
        self._num_free += 1

    def take(self, blocks: list[int]) -> None:
        """Mark specific free blocks as allocated (restoring persisted state); an id listed k times gets
        refcount k (k sequences share it). One call per pool: every reference at once."""
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for b in counts:
            if not 0 <= b < self.num_blocks or self._ref_counts[b] != 0:
                raise CpattnError(f"cannot take block {b}: out of range or already in use")
        free = [b for b in self._ring_range(self._head, self._num_free) if b not in counts]
        self._ring[:len(free)] = array("i", free)
        self._head, self._num_free = 0, len(free)
        for b, n in counts.items():
            self._ref_counts[b] = n
            self._num_shared += n >= 2

    def _ring_range(self, start: int, count: int) -> list[int]:
        """``count`` ring entries from ``start`` on, wrapping around."""
        end = start + count
        if end <= self.num_blocks:
            return self._ring[start:end].tolist()
        return self._ring[start:].tolist() + self._ring[:end - self.num_blocks].tolist()

    def incref(self, blocks: list[int]) -> None:
        """Share already-allocated blocks (e.g. a forked prefix)."""
        self._check_owned(blocks, "incref")
        for b in blocks:
            self._ref_counts[b] += 1
            self._num_shared += self._ref_counts[b] == 2

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
            self._num_shared -= self._ref_counts[b] == 1
            if self._ref_counts[b] == 0:
                self._push_free(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _check_owned(self, blocks: list[int], action: str) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise CpattnError(f"cannot {action} block {b}: ids run 0..{self.num_blocks - 1}")
            if self._ref_counts[b] == 0:
                raise CpattnError(f"cannot {action} block {b}: it is free (double free or stale id)")
