"""How far a sequence may grow and how much KV it holds: the whole cache, its block-table rows, the client's
quota; and, when every layer has a sliding window, the pages no later query can see going back to the pools.

Pure state like sequence_table.py (the coordinator holds its lock around every call). With windows on every
layer (``ServiceConfig.release_pages_outside_window``), a committed sequence of length L keeps on each shard
only the pages holding a token at a global position >= L - W (W: the largest window; the last token's query
sees keys p - W < j <= p, and every later query starts later), so it holds about W tokens, not L, and may
grow past the whole cache, as far as its rows can index. vLLM's sliding-window manager frees such pages the
same way. A fork must start where its first query's window finds every page still held.
"""

from __future__ import annotations

from cpattn.config import ServiceConfig
from cpattn.errors import CapacityError, InvalidRequestError
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

# The longest row (pages per shard) of a sequence whose pages windows release: 64M local tokens at block_size 16.
# Tables grow by doubling as rows need it, so the bound costs nothing until a sequence is that long.
MAX_RELEASING_ROW_BLOCKS = 2**22


def release_window(config: ServiceConfig) -> int | None:
    """The largest window when every layer has one and pages outside it are released, else None."""
    return config.row_window() if config.release_pages_outside_window else None


def row_width(config: ServiceConfig) -> int | None:
    """The allocator's longest row: None (the pool's size) unless windows release pages."""
    return max(config.blocks_per_shard(), MAX_RELEASING_ROW_BLOCKS) if release_window(config) else None


class SequenceLimits:
    def __init__(self, config: ServiceConfig, allocator: ShardedKVAllocator):
        self.config = config
        self.allocator = allocator
        self.window = release_window(config)

    def capacity_tokens(self) -> int:
        """The longest a sequence may grow: the whole KV cache in tokens, or where windows release pages (a
        sequence holds about its window), what its block-table rows can index."""
        return self.config.num_shards * self.allocator.max_blocks_per_row * self.config.block_size

    def cache_tokens(self) -> int:
        """The whole KV cache in tokens."""
        cfg = self.config
        return cfg.num_shards * cfg.blocks_per_shard() * cfg.block_size

    def held_tokens(self, seq, length: int | None = None) -> int:
        """Tokens whose KV the sequence holds (at ``length``, default its length): the length, or at most its
        window where windows release pages."""
        length = seq.length if length is None else length
        return length if self.window is None else min(length, self.window)

    def check_growth(self, seq, extra, what: str, busy: str) -> None:
        """The one check before a sequence grows by ``extra`` tokens (a step, fill_synthetic)."""
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 1:
            raise InvalidRequestError(f"{what} {extra!r} must be an int >= 1")
        # Also keeps absurd counts (>= 2**63) away from the int64 allocator math.
        capacity, cache, shards = self.capacity_tokens(), self.cache_tokens(), self.config.num_shards
        if seq.length + extra > capacity:
            what = "the whole KV cache" if capacity == cache else "the longest block-table row of a windowed sequence"
            raise CapacityError(f"sequence {seq.seq_id}: {seq.length} + {extra} tokens exceed {what} "
                                f"({capacity} tokens over {shards} shards): shorten the request or "
                                "raise num_blocks_per_shard / num_shards", needed=seq.length + extra, free=capacity)
        held = self.held_tokens(seq)
        if held + extra > cache:
            raise CapacityError(f"sequence {seq.seq_id}: the {held} tokens of its window + {extra} exceed the whole "
                                f"KV cache ({cache} tokens over {shards} shards): shorten the request or raise "
                                "num_blocks_per_shard / num_shards", needed=held + extra, free=cache)
        if seq.in_step is not None:
            raise InvalidRequestError(f"sequence {seq.seq_id} is {busy} open step {seq.in_step}")

    def check_quota(self, client_seqs: list, extra: int, pending: dict[str, int] | None = None) -> None:
        """``client_seqs``: the client's sequences; ``extra``: the tokens a step, fill or fork adds; ``pending``:
        the lengths its open step (or decode run) takes its sequences to, whose pages it already holds (a fork or
        fill inside a step counts them)."""
        quota = self.config.max_tokens_per_client
        if quota is None:
            return
        pending = pending or {}
        held = sum(self.held_tokens(s, max(s.length, pending.get(s.seq_id, 0))) for s in client_seqs)
        if held + extra > quota:
            raise CapacityError(f"client quota: holding {held} tokens, this step adds {extra}, max_tokens_per_client "
                                f"is {quota}: free sequences or raise the quota", needed=held + extra, free=quota - held)

    def check_fork(self, source, num_tokens: int) -> None:
        """A fork of ``source``'s first ``num_tokens`` tokens finds every page its first query's window reads."""
        if self.window is None or num_tokens == 0 or not self.allocator.released_past(source.rows,
                                                                                     num_tokens - self.window + 1):
            return   # (a fork of no tokens shares no page)
        raise InvalidRequestError(
            f"cannot fork sequence {source.seq_id} at {num_tokens} tokens: it holds {source.length}, and the pages "
            f"of positions before {max(0, source.length - self.window)} went back to the pool (every layer has a "
            f"window, at most {self.window}): fork within a window of its length, or start the service with "
            "release_pages_outside_window=False")

    def release_outside_window(self, seq) -> bool:
        """A committed length: pages wholly before the window of its last token go back to the pools (every later
        query's window starts after it). As when a sequence is freed, the step's reads are over by its commit.
        Whether any page went back. Between page ends nothing can go back, so most commits (a decode's, B of
        them per step) only compare two ints: the full check cost ~1.7 us a sequence (B=64, 2 shards, 2-core box)."""
        if self.window is None or seq.length - self.window < seq.release_from:
            return False
        position = seq.length - self.window
        freed = self.allocator.release_before(seq.rows, position)
        seq.release_from = self.allocator.next_page_end(position)
        return freed > 0
