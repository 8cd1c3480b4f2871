"""The plans of a decode run's steps, all S steps of a rank in one set of tensor operations.

Runs in: the coordinator (cluster/decode_run.plan_steps, under its lock).
A decode run's steps differ only by one token per sequence: step j's token of sequence b sits at global
position lengths[b] + j. Planned one step at a time (step_planner.plan_step) each step cost ~40 small torch
operations per rank, 1.5-3 ms per step on a GPU host, paid by the client at the start of every run
(2.9 ms per step at 128K on 2 H200s, a quarter of a 32-layer step). Here the S x B positions of a run are
computed at once per rank and each step's metadata is a row of them: the same plans, field for field
(tests/test_decode_run_plans.py compares them with plan_step's).
Legend: S steps, B sequences, W block-table width.
"""

from __future__ import annotations

import torch

from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.attention.pcp import plan_causal_pieces
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.kvstore import PAD_SLOT_ID, compute_slot_mapping, dcp_local_position, dcp_local_seq_lens, dcp_owner_rank
from cpattn.kvstore.sharded_allocator import Growth, ShardedKVAllocator


def plan_decode_run(allocator: ShardedKVAllocator, rows: list, lengths: list[int], step_ids: list[int],
                    gather, incarnation: int, auth: str | None, row_window: int | None, first: Growth | None,
                    pcp_enabled: bool, pcp_min_tokens: int) -> list[list[ShardStepPlan]]:
    """``plan_step`` of every step of a decode-only run (one new token per sequence per step); ``rows`` the
    sequences' SequenceRows, ``gather(rank, replica)`` their block tables (every page of the run allocated),
    ``first`` the growth whose copies the run's first step makes. Returns plans[step][rank]."""
    n, block_size, interleave = allocator.num_shards, allocator.block_size, allocator.interleave
    num_steps, num_seqs = len(step_ids), len(rows)
    positions = torch.tensor(lengths, dtype=torch.int64)[None, :] + torch.arange(num_steps)[:, None]   # [S, B]
    flat = positions.flatten()
    owner = dcp_owner_rank(flat, n, interleave)
    local_pos = dcp_local_position(flat, n, interleave)
    seq_of_token = torch.arange(num_seqs).repeat(num_steps)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int64)
    pieces = plan_causal_pieces([1] * num_seqs, n, pcp_min_tokens, pcp_enabled, skip_decodes=True)
    window_start = None if row_window is None else (flat - row_window + 1).clamp(min=0)
    plans: list[list[ShardStepPlan]] = [[] for _ in step_ids]
    for rank in range(n):
        table = gather(rank, False)
        slots = _slots(table, local_pos, owner == rank, seq_of_token, block_size)
        local_ctx = dcp_local_seq_lens(flat, n, rank, interleave)
        # A decode folds into the context pass of the rank storing it (step_planner, fold_decodes).
        seq_lens = (local_ctx + (owner == rank).to(torch.int64)).view(num_steps, num_seqs)
        local_ctx = local_ctx.view(num_steps, num_seqs)
        key_start = None if window_start is None else dcp_local_seq_lens(window_start, n, rank, interleave)
        computes = (seq_lens.flatten() > (0 if key_start is None else key_start)).view(num_steps, num_seqs)
        replica_slots = None
        if allocator.replicas == 2:
            # The replica rows mirror the owner's layout, so the owner's slot rule applies to them.
            replica_slots = _slots(gather(rank, True), local_pos, owner == allocator.primary_of(rank), seq_of_token,
                                   block_size)
        max_seq = seq_lens.max(dim=1).values.tolist()
        all_rows = computes.all(dim=1).tolist()
        for j, step_id in enumerate(step_ids):
            md = CommonAttentionMetadata(
                query_start_loc=qsl.clone(), query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens[j].clone(),
                seq_lens_cpu=seq_lens[j].clone(), context_lens_cpu=local_ctx[j].clone(), block_table_tensor=table,
                slot_mapping=slots[j].clone(), num_reqs=num_seqs, num_actual_tokens=num_seqs, max_query_len=1,
                max_seq_len=max_seq[j], causal=False, query_positions_cpu=positions[j].clone(), dcp_world_size=n,
                dcp_rank=rank, dcp_interleave=interleave)
            copies = first.copies_on(rank) if j == 0 and first is not None and first.copies else None
            plans[j].append(ShardStepPlan(
                step_id=step_id, num_tokens=num_seqs, metadata=md, causal_pieces=pieces[rank],
                replica_slot_mapping=None if replica_slots is None else replica_slots[j].clone(), page_copies=copies,
                rows=None if all_rows[j] else computes[j].nonzero().flatten(), incarnation=incarnation, auth=auth))
    return plans


def _slots(table_BW: torch.Tensor, local_pos: torch.Tensor, owned: torch.Tensor, seq_of_token: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """[S, B] slots of the run's tokens this rank writes (PAD_SLOT_ID elsewhere), checked as any step's."""
    pos = torch.where(owned, local_pos, torch.full_like(local_pos, PAD_SLOT_ID))
    return compute_slot_mapping(table_BW, pos, seq_of_token, block_size).view(-1, table_BW.shape[0])
