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

import torch

from cpattn.attention.cascade import find_shared_prefixes
from cpattn.attention.ops.merge import merge_attn_states
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


def split_shared_prefixes(md: CommonAttentionMetadata, block_size: int,
                          min_pages: int = 1) -> CascadeSplit | None:
    """The two passes of a step whose requests share prefix pages; None when there is nothing to share (or
    the metadata is causal). ``md`` on the CPU; ``block_size`` the table's page size."""
    if md.causal:
        return None
    groups = find_shared_prefixes(md.block_table_tensor, md.context_lens_cpu, block_size, min_keys=min_pages * block_size)
    groups = [g for g in groups if g.num_keys >= block_size * min_pages]
    if not groups:
        return None
    qsl = md.query_start_loc_cpu.tolist()
    table = md.block_table_tensor.clone()
    seq_lens, context = md.seq_lens_cpu.clone(), md.context_lens_cpu.clone()
    prefix_pages, group_rows = [], []
    for g in groups:
        pages = g.num_keys // block_size                           # whole pages only
        prefix_pages.append(table[g.requests[0], :pages].clone())
        for r in g.requests:
            table[r] = torch.cat([table[r, pages:], torch.full((pages,), PAD_BLOCK_ID, dtype=table.dtype)])
            seq_lens[r] -= pages * block_size
            context[r] -= pages * block_size
        group_rows.append(torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in g.requests]))
    suffix = replace(md, block_table_tensor=table, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                     context_lens_cpu=context, max_seq_len=int(seq_lens.max()))
    rows = torch.cat(group_rows)
    counts = torch.tensor([len(r) for r in group_rows], dtype=torch.int64)
    pq = torch.zeros(len(groups) + 1, dtype=torch.int64)
    pq[1:] = torch.cumsum(counts, 0)
    width = max(len(p) for p in prefix_pages)
    prefix_table = torch.full((len(groups), width), PAD_BLOCK_ID, dtype=torch.int64)
    for i, p in enumerate(prefix_pages):
        prefix_table[i, :len(p)] = p
    lens = torch.tensor([len(p) * block_size for p in prefix_pages], dtype=torch.int64)
    prefix = replace(md, query_start_loc=pq, query_start_loc_cpu=pq.clone(), seq_lens=lens, seq_lens_cpu=lens.clone(),
                     context_lens_cpu=lens.clone(), block_table_tensor=prefix_table,
                     slot_mapping=torch.full((len(rows),), PAD_SLOT_ID, dtype=torch.int64), num_reqs=len(groups),
                     num_actual_tokens=len(rows), max_query_len=int(counts.max()), max_seq_len=int(lens.max()),
                     query_positions_cpu=None if md.query_positions_cpu is None else md.query_positions_cpu[rows])
    return CascadeSplit(suffix, prefix, rows)


def merge_prefix_rows(out_TQD: torch.Tensor, lse_TQ: torch.Tensor, rows_R: torch.Tensor, prefix_out_RQD: torch.Tensor,
                      prefix_lse_RQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The suffix pass's output with the prefix pass merged into its rows (natural-log LSEs; new tensors)."""
    merged, merged_lse = merge_attn_states([out_TQD.index_select(0, rows_R), prefix_out_RQD.to(out_TQD.dtype)],
                                           [lse_TQ.index_select(0, rows_R), prefix_lse_RQ.to(lse_TQ.dtype)])
    return (out_TQD.index_copy(0, rows_R, merged.to(out_TQD.dtype)),
            lse_TQ.index_copy(0, rows_R, merged_lse.to(lse_TQ.dtype)))
