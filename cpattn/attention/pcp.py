"""Who computes the causal part among a step's new tokens (prefill context parallelism).

The context part (queries vs KV held before the step) runs on every shard over its own tokens.
The causal part among the new tokens needs only the step's q/k/v and is computed exactly once:
short requests go whole to the least-loaded rank; a request with at least ``pcp_min_tokens`` new
tokens is cut into 2N chunks and rank r takes chunks r and 2N-1-r (head-tail pairing), so every
rank gets the same triangle area (chunk r is cheap where chunk 2N-1-r is expensive).

A piece (q_start, q_end, k_start) means queries [q_start, q_end) attend causally to keys
[k_start, q_end), in step token indices.

When some ranks run in the client's process and others are remote (``WireCost``), a long request is cut
instead into contiguous query ranges: the client's ranks take the earliest, the remote ranks the latest (a late
query row carries the most work per row, so a remote rank gets its work in the fewest rows to send and return),
each range sized so every rank finishes together, counting the time a remote rank's rows travel
(``split_by_time``): the remote rank's share of the attention is smaller by what its wire costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 128
"""Range bounds of a time split fall on multiples of this (a kernel's query tile) from the request's start."""


@dataclass(frozen=True)
class WireCost:
    """What a remote rank's rows cost, in the time of one query-key pair of attention (all heads)."""

    remote: frozenset[int]
    q_row: float
    """A query row sent there and its output and LSE returned."""
    kv_row: float
    """A new token's K and V sent there."""

    @classmethod
    def of(cls, remote, num_q_heads: int, num_kv_heads: int, head_size: int, itemsize: int,
           flops_per_byte: float) -> "WireCost | None":
        """None (equal shares) where no rank is remote or bytes are free (``flops_per_byte`` 0)."""
        if not remote or flops_per_byte <= 0:
            return None
        pair = 4 * num_q_heads * head_size / flops_per_byte   # bytes that take one pair's time (QK^T and PV)
        q_bytes = 2 * num_q_heads * head_size * itemsize + 4 * num_q_heads
        return cls(frozenset(remote), q_bytes / pair, 2 * num_kv_heads * head_size * itemsize / pair)


def _chunk_bounds(start: int, length: int, num_chunks: int) -> list[tuple[int, int]]:
    base, extra = divmod(length, num_chunks)
    bounds, s = [], start
    for c in range(num_chunks):
        e = s + base + (1 if c < extra else 0)
        bounds.append((s, e))
        s = e
    return bounds


def _cost(q_start: int, q_end: int, k_start: int) -> int:
    """Query-key pairs inside a causal piece (the work it costs)."""
    n, offset = q_end - q_start, q_start - k_start
    return n * offset + n * (n + 1) // 2


def _range_time(a: int, b: int, length: int, world_size: int, cost: WireCost | None) -> float:
    """A rank's time for queries [a, b) of a request of ``length`` (keys from 0): pairs, plus on a remote rank its
    rows' wire (its queries, the keys before b it does not store, the tokens it stores)."""
    pairs = (b - a) * (a + b + 1) / 2
    if cost is None:
        return pairs
    return pairs + cost.q_row * (b - a) + cost.kv_row * (b * (1 - 1 / world_size) + length / world_size)


def _range_end(a: int, length: int, world_size: int, cost: WireCost | None, budget: float) -> int:
    """The last b in [a, length] with _range_time(a, b) <= budget (it is quadratic in b: solved, then clamped)."""
    beta = 0.5 if cost is None else 0.5 + cost.q_row + cost.kv_row * (1 - 1 / world_size)
    gamma = _range_time(a, 0, length, world_size, cost)   # the time at b = 0 (0.5 b^2 + beta b + gamma)
    disc = beta * beta - 2 * (gamma - budget)
    b = int(-beta + math.sqrt(disc)) if disc > 0 else a
    return max(a, min(length, b))


def split_by_time(length: int, world_size: int, cost: WireCost) -> list[tuple[int, int]]:
    """Per rank, its query range [a, b) of a request (offsets): the client's ranks first, the remote ones last,
    bounds on multiples of ALIGN, the longest rank time as short as the search finds (bisection on it)."""
    order = [r for r in range(world_size) if r not in cost.remote] + sorted(cost.remote)
    costs = [cost if r in cost.remote else None for r in order]

    def walk(budget: float) -> list[int]:
        ends, a = [], 0
        for c in costs:
            b = _range_end(a, length, world_size, c, budget)
            if b < length and length - b >= ALIGN:
                b -= b % ALIGN
            ends.append(max(a, b))
            a = ends[-1]
        return ends

    lo, hi = 0.0, _range_time(0, length, length, world_size, costs[0]) + 1
    for _ in range(48):
        mid = (lo + hi) / 2
        if walk(mid)[-1] >= length:
            hi = mid
        else:
            lo = mid
    ends = walk(hi)
    ends[-1] = length
    bounds, a = {}, 0
    for r, b in zip(order, ends):
        bounds[r], a = (a, b), b
    return [bounds[r] for r in range(world_size)]


def plan_causal_pieces(query_lens: list[int], world_size: int, pcp_min_tokens: int,
                       pcp_enabled: bool = True, skip_decodes: bool = False,
                       wire_cost: WireCost | None = None) -> list[torch.Tensor]:
    """Per rank, an int64 [P, 3] tensor of pieces; together they cover every new token exactly once.

    ``skip_decodes``: requests with one new token get no piece; the rank storing that token attends
    it in its context pass instead (``make_dcp_context_metadata(fold_decodes=True)``). ``wire_cost``: some ranks
    are remote (module docstring): long requests are split by time, short ones go where they finish first."""
    timed = wire_cost is not None and len(wire_cost.remote) < world_size
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1")
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    start = 0
    whole: list[tuple[int, int, int]] = []
    for q_len in query_lens:
        if q_len < 0:
            raise ValueError(f"query length {q_len} must be >= 0")
        if q_len == 0 or (skip_decodes and q_len == 1):
            start += q_len
            continue
        if pcp_enabled and world_size > 1 and q_len >= max(pcp_min_tokens, 2 * world_size) and timed:
            for rank, (a, b) in enumerate(split_by_time(q_len, world_size, wire_cost)):
                if b > a:
                    pieces[rank].append((start + a, start + b, start))
                    load[rank] += _range_time(a, b, q_len, world_size, wire_cost if rank in wire_cost.remote
                                              else None)
        elif pcp_enabled and world_size > 1 and q_len >= max(pcp_min_tokens, 2 * world_size):
            chunks = _chunk_bounds(start, q_len, 2 * world_size)
            for rank in range(world_size):
                for c in (rank, 2 * world_size - 1 - rank):
                    qs, qe = chunks[c]
                    pieces[rank].append((qs, qe, start))
                    load[rank] += _cost(qs, qe, start)
        else:
            whole.append((start, start + q_len, start))
        start += q_len
    # Largest first onto the least-loaded rank: a greedy balance of the remaining triangles.
    for piece in sorted(whole, key=lambda p: -_cost(*p)):
        added = [_cost(*piece) + (_wire_time(piece, wire_cost) if timed and r in wire_cost.remote else 0)
                 for r in range(world_size)]
        rank = min(range(world_size), key=lambda r: load[r] + added[r])
        pieces[rank].append(piece)
        load[rank] += added[rank]
    return [torch.tensor(sorted(p), dtype=torch.int64).reshape(-1, 3) for p in pieces]


def _wire_time(piece: tuple[int, int, int], cost: WireCost) -> float:
    """A whole request's rows on a remote rank: its queries and keys there (an upper bound: it stores some)."""
    q_start, q_end, k_start = piece
    return cost.q_row * (q_end - q_start) + cost.kv_row * (q_end - k_start)
