"""Block tables as deltas (cluster/page_delta.py): whatever the client held, stale or forged, the table it
rebuilds equals the coordinator's, and a decode loop's reply carries only new pages."""

from __future__ import annotations

import random

import torch

from cpattn.cluster.page_delta import PageCache, row_deltas
from cpattn.kvstore import PAD_BLOCK_ID


def _table(rows: list[list[int]]) -> torch.Tensor:
    width = max([len(r) for r in rows], default=0)
    t = torch.full((len(rows), max(width, 1)), PAD_BLOCK_ID, dtype=torch.int64)
    for i, r in enumerate(rows):
        t[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return t


def test_random_growth_rollback_and_stale_claims_rebuild_the_exact_table():
    rng = random.Random(5)
    pages = {s: [] for s in "abcd"}       # the coordinator's truth for one rank
    versions = {s: 0 for s in "abcd"}
    cache = PageCache()
    next_page = 0
    sent = whole = 0
    for step in range(300):
        seqs = rng.sample("abcd", rng.randint(1, 4))
        before = {s: len(pages[s]) for s in seqs}
        for s in seqs:                      # this step's growth (usually none, a page now and then)
            for _ in range(rng.choice([0, 0, 0, 1, 3])):
                pages[s].append(next_page)
                next_page += 1
        held = cache.held(seqs, [0])
        claims = [held.get(s, {}).get(0) for s in seqs]
        if rng.random() < 0.05:             # a forged or garbled claim: the client gets whole rows
            claims = [rng.choice([(versions[s], 10**9), (-1, 0), "x", None, (0.5, 1)]) for s in seqs]
        deltas = row_deltas(_table([pages[s] for s in seqs]), [len(pages[s]) for s in seqs],
                            [versions[s] for s in seqs], claims)
        sent += sum(d[2].numel() for d in deltas)
        whole += sum(len(pages[s]) for s in seqs)
        got = cache.apply(0, seqs, deltas)
        assert torch.equal(got, _table([pages[s] for s in seqs])), step
        if rng.random() < 0.05:             # rolled back: the step's pages return, the version moves
            for s in seqs:
                del pages[s][before[s]:]
                versions[s] += 1
        if rng.random() < 0.03:
            cache.forget(rng.choice("abcd"))
    assert sent < whole / 4, (sent, whole)  # deltas, not whole tables every step


def test_a_decode_loop_sends_only_new_pages():
    cache = PageCache()
    row = list(range(1000))
    deltas = row_deltas(_table([row]), [1000], [0], [None])
    assert deltas[0][1] == 0 and deltas[0][2].numel() == 1000
    cache.apply(0, ["s"], deltas)
    for n in range(1001, 1010):
        row.append(n)
        d = row_deltas(_table([row]), [len(row)], [0], [cache.held(["s"], [0])["s"][0]])
        assert d[0][1] == len(row) - 1 and d[0][2].tolist() == [n]
        assert torch.equal(cache.apply(0, ["s"], d), _table([row]))
