"""The plans of a decode run's steps, all S steps of a rank in one set of tensor operations.

Runs in: the coordinator (cluster/decode_run.plan_steps, under its lock); a run's later steps are built from
its RunSteps in the shard and the client that receive them.
A decode run's steps differ only by one token per sequence: step j's token of sequence b sits at global
position lengths[b] + j. Planned one step at a time (step_planner.plan_step) each step cost ~40 small torch
operations per rank, 1.5-3 ms per step on a GPU host, paid by the client at the start of every run
(2.9 ms per step at 128K on 2 H200s, a quarter of a 32-layer step). Here the S x B positions of a run are
computed at once per rank and each step's metadata is a row of them: the same plans, field for field
(tests/test_decode_run_plans.py compares them with plan_step's).
Legend: S steps, B sequences, W block-table width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from cpattn.array_pickle import TensorsAsArrays
from cpattn.attention.metadata import CommonAttentionMetadata
from cpattn.attention.pcp import plan_causal_pieces
from cpattn.cluster.messages import StepPlans
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.kvstore import PAD_SLOT_ID, compute_slot_mapping, dcp_local_position, dcp_local_seq_lens, dcp_owner_rank
from cpattn.kvstore.sharded_allocator import Growth, ShardedKVAllocator


@dataclass
class RankRun(TensorsAsArrays):
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

    _not_pickled = ("_steps", "_computes_all")

    def plan(self, j: int, whole_run: bool = True) -> ShardStepPlan:
        """``whole_run``: every step's tensors are built at once and kept (where the run's steps are all built);
        else step j's alone (the coordinator builds only a run's first and last step)."""
        num_seqs = self.positions.shape[1]
        steps, k = (self._step_rows(), j) if whole_run else (_StepRows.of(self, j), 0)
        qsl = steps.qsl[k]
        md = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=steps.qsl_cpu[k], seq_lens=steps.seq_lens[k],
            seq_lens_cpu=steps.seq_lens_cpu[k], context_lens_cpu=steps.local_ctx[k], block_table_tensor=self.table,
            slot_mapping=steps.slots[k], num_reqs=num_seqs, num_actual_tokens=num_seqs, max_query_len=1,
            max_seq_len=steps.max_seq_len[k], causal=False,
            query_positions_cpu=steps.positions[k], dcp_world_size=self.world_size, dcp_rank=self.rank,
            dcp_interleave=self.interleave)
        return ShardStepPlan(
            step_id=self.step_ids[j], num_tokens=num_seqs, metadata=md, causal_pieces=self.pieces,
            replica_slot_mapping=None if self.replica_slots is None else steps.replica_slots[k],
            page_copies=self.first_copies if j == 0 else None, rows=self.rows(j, whole_run),
            incarnation=self.incarnation, auth=self.auth)

    def rows(self, j: int, whole_run: bool = True) -> torch.Tensor | None:
        """Step j's ShardStepPlan.rows: the rows this rank computes, None for all."""
        if whole_run:   # which steps compute every row, found once (not pickled)
            computes_all = self.__dict__.get("_computes_all")
            if computes_all is None:
                computes_all = self._computes_all = self.computes.all(dim=1).tolist()
            every_row = computes_all[j]
        else:
            every_row = bool(self.computes[j].all())
        return None if every_row else self.computes[j].nonzero().flatten()

    def _step_rows(self) -> "_StepRows":
        """Every step's tensors at once, built where the plans are (not pickled): indexing and cloning a row of
        each [S, B] tensor per step was ~2/3 of building a plan. Each step still gets its own tensors (rows of
        one fresh copy per field, a separate copy where a plan holds two), as one clone per step gave it."""
        steps = self.__dict__.get("_steps")
        if steps is None:
            steps = self._steps = _StepRows.of(self)
        return steps

    def for_client(self) -> "RankRun":
        """step_planner.for_client of every step: no shard secret, no block table (the client gets deltas)."""
        return replace(self, auth=None, table=torch.empty(self.positions.shape[1], 0, dtype=torch.int64))


@dataclass
class _StepRows:
    """RankRun's per-step tensors, rows of one copy per field (each step's row its own memory)."""

    qsl: tuple
    qsl_cpu: tuple
    seq_lens: tuple
    seq_lens_cpu: tuple
    local_ctx: tuple
    slots: tuple
    positions: tuple
    replica_slots: tuple | None
    max_seq_len: list[int]

    @classmethod
    def of(cls, run: RankRun, only: int | None = None) -> "_StepRows":
        """Every step's rows, or (``only``) that step's alone, as entry 0."""
        steps = slice(None) if only is None else slice(only, only + 1)

        def rows(t: torch.Tensor) -> tuple:
            return t[steps].clone().unbind(0)
        seq_lens = run.seq_lens[steps]
        num_steps, num_seqs = seq_lens.shape
        qsl = torch.arange(num_seqs + 1, dtype=torch.int64).expand(num_steps, num_seqs + 1)
        return cls(qsl=qsl.clone().unbind(0), qsl_cpu=qsl.clone().unbind(0), seq_lens=rows(run.seq_lens),
                   seq_lens_cpu=rows(run.seq_lens), local_ctx=rows(run.local_ctx), slots=rows(run.slots), positions=rows(run.positions),
                   replica_slots=None if run.replica_slots is None else rows(run.replica_slots),
                   max_seq_len=seq_lens.amax(dim=1).tolist() if num_seqs else [0] * num_steps)


class RunPlans(Sequence):
    """plans[step][rank] of a decode run, each step's plans built when first read (the coordinator reads the
    first and last only: the rest travel as each rank's stacked RankRun, ``ranks``)."""

    def __init__(self, ranks: list[RankRun]):
        self.ranks = ranks
        self._built: dict[int, list[ShardStepPlan]] = {}

    def __len__(self) -> int:
        return len(self.ranks[0].step_ids)

    def __getitem__(self, j: int) -> list[ShardStepPlan]:
        j = _index(j, len(self))
        if j not in self._built:
            self._built[j] = [r.plan(j, whole_run=False) for r in self.ranks]
        return self._built[j]


class RunSteps(Sequence):
    """A decode run's steps from ``start`` on as they travel: each rank's stacked RankRun, a few arrays for all
    of them (pickling one plan per step cost ~1 ms each, ~10 tensors apiece, on the critical path of a run's
    first step). A step's plan is built in the receiving process when first read: a remote shard builds step
    j's while it waits for the client's header, the client when it begins step j (``make(self, j)``)."""

    def __init__(self, make: Callable, ranks: list[RankRun], start: int, local: tuple[int, ...] = ()):
        self.make, self.ranks, self.start, self.local = make, ranks, start, local
        self.block_tables: dict[int, torch.Tensor] = {}
        """The client's in-process shards' block tables (one per run: cluster/page_delta.py), set on every step."""
        self._built: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.ranks[0].step_ids) - self.start

    def __getitem__(self, i: int):
        i = _index(i, len(self))
        if i not in self._built:
            self._built[i] = self.make(self, self.start + i)
        return self._built[i]

    def __reduce__(self):
        return RunSteps, (self.make, self.ranks, self.start, self.local)

    @property
    def auths(self) -> set:
        """The shard secret every plan of the run carries (checked once, not by building each plan)."""
        return {r.auth for r in self.ranks}

    @property
    def auth(self) -> str | None:
        """As a plan's: what a shard's authority rule checks when the whole run is run_step's ``plan``."""
        return next(iter(self.auths)) if len(self.auths) == 1 else None


def _index(i: int, n: int) -> int:
    if not isinstance(i, int):
        raise TypeError(f"a run's steps are read one at a time, not by {type(i).__name__}")
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(i)
    return i


def shard_step(steps: RunSteps, j: int) -> ShardStepPlan:
    """A remote shard's plan of step j (its RankRun is the only one it gets)."""
    return steps.ranks[0].plan(j)


def client_step(steps: RunSteps, j: int) -> StepPlans:
    """What the client needs of step j: its in-process shards' plans (for_client, with the run's block tables)
    and the rows each remote shard sends back."""
    # A segment's first two steps are planned alone (where graphs serve, its later steps open steady: building every
    # step's rows at once, ~1-2 ms at 128 steps, would be for nothing); from its third on, all at once.
    local = {r: steps.ranks[r].plan(j, whole_run=j >= 2) for r in steps.local}
    for r, table in steps.block_tables.items():
        local[r].metadata.block_table_tensor = table
    remote = {r: run.rows(j) for r, run in enumerate(steps.ranks) if r not in local}   # rows only: no whole plan
    return StepPlans(steps.ranks[0].step_ids[j], local,
                     {r: rows for r, rows in remote.items() if rows is None or rows.numel()})


def use_block_tables(steps: Sequence, tables: dict[int, torch.Tensor]) -> None:
    """The client's in-process shards read these block tables in every later step of the run."""
    if isinstance(steps, RunSteps):
        steps.block_tables = tables   # the steps not built yet get them when built
        steps = list(steps._built.values())
    for step in steps:
        for r, table in tables.items():
            step.local_plans[r].metadata.block_table_tensor = table


def run_auths(steps: Sequence) -> set:
    """The shard secrets a run's later plans carry."""
    return steps.auths if isinstance(steps, RunSteps) else {getattr(p, "auth", None) for p in steps}


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
    return RunPlans(ranks)


def _slots(table_BW: torch.Tensor, local_pos: torch.Tensor, owned: torch.Tensor, seq_of_token: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """[S, B] slots of the run's tokens this rank writes (PAD_SLOT_ID elsewhere), checked as any step's."""
    pos = torch.where(owned, local_pos, torch.full_like(local_pos, PAD_SLOT_ID))
    return compute_slot_mapping(table_BW, pos, seq_of_token, block_size).view(-1, table_BW.shape[0])
