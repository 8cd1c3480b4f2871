"""Per-rank plans of one step, built once by the coordinator and sent once to each shard."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cpattn.array_pickle import TensorsAsArrays
from cpattn.attention.metadata import CommonAttentionMetadata, make_dcp_context_metadata
from cpattn.attention.pcp import WireCost, plan_causal_pieces
from cpattn.kvstore.sharded_allocator import Growth, SequenceRows, ShardedKVAllocator


@dataclass
class ShardStepPlan(TensorsAsArrays):
    """Everything a shard needs for one step; small CPU tensors, pickled once per step."""

    step_id: int
    num_tokens: int
    metadata: CommonAttentionMetadata
    """Queries vs the shard's context before the step; slot_mapping writes the tokens it owns."""
    causal_pieces: torch.Tensor
    """[P, 3] (q_start, q_end, k_start): this shard's share of the causal part among new tokens."""
    replica_slot_mapping: torch.Tensor | None = None
    """(T,) int64: where this shard keeps its copy of ``primary_of(rank)``'s new tokens (-1 elsewhere)."""
    incarnation: int = 0
    """The planning coordinator's incarnation: shards refuse to write for a fenced one (cluster/fencing.py)."""
    auth: str | None = None
    """The service's shard secret: only the coordinator hands out plans (a shard refuses others)."""
    page_copies: torch.Tensor | None = None
    """[C, 2] int64 (shared page, its private copy): copied in every layer before its KV update (copy on write
    of a forked prefix's partly filled page; kvstore/sharded_allocator.py). None: nothing to copy."""
    rows: torch.Tensor | None = None
    """(R,) int64 sorted: the query rows this shard computes (local context or a causal piece); None = all T.
    Only these rows travel back to the client, so a prefill rank returns its share, not [T, Hq, D]."""
    selected: bool = False
    """The step's layers come to each remote rank as its own message of only the rows it needs, not one broadcast
    (cluster/wire_select.py: q ``rows``, new K/V ``kv_rows``); the same on every rank of the step."""
    kv_rows: torch.Tensor | None = None
    """(Rkv,) int64 sorted, a selected step's remote rank: the new tokens whose K/V it receives; None = all T."""

    @property
    def num_rows(self) -> int:
        return self.num_tokens if self.rows is None else int(self.rows.numel())


@dataclass(frozen=True)
class StepRequest:
    """One sequence in a step: its rows on each shard, tokens held before, tokens added."""

    rows: SequenceRows
    context_len: int
    num_new: int


def table_gatherer(allocator: ShardedKVAllocator, rows: list[SequenceRows], tables: dict):
    """gather(rank, replica): the sequences' block table on ``rank`` (their replica rows with ``replica``),
    gathered once into ``tables`` and reused by every plan that passes the same dict."""
    def gather(rank: int, replica: bool) -> torch.Tensor:
        if (rank, replica) not in tables:
            tables[rank, replica] = allocator.tables[rank].gather([(r.replica if replica else r.primary)[rank]
                                                                   for r in rows])
        return tables[rank, replica]
    return gather


def plan_step(allocator: ShardedKVAllocator, requests: list[StepRequest], step_id: int,
              pcp_enabled: bool, pcp_min_tokens: int, incarnation: int = 0,
              auth: str | None = None, *, row_window: int | None = None, growth: Growth | None = None,
              tables: dict | None = None, wire_cost: WireCost | None = None) -> list[ShardStepPlan]:
    """One ShardStepPlan per rank; pages for the new tokens must already be allocated. ``auth``: the shard
    secret the plans carry (a shard runs only plans of its coordinator). ``row_window``: every layer's window
    is at most this (ServiceConfig.row_window): a rank computes and sends no row for a query it holds no key of
    within it. ``growth``: the step's allocation, whose copy-on-write pages each shard copies. ``tables``: block
    tables gathered by an earlier plan of the same sequences and pages (a decode run's steps), reused instead
    of gathered again. ``wire_cost``: which ranks are remote to the client and what their rows cost (a long
    request's causal part is then split by time, attention/pcp.py); None: equal shares."""
    gather = table_gatherer(allocator, [r.rows for r in requests], {} if tables is None else tables)
    n = allocator.num_shards
    query_lens = [r.num_new for r in requests]
    context_lens = [r.context_len for r in requests]
    # Decodes are folded into the context pass of the rank storing their token (no causal pass, no extra merge).
    pieces = plan_causal_pieces(query_lens, n, pcp_min_tokens, pcp_enabled, skip_decodes=True, wire_cost=wire_cost)
    plans = []
    for rank in range(n):
        table = gather(rank, False)
        md = make_dcp_context_metadata(query_lens, context_lens, table, allocator.block_size, n, rank,
                                       allocator.interleave, fold_decodes=True)
        replica_slots = None
        if allocator.replicas == 2:
            # The replica rows mirror the owner's layout, so the owner's slot rule applies to them.
            owner = allocator.primary_of(rank)
            replica_table = gather(rank, True)
            replica_slots = make_dcp_context_metadata(query_lens, context_lens, replica_table, allocator.block_size,
                                                      n, owner, allocator.interleave).slot_mapping
        copies = growth.copies_on(rank) if growth is not None and growth.copies else None
        plans.append(ShardStepPlan(step_id=step_id, num_tokens=sum(query_lens), metadata=md,
                                   causal_pieces=pieces[rank], replica_slot_mapping=replica_slots, page_copies=copies,
                                   rows=computed_rows(md.query_lens_cpu, md.seq_lens_cpu, pieces[rank],
                                                      md.window_key_start(row_window)),
                                   incarnation=incarnation, auth=auth))
    return plans


def for_client(plan: ShardStepPlan) -> ShardStepPlan:
    """The plan of a shard the client computes in its own process: without the shard secret (the client never
    calls that shard) and without its block table (sent as deltas, cluster/page_delta.py)."""
    num_seqs = plan.metadata.block_table_tensor.shape[0]
    md = dataclasses.replace(plan.metadata, block_table_tensor=torch.empty(num_seqs, 0, dtype=torch.int64))
    return dataclasses.replace(plan, auth=None, metadata=md)


def computed_rows(query_lens_B: torch.Tensor, local_context_B: torch.Tensor, pieces_P3: torch.Tensor,
                  key_start_T: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows with any key on this rank: requests with local context (from ``key_start_T``, each query's first
    local key in a window every layer shares, on), plus its causal pieces; None = all."""
    mask_T = local_context_B.repeat_interleave(query_lens_B) > (0 if key_start_T is None else key_start_T)
    for q_start, q_end, _ in pieces_P3.tolist():
        mask_T[q_start:q_end] = True
    if bool(mask_T.all()):
        return None
    return mask_T.nonzero().flatten()
