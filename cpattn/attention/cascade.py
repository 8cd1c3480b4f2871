"""Cascade attention over shared prefixes: keys several requests read from the same pages are read once.

Forked sequences (svc.fork) share their prefix's pages, so in a step holding several of them each shard's
block tables start with the same page ids. Planned once per step (``find_shared_prefixes``), each layer then
attends every query of a group to the prefix's keys in one multi-query pass, each request to its own suffix
separately, and merges the two partials by LSE (exact: softmax over a union of disjoint key sets). This is
the TORCH backend's form of FlashInfer's cascade wrappers (MultiLevelCascadeAttentionWrapper: level 0 the
shared prefix with all of a group's queries as one request, level 1 each request's own pages).

Legend: B requests, T tokens, Q query heads, K kv heads, D head size, W block-table width, P prefix keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.attention.ops.merge import merge_attn_states


@dataclass(frozen=True)
class SharedPrefix:
    """Requests whose first ``num_keys`` local keys sit in the same pages (the first row's ``pages``)."""

    requests: tuple[int, ...]
    """Request indices in batch order, at least two."""
    num_keys: int
    """Keys [0, num_keys) every query of these requests sees: within their common pages and their visible keys."""


def common_page_runs(block_table_BW: torch.Tensor, active_B: list[bool]) -> list[tuple[tuple[int, ...], int]]:
    """(requests, pages) of every group of at least two ``active_B`` requests whose rows start with the same page:
    ``pages`` is the group's run of common pages over the whole table width (uncapped: a caller caps it by the
    keys its requests see). Two vector operations per group, so a 16 x 16K-page table costs ~1 ms, not a Python
    loop over its pages."""
    by_first: dict[int, list[int]] = {}
    firsts = block_table_BW[:, 0].tolist() if block_table_BW.shape[1] else []
    for r, (first, active) in enumerate(zip(firsts, active_B)):
        if active:
            by_first.setdefault(first, []).append(r)
    runs = []
    for reqs in by_first.values():
        if len(reqs) < 2:
            continue
        rows = block_table_BW if len(reqs) == len(firsts) else block_table_BW[reqs]
        differs = (rows != rows[:1]).any(dim=0)
        runs.append((tuple(reqs), int(differs.to(torch.int8).argmax()) if bool(differs.any()) else rows.shape[1]))
    return runs


def find_shared_prefixes(block_table_BW: torch.Tensor, visible_keys_B: torch.Tensor, block_size: int,
                         min_keys: int = 1) -> tuple[SharedPrefix, ...]:
    """Groups of requests starting with the same page, with the keys all of them see in their common pages.

    ``visible_keys_B`` (CPU int64): keys every query of the request sees (its context; for a causal plan the
    keys before its first new token). One level: requests are grouped by their first page, and a group's
    prefix is its longest run of common pages (a deeper shared run inside the group is read with the suffixes).
    """
    visible = visible_keys_B.tolist()
    return tuple(g for g in (SharedPrefix(reqs, min(pages * block_size, min(visible[r] for r in reqs)))
                             for reqs, pages in common_page_runs(block_table_BW.cpu(), [n > 0 for n in visible]))
                 if g.num_keys >= min_keys)


def cascade_forward(q_TQD: torch.Tensor, kv_cache: torch.Tensor, block_table_BW: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], causal: bool, prefixes: tuple[SharedPrefix, ...],
                    gather, attend, out_TQD: torch.Tensor, lse_TQ: torch.Tensor) -> set[int]:
    """Write the rows of every request in ``prefixes`` into ``out_TQD`` / ``lse_TQ``; returns those requests.

    ``gather(block_row, seq_len, first_key)`` -> (k, v) of keys [page start of first_key, seq_len) (the backend's
    page reader, dequantising fp8); ``attend(q, k, v, causal_offset)`` -> (out, natural lse) of one dense pass.
    """
    block_size = kv_cache.shape[2]
    done: set[int] = set()
    for prefix in prefixes:
        reqs = prefix.requests
        p = prefix.num_keys
        rows = torch.cat([torch.arange(query_start_loc[r], query_start_loc[r + 1]) for r in reqs])
        k_p, v_p = gather(block_table_BW[reqs[0]], p, 0)                 # the shared keys, read once
        out_p, lse_p = attend(q_TQD[rows], k_p, v_p, None)              # every query sees all of them
        at = 0
        for r in reqs:
            qs, qe, seq_len = query_start_loc[r], query_start_loc[r + 1], seq_lens[r]
            n = qe - qs
            k, v = gather(block_table_BW[r], seq_len, p)
            skip = p - (p // block_size) * block_size                    # keys before p on p's page
            k, v = k[skip:], v[skip:]
            offset = seq_len - p - n if causal else None
            out_s, lse_s = attend(q_TQD[qs:qe], k, v, offset)
            out, lse = merge_attn_states([out_p[at:at + n], out_s.to(out_p.dtype)], [lse_p[at:at + n], lse_s])
            out_TQD[qs:qe], lse_TQ[qs:qe] = out, lse.to(lse_TQ.dtype)
            at += n
            done.add(r)
    return done
