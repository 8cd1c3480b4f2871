"""Who computes the causal part among a step's new tokens (prefill context parallelism).

The context part (queries vs KV held before the step) runs on every shard over its own tokens.
The causal part among the new tokens needs only the step's q/k/v and is computed exactly once:
short requests go whole to the least-loaded rank; a request with at least ``pcp_min_tokens`` new
tokens is cut into 2N chunks and rank r takes chunks r and 2N-1-r (head-tail pairing), so every
rank gets the same triangle area (chunk r is cheap where chunk 2N-1-r is expensive).

A piece (q_start, q_end, k_start) means queries [q_start, q_end) attend causally to keys
[k_start, q_end), in step token indices.
"""

from __future__ import annotations

import torch


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


def plan_causal_pieces(query_lens: list[int], world_size: int, pcp_min_tokens: int,
                       pcp_enabled: bool = True, skip_decodes: bool = False) -> list[torch.Tensor]:
    """Per rank, an int64 [P, 3] tensor of pieces; together they cover every new token exactly once.

    ``skip_decodes``: requests with one new token get no piece; the rank storing that token attends
    it in its context pass instead (``make_dcp_context_metadata(fold_decodes=True)``)."""
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
        if pcp_enabled and world_size > 1 and q_len >= max(pcp_min_tokens, 2 * world_size):
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
        rank = min(range(world_size), key=lambda r: load[r])
        pieces[rank].append(piece)
        load[rank] += _cost(*piece)
    return [torch.tensor(sorted(p), dtype=torch.int64).reshape(-1, 3) for p in pieces]
