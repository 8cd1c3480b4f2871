"""Cascade attention for any backend: a shard's context pass split into a shared-prefix pass and a suffix pass.

The TORCH backend reads shared prefixes once inside its own loop (attention/cascade.py). For kernels that
take a block table (TRITON, FLASHINFER, FLASH_ATTN) the same split is two ordinary calls planned once per
step: the **suffix** metadata is the step's own with every grouped request's table shifted past the
prefix's pages (its KV writes unchanged: slots are physical addresses), and the **prefix** metadata has one
request per group, holding all of the group's queries, over the prefix's pages with no writes. Per layer
the suffix pass runs first (it writes the new K/V), then the prefix pass, and the prefix rows merge by LSE.
FlashInfer's MultiLevelCascadeAttentionWrapper is this with two levels in one wrapper.

Only for DCP context passes (``causal=False``) without sliding windows (a window's first key is counted
from the sequence start, which the shifted tables no longer hold). Prefixes are whole pages.
Legend: B requests, G groups, T tokens, R prefix-pass rows, W table width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from cpattn.attention.cascade import common_page_runs
from cpattn.attention.ops.lse import LseBase
from cpattn.attention.ops.merge import merge_into_rows
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.kvstore import PAD_BLOCK_ID, PAD_SLOT_ID


@dataclass
class CascadeSplit:
    suffix: CommonAttentionMetadata
    """The step's metadata with grouped requests' tables and lengths starting after their prefix."""
    prefix: CommonAttentionMetadata
    """G requests: each group's queries (rows ``rows``) over its prefix pages; writes nothing."""
    rows: torch.Tensor
    """(R,) int64: step rows of the prefix pass, in its order (CPU)."""
    shift: torch.Tensor
    """(B,) int64: keys each request's prefix pass reads (0 outside every group): the suffix's lengths are the step's
    less these (CPU; a steady decode run's later steps subtract them from its rows: cluster/steady_run.py)."""


@dataclass(frozen=True)
class PrefixPass:
    """A step's prefix pass as a shard runs it in every layer (cluster/layer_runner.py attend_prefix)."""

    plan: Any
    """The backend's metadata of ``CascadeSplit.prefix`` (into_rows: planned to address the step's rows)."""
    rows: torch.Tensor
    """(R,) int64 on the device: ``CascadeSplit.rows``."""
    q_start: int | None
    """The rows are q_start .. q_start + R - 1 (forks batched together): the pass reads q as a view, not a gather."""
    into_rows: bool
    """The backend's impl runs ``plan`` merging into the suffix pass's rows itself (attend_into_rows: TRITON's query
    groups, its split partials and the suffix partial in one merge)."""


def consecutive_start(rows_R: torch.Tensor) -> int | None:
    """rows_R[0] when ``rows_R`` (CPU) is rows_R[0], rows_R[0] + 1, ...; else None."""
    rows = rows_R.tolist()
    return rows[0] if rows and rows == list(range(rows[0], rows[0] + len(rows))) else None


def split_shared_prefixes(md: CommonAttentionMetadata, block_size: int,
                          min_pages: int = 1) -> CascadeSplit | None:
    """The two passes of a step whose requests share prefix pages; None when there is nothing to share (or
    the metadata is causal). ``md`` on the CPU; ``block_size`` the table's page size."""
    return PrefixSplitter(block_size, min_pages).split(md)


class PrefixSplitter:
    """split_shared_prefixes for a caller that plans step after step: what depends only on the block table
    (the groups, their common pages, the shifted suffix table, the prefix table) is kept while the next step
    brings the same table (a decode run's steps share one table object; in-place changes are seen by the
    tensor's version). So a decode step over 16 forks of a 512K document pays a few small vector operations,
    not a 2 MB table clone and a row-by-row shift (14 ms per step measured on a 2-core CPU: benchmarks/RESULTS.md).
    The prefix pass's metadata and rows are kept too while the groups and the query layout stay (a decode run's
    steps, and the next run whose new table holds the same prefix pages): every such step gets the same object, so
    a shard plans and moves that pass once (ShardLayerRunner._plan_prefix) and refills its graph buffers once."""

    def __init__(self, block_size: int, min_pages: int = 1):
        self.block_size, self.min_pages = block_size, min_pages
        self._kept: tuple | None = None
        """(table, its version, active requests, common page runs, (pages per group, suffix table, prefix table,
        shift, (query start locations, prefix rows, prefix metadata) or None) or None): one tuple, read once and
        replaced whole, so callers on several threads (a shard's clients) each see one table's state."""

    def split(self, md: CommonAttentionMetadata) -> CascadeSplit | None:
        if md.causal:
            return None
        bs, table = self.block_size, md.block_table_tensor
        context = md.context_lens_cpu.tolist()
        active = [n > 0 for n in context]
        kept = previous = self._kept   # read once: other threads replace it whole
        if kept is None or kept[0] is not table or kept[1] != table._version or kept[2] != active:
            kept = (table, table._version, active, common_page_runs(table, active), None)
        # A group's prefix: its whole common pages within the keys every member sees (context grows each step).
        groups = []
        for reqs, pages in kept[3]:
            pages = min(pages, min(context[r] for r in reqs) // bs)
            if pages >= self.min_pages:
                groups.append((reqs, pages))
        if not groups:
            self._kept = kept
            return None
        key = tuple(groups)
        qsl = md.query_start_loc_cpu.tolist()
        if kept[4] is None or kept[4][0] != key:
            kept = kept[:4] + ((key, *_shifted_tables(table, groups), _shift(len(context), groups, bs), None),)
        if kept[4][4] is None or kept[4][4][0] != qsl:   # a decode run's steps: the same rows, the same prefix pass
            rows, prefix = _prefix_pass_metadata(md, groups, qsl, kept[4][2], bs)
            before = previous[4][4] if previous is not None and previous[4] is not None else None
            if before is not None and _same_pass(before[1], before[2], rows, prefix):
                rows, prefix = before[1:]   # the next run's table holds the same prefix: keep its pass (and plan)
            kept = kept[:4] + (kept[4][:4] + ((qsl, rows, prefix),),)
        self._kept = kept
        _, suffix_table, _, shift, (_, rows, prefix) = kept[4]
        seq_lens, context = md.seq_lens_cpu - shift, md.context_lens_cpu - shift
        suffix = replace(md, block_table_tensor=suffix_table, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                         context_lens_cpu=context, max_seq_len=int(seq_lens.max()))
        return CascadeSplit(suffix, prefix, rows, shift)


def _same_pass(rows_a: torch.Tensor, a: CommonAttentionMetadata, rows_b: torch.Tensor,
               b: CommonAttentionMetadata) -> bool:
    """Two prefix passes (of _prefix_pass_metadata, one splitter: the same rank and geometry) read the same pages
    for the same rows: every field that differs between such passes is compared."""
    return (torch.equal(rows_a, rows_b) and torch.equal(a.query_start_loc_cpu, b.query_start_loc_cpu)
            and torch.equal(a.seq_lens_cpu, b.seq_lens_cpu)
            and a.block_table_tensor.shape == b.block_table_tensor.shape
            and torch.equal(a.block_table_tensor, b.block_table_tensor))


def _shift(num_reqs: int, groups: list[tuple[tuple[int, ...], int]], block_size: int) -> torch.Tensor:
    """(B,) int64: keys each request's prefix pass reads (its group's prefix), 0 for requests in no group."""
    shift = [0] * num_reqs
    for reqs, pages in groups:
        for r in reqs:
            shift[r] = pages * block_size
    return torch.tensor(shift, dtype=torch.int64)


def _prefix_pass_metadata(md: CommonAttentionMetadata, groups: list[tuple[tuple[int, ...], int]], qsl: list[int],
                          prefix_table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, CommonAttentionMetadata]:
    """(rows, metadata) of the prefix pass: one request per group holding all of its members' queries, over the
    group's prefix pages, writing nothing. It depends only on the groups and the step's query layout, so a decode
    run's steps share one (PrefixSplitter keeps it, and a shard its plan: ShardLayerRunner). Query positions are not
    carried: they matter only under sliding windows, which the split does not serve (module docstring)."""
    group_rows = [[t for r in reqs for t in range(qsl[r], qsl[r + 1])] for reqs, _ in groups]
    rows = torch.tensor([t for g in group_rows for t in g], dtype=torch.int64)
    counts = torch.tensor([len(g) for g in group_rows], dtype=torch.int64)
    pq = torch.zeros(len(groups) + 1, dtype=torch.int64)
    pq[1:] = torch.cumsum(counts, 0)
    lens = torch.tensor([pages * block_size for _, pages in groups], dtype=torch.int64)
    prefix = replace(md, query_start_loc=pq, query_start_loc_cpu=pq.clone(), seq_lens=lens,
                     seq_lens_cpu=lens.clone(), context_lens_cpu=lens.clone(), block_table_tensor=prefix_table,
                     slot_mapping=torch.full((len(rows),), PAD_SLOT_ID, dtype=torch.int64), num_reqs=len(groups),
                     num_actual_tokens=len(rows), max_query_len=int(counts.max()), max_seq_len=int(lens.max()),
                     query_positions_cpu=None, block_table_cpu=None, slot_mapping_cpu=None)
    return rows, prefix


def _shifted_tables(table_BW: torch.Tensor, groups: list[tuple[tuple[int, ...], int]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(suffix table: each grouped row starting after its group's prefix pages, PAD after its end, only as wide as
    the widest row's rest; prefix table: one row per group, its prefix pages). Forks of one document all shift by
    its pages: their suffix table is the few columns after it (16 x 2 pages at 512K, not 16 x 16K)."""
    num_reqs, width = table_BW.shape
    shift = [0] * num_reqs
    for reqs, pages in groups:
        for r in reqs:
            shift[r] = pages
    if len(set(shift)) == 1:
        suffix = table_BW[:, shift[0]:].clone()
    else:
        suffix = torch.full((num_reqs, width - min(shift)), PAD_BLOCK_ID, dtype=table_BW.dtype)
        by_shift: dict[int, list[int]] = {}
        for r, pages in enumerate(shift):
            by_shift.setdefault(pages, []).append(r)
        for pages, rows in by_shift.items():
            suffix[rows, :width - pages] = table_BW[rows, pages:]
    prefix = torch.full((len(groups), max(p for _, p in groups)), PAD_BLOCK_ID, dtype=table_BW.dtype)
    for i, (reqs, pages) in enumerate(groups):
        prefix[i, :pages] = table_BW[reqs[0], :pages]
    return suffix, prefix


def merge_prefix_rows(out_TQD: torch.Tensor, lse_TQ: torch.Tensor, rows_R: torch.Tensor, prefix_out_RQD: torch.Tensor,
                      prefix_lse_RQ: torch.Tensor, lse_base: LseBase = LseBase.E) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass (LSE in ``lse_base``) merged into the suffix pass's rows ``rows_R`` of ``out_TQD`` / natural-log
    ``lse_TQ``, in place (returns them). On a GPU one launch (ops.merge.merge_into_rows), not gather, stack, merge and
    scatter: the layer's eager path and its graph alike."""
    return merge_into_rows(out_TQD, lse_TQ, rows_R, prefix_out_RQD[None], prefix_lse_RQ[None], lse_base)
