"""Block tables sent as deltas: a step's plan carries only the pages its client does not hold yet.

Legend: B requests of a step, W block-table width (pages of the longest request on a shard).
A whole table is 8 bytes a page: 512 KB per step for one million-token sequence, 1 MB for 64 x 32K.
Replies that large go through Ray's object store and cost milliseconds per step, more than a decode
step's kernels at 128K. A decode loop adds one page in 16 steps, so the client keeps each sequence's
pages (per shard it computes in-process) and the coordinator sends what is new: ``(version, start,
pages[start:])``. A sequence's version changes whenever pages it may have been sent are taken back
(a rolled-back step); a client whose version or count does not match gets the whole row again, so
a stale cache costs one full table, never a wrong page.
"""

from __future__ import annotations

import numpy as np
import torch

from cpattn.kvstore import PAD_BLOCK_ID

Delta = tuple[int, int, torch.Tensor]
"""(version, start, pages): the row's pages from index ``start`` on; the client already holds [0, start)."""


def row_deltas(table_BW: torch.Tensor, num_pages: list[int], versions: list[int],
               held: list[object]) -> list[Delta]:
    """One delta per request. ``held[i]`` is what the client said it holds, ``(version, count)``; anything
    else (missing, malformed, stale, or more than exists) means it gets the whole row."""
    deltas = []
    for i, (n, version) in enumerate(zip(num_pages, versions)):
        start = 0
        h = held[i]
        if (isinstance(h, (tuple, list)) and len(h) == 2 and all(type(x) is int for x in h)
                and h[0] == version and 0 <= h[1] <= n):
            start = h[1]
        deltas.append((version, start, table_BW[i, start:n].clone()))
    return deltas


class PageCache:
    """The client's copy of its sequences' pages on the shards it computes in-process.

    Kept and assembled in numpy, not torch: the client is the user's process, where torch runs a CPU op over more
    than ~32K elements on all its intra-op threads; one table of a 1M-token sequence (65K pages) took 11.6 ms to
    assemble that way on an H200 host busy with Ray (8 ms a torch.full on a loaded 2-core box, 0.4 ms on one thread),
    once per decode run on the caller's path."""

    def __init__(self):
        self._rows: dict[tuple[str, int], tuple[int, np.ndarray, int]] = {}
        """(seq_id, rank) -> (version, buffer, count): pages in buffer[:count] (capacity doubles as it grows)."""

    def clear(self) -> None:
        self._rows.clear()

    def forget(self, seq_id: str) -> None:
        for key in [k for k in self._rows if k[0] == seq_id]:
            del self._rows[key]

    def held(self, seq_ids: list[str], ranks: list[int]) -> dict[str, dict[int, tuple[int, int]]]:
        """What to tell the coordinator: per sequence and rank, (version, pages held)."""
        out: dict[str, dict[int, tuple[int, int]]] = {}
        for s in seq_ids:
            for r in ranks:
                entry = self._rows.get((s, r))
                if entry is not None:
                    out.setdefault(s, {})[r] = (entry[0], entry[2])
        return out

    def apply(self, rank: int, seq_ids: list[str], deltas: list[Delta]) -> torch.Tensor:
        """Take one rank's deltas (in request order) and return that rank's block table [B, W] int64."""
        rows = []
        for s, (version, start, pages) in zip(seq_ids, deltas):
            pages = np.asarray(pages.numpy() if isinstance(pages, torch.Tensor) else pages, dtype=np.int64)
            entry = self._rows.get((s, rank))
            if start == 0 or entry is None:
                buf, count = np.empty(max(64, 2 * pages.size), dtype=np.int64), 0
            else:
                _, buf, count = entry
                if count < start:   # the coordinator checked our count: this would be a bug, not a race
                    raise RuntimeError(f"page cache of {s} on shard {rank} holds {count} pages, delta starts at {start}")
            need = start + pages.size
            if need > buf.size:
                grown = np.empty(max(need, 2 * buf.size), dtype=np.int64)
                grown[:start] = buf[:start]
                buf = grown
            buf[start:need] = pages
            self._rows[(s, rank)] = (version, buf, need)
            rows.append(buf[:need])
        width = max([r.size for r in rows], default=0)
        table = np.full((len(rows), max(width, 1)), PAD_BLOCK_ID, dtype=np.int64)
        for i, r in enumerate(rows):
            table[i, :r.size] = r
        return torch.from_numpy(table)
