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

from dataclasses import dataclass, replace

import torch

from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.attention.pcp import plan_causal_pieces
from cpattn.cluster.messages import StepPlans
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.kvstore import PAD_SLOT_ID, compute_slot_mapping, dcp_local_position, dcp_local_seq_lens, dcp_owner_rank
from cpattn.kvstore.sharded_allocator import Growth, ShardedKVAllocator


@dataclass
class RankRun:
    """One rank's plans of a decode run, stacked [S, B]; ``plan(j)`` is step j's ShardStepPlan."""

    rank: int
    step_ids: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    local_ctx: torch.Tensor
    computes: torch.Tensor
    """[S, B] bool: rows with any key on this rank."""
    replica_slots: torch.Tensor | None
    table: torch.Tensor
    pieces: torch.Tensor
    first_copies: torch.Tensor | None
    """The run's copies on write, made by its first step."""
    world_size: int
    interleave: int
    incarnation: int
    auth: str | None

    def plan(self, j: int) -> ShardStepPlan:
        num_seqs = self.positions.shape[1]
        qsl = torch.arange(num_seqs + 1, dtype=torch.int64)
        seq_lens = self.seq_lens[j]
        md = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens.clone(),
            seq_lens_cpu=seq_lens.clone(), context_lens_cpu=self.local_ctx[j].clone(), block_table_tensor=self.table,
            slot_mapping=self.slots[j].clone(), num_reqs=num_seqs, num_actual_tokens=num_seqs, max_query_len=1,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0, causal=False,
            query_positions_cpu=self.positions[j].clone(), dcp_world_size=self.world_size, dcp_rank=self.rank,
            dcp_interleave=self.interleave)
        computes = self.computes[j]
        return ShardStepPlan(
            step_id=self.step_ids[j], num_tokens=num_seqs, metadata=md, causal_pieces=self.pieces,
            replica_slot_mapping=None if self.replica_slots is None else self.replica_slots[j].clone(),
            page_copies=self.first_copies if j == 0 else None,
            rows=None if bool(computes.all()) else computes.nonzero().flatten(), incarnation=self.incarnation,
            auth=self.auth)

    def for_client(self) -> "RankRun":
        """step_planner.for_client of every step: no shard secret, no block table (the client gets deltas)."""
        return replace(self, auth=None, table=torch.empty(self.positions.shape[1], 0, dtype=torch.int64))


class RunPlans(list):
    """plans[step][rank] of a decode run, with each rank's stacked RankRun (``ranks``) for compact messages."""

    def __init__(self, steps: list[list[ShardStepPlan]], ranks: list[RankRun]):
        super().__init__(steps)
        self.ranks = ranks


class CompactList(list):
    """A list that travels as the stacked arrays it was made from: pickling one plan per step cost ~1 ms each
    (~10 tensors apiece) on the critical path of a run's first step; this is a few tensors for all of them.
    Unpickled, it is a plain list again."""

    def __init__(self, items: list, rebuild, args: tuple):
        super().__init__(items)
        self.rebuild, self.args = rebuild, args

    def __reduce__(self):
        return self.rebuild, self.args


def plans_of(run: RankRun, start: int) -> list[ShardStepPlan]:
    return [run.plan(j) for j in range(start, len(run.step_ids))]


def client_steps_of(runs: list[RankRun], local: list[int], start: int) -> list[StepPlans]:
    """What begin_step tells the client of steps start.. of a run: its in-process shards' plans (for_client) and
    the rows each remote shard sends back."""
    steps = []
    for j in range(start, len(runs[0].step_ids)):
        plans = [r.plan(j) for r in runs]
        steps.append(StepPlans(runs[0].step_ids[j], {r: plans[r] for r in local},
                               {r: p.rows for r, p in enumerate(plans) if r not in local and p.num_rows}))
    return steps


def plan_decode_run(allocator: ShardedKVAllocator, rows: list, lengths: list[int], step_ids: list[int],
                    gather, incarnation: int, auth: str | None, row_window: int | None, first: Growth | None,
                    pcp_enabled: bool, pcp_min_tokens: int) -> RunPlans:
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
    pieces = plan_causal_pieces([1] * num_seqs, n, pcp_min_tokens, pcp_enabled, skip_decodes=True)
    window_start = None if row_window is None else (flat - row_window + 1).clamp(min=0)
    ranks = []
    for rank in range(n):
        table = gather(rank, False)
        local_ctx = dcp_local_seq_lens(flat, n, rank, interleave)
        # A decode folds into the context pass of the rank storing it (step_planner, fold_decodes).
        seq_lens = local_ctx + (owner == rank).to(torch.int64)
        key_start = None if window_start is None else dcp_local_seq_lens(window_start, n, rank, interleave)
        replica_slots = None
        if allocator.replicas == 2:
            # The replica rows mirror the owner's layout, so the owner's slot rule applies to them.
            replica_slots = _slots(gather(rank, True), local_pos, owner == allocator.primary_of(rank), seq_of_token,
                                   block_size)
        ranks.append(RankRun(
            rank=rank, step_ids=list(step_ids), positions=positions,
            slots=_slots(table, local_pos, owner == rank, seq_of_token, block_size),
            seq_lens=seq_lens.view(num_steps, num_seqs), local_ctx=local_ctx.view(num_steps, num_seqs),
            computes=(seq_lens > (0 if key_start is None else key_start)).view(num_steps, num_seqs),
            replica_slots=replica_slots, table=table, pieces=pieces[rank],
            first_copies=first.copies_on(rank) if first is not None and first.copies else None,
            world_size=n, interleave=interleave, incarnation=incarnation, auth=auth))
    return RunPlans([[r.plan(j) for r in ranks] for j in range(num_steps)], ranks)


def _slots(table_BW: torch.Tensor, local_pos: torch.Tensor, owned: torch.Tensor, seq_of_token: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """[S, B] slots of the run's tokens this rank writes (PAD_SLOT_ID elsewhere), checked as any step's."""
    pos = torch.where(owned, local_pos, torch.full_like(local_pos, PAD_SLOT_ID))
    return compute_slot_mapping(table_BW, pos, seq_of_token, block_size).view(-1, table_BW.shape[0])
