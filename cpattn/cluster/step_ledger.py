"""A step's life on the coordinator's state owners: admitted (checked, its pages grown), opened (planned and
held), advanced (a decode run's steps committed one by one), closed (committed, or its pages returned), and
the answers end_step gives about a step it does not hold or that failed.

Pure state: no Ray and no lock (the coordinator holds its lock around every call and makes the Ray calls:
handing plans to shards, replacing lost ones). Each method is one move of the coordinator's order of things.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cpattn.cluster import decode_run, step_outcome
from cpattn.cluster.decode_run_plans import RunPlans
from cpattn.cluster.generations import Generations
from cpattn.cluster.messages import BeginStepReply, EndStepReply
from cpattn.cluster.metrics import ServiceMetrics
from cpattn.cluster.open_steps import RUN_ID_SPAN, OpenStep, OpenSteps, check_step_size
from cpattn.cluster.sequence_table import Sequence, SequenceTable
from cpattn.cluster.step_planner import ShardStepPlan, StepRequest, plan_step
from cpattn.cluster.wire_select import select_wire
from cpattn.config import ServiceConfig
from cpattn.errors import InvalidRequestError, ShardLostError
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import Growth


@dataclass
class Admitted:
    """A step that passed every check, with the pages of its first step grown (undone if it is not opened)."""

    client_id: str
    seqs: list[Sequence]
    request: dict[str, int]
    """{seq_id: num_new_tokens}, canonical."""
    num_steps: int
    """1, or the decode run granted (decode_run.run_length)."""
    growth: Growth


class StepLedger:
    def __init__(self, config: ServiceConfig, table: SequenceTable, steps: OpenSteps, metrics: ServiceMetrics,
                 new_step_id):
        self.config = config
        self.table = table
        self.steps = steps
        self.metrics = metrics
        self._new_step_id = new_step_id     # () -> int: the coordinator's (it journals the id reserve)

    # Question and command: may the step open / open it -------------------------------------------------------
    def admit(self, client_id: str, request, ahead, num_clients: int) -> Admitted:
        """Every check of a step, then its first step's pages (CapacityError before changing anything)."""
        seqs, request = self.table.admit(client_id, request)
        num_tokens = sum(request.values())
        check_step_size(num_tokens, self.config.max_tokens_per_step)
        self.table.limits.check_quota(self.table.owned_by(client_id), num_tokens)
        self.steps.check_can_open(client_id)
        num_steps = decode_run.run_length(request, ahead, self.steps.free_threads() - 1, num_clients - 1)
        growth = self.table.grow(seqs, [s.length + t for s, t in zip(seqs, request.values())])   # raises first
        return Admitted(client_id, seqs, request, num_steps, growth)

    def open(self, step: Admitted, local: tuple[int, ...], gen: Generations, wire: str | None = None,
             group_name: str = "") -> tuple[OpenStep, list[list]]:
        """Grow a run's later steps, plan every step once, and hold the step open: (the step, each step's
        plans per rank). Every growth is undone if planning fails. ``wire``: the client's data-plane backend
        (what a prefill step's layers cost it: cluster/wire_select.py)."""
        seqs, new_tokens = step.seqs, list(step.request.values())
        later_growths = decode_run.grow_run(self.table, step.client_id, seqs, step.num_steps)
        span = RUN_ID_SPAN if later_growths else 1   # a run's extensions number their steps after its own
        first_id = self._new_step_id(span)
        step_ids = list(range(first_id, first_id + 1 + len(later_growths)))
        lengths = [s.length for s in seqs]
        try:
            runs = decode_run.plan_steps(self.table.allocator, seqs, lengths, new_tokens, step_ids, self.config,
                                         gen.incarnation, gen.shard_secret, [step.growth, *later_growths], local)
            if any(t > 1 for t in new_tokens):   # a prefill: each remote rank may get only the rows it needs
                cfg = self.config
                for plans in runs:
                    select_wire(plans, local, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size,
                                cfg.torch_dtype.itemsize, cfg.prefill_wire, wire)
        except BaseException:
            for g in reversed([step.growth, *later_growths]):
                self.table.undo(g, [s.seq_id for s in seqs], step_ids[0])
            raise
        self.table.begin(seqs, step_ids[0])
        new_lengths = [n + t + len(later_growths) for n, t in zip(lengths, new_tokens)]
        opened = OpenStep(step_ids[0], step.client_id, [s.seq_id for s in seqs], new_lengths, step.growth,
                          runs[0][0].num_tokens, gen.epoch, local, later_growths=later_growths,
                          group_name=group_name, id_span=span)
        self.steps.open(opened)
        return opened, runs

    # A decode run extended while it runs (cluster/run_extension.py) -------------------------------------------
    def extend(self, step: OpenStep, ahead, gen: Generations, num_clients: int) -> tuple[list[Growth], RunPlans] | None:
        """Up to ``ahead`` more steps of the run ``step``, after its last planned one: their pages grown and every
        rank's plans, the step's lengths and growths extended (its close undoes them as its own); None when not
        granted (nothing changed): another epoch, a sequence gone, no thread to spare, no room, a copy on write."""
        seqs = [self.table.sequences.get(seq_id) for seq_id in step.seq_ids]
        if gen.epoch != step.epoch or step.num_substeps == 1 or any(s is None for s in seqs):
            return None
        num_steps = decode_run.extension_length(self.table, step, seqs, ahead, self.steps.free_threads(),
                                                num_clients - 1)
        ends = list(step.new_lengths)
        growths = grow_decode_run(self.table.allocator, [s.rows for s in seqs], ends, num_steps, first_step=0)
        if not growths or any(g.copies for g in growths):   # a run's own pages are never shared: refuse, not copy
            self._undo_pages(step, growths)
            return None
        first_id = step.step_id + step.num_substeps
        try:   # a decode-only run's plans, as begin_step's (no copies: checked above)
            plans = decode_run.plan_steps(self.table.allocator, seqs, ends, [1] * len(seqs),
                                          list(range(first_id, first_id + len(growths))), self.config,
                                          gen.incarnation, gen.shard_secret, growths)
        except BaseException:
            self._undo_pages(step, growths)
            raise
        step.later_growths.extend(growths)
        step.new_lengths = [n + len(growths) for n in ends]
        return growths, plans

    def withdraw(self, step: OpenStep, growths: list[Growth]) -> None:
        """An extension its shards did not all take: its steps leave the run, their pages return."""
        del step.later_growths[len(step.later_growths) - len(growths):]
        step.new_lengths = [n - len(growths) for n in step.new_lengths]
        self._undo_pages(step, growths)

    def _undo_pages(self, step: OpenStep, growths: list[Growth]) -> None:
        for growth in reversed(growths):
            self.table.undo(growth, step.seq_ids, release=False)   # the sequences stay in the run

    def reply(self, step: OpenStep, seqs: list[Sequence], request: dict[str, int], runs: list[list[ShardStepPlan]],
              held, epoch: int) -> BeginStepReply:
        """begin_step's answer: each step's plans for the client's in-process shards and the rows the others
        attend; those shards get one block table for the whole run (its last step's pages), as deltas."""
        local = step.local_ranks
        local_pages = {r: self.table.page_deltas(r, seqs, runs[-1][r].metadata.block_table_tensor, held)
                       for r in local}
        first, later = decode_run.client_steps(runs, [step.step_id + j for j in range(len(runs))], sorted(local))
        return BeginStepReply(**vars(first), num_tokens=runs[0][0].num_tokens, seq_ids=step.seq_ids,
                              query_lens=list(request.values()), plan_s=step.plan_s, epoch=epoch,
                              local_pages=local_pages, later=later)

    # A decode run goes on, a step closes ---------------------------------------------------------------------
    @staticmethod
    def num_kept(step: OpenStep, commit: bool, done) -> int:
        """How many of the step's steps end_step keeps (a plain step: all or none)."""
        return int(commit) if step.num_substeps == 1 else decode_run.check_done(done, step.num_substeps)

    def advance(self, step: OpenStep, kept: int) -> None:
        """A run goes on: its first ``kept`` steps are committed (lengths advance), it stays open."""
        if kept > step.done:
            step.done = kept
            self.table.advance(step.seq_ids, step.lengths_after(kept), step.step_id + kept - 1)

    def start_ending(self, step: OpenStep) -> None:
        """The one end_step that waits for the step's shards. Without this a client could send the same end_step
        many times at once, each waiting up to rpc_timeout_s on shards it never serves, and so hold every
        coordinator thread other clients' calls and heartbeats need."""
        if step.ending:
            raise InvalidRequestError(f"step {step.step_id} is already being ended by another end_step call: wait "
                                      "for that call's answer")
        step.ending = True

    def check_still_open(self, step: OpenStep) -> None:
        if not self.steps.is_open(step):   # rolled back meanwhile: the client's lease lapsed
            raise InvalidRequestError(f"step {step.step_id} was rolled back: its client ended (closed, or its lease "
                                      "lapsed); connect again and run the step again")

    def close(self, step: OpenStep, committed: bool, drain: bool = False) -> None:
        """Its first ``step.done`` steps (a plain step: all or none) keep their tokens; the pages of the rest
        return. ``committed``: the client ended it, nothing failed. ``drain``: its shard calls may still run."""
        self.steps.close(step, committed=committed, drain=drain)
        if step.done:
            self.table.commit(step.seq_ids, step.lengths_after(step.done), step.step_id + step.done - 1, True)
        for growth in [step.growth, *step.later_growths][:step.done]:
            self.table.finish(growth)   # copy on write: the committed steps drop the shared pages they copied
        for growth in step.growths_from(step.done):
            self.table.undo(growth, step.seq_ids, step.step_id)
        if committed:
            self.metrics.record_step(time.perf_counter() - step.started, step.num_tokens)
        else:
            self.metrics.record_rollback()

    def roll_back(self, client_id: str) -> list[OpenStep]:
        """A client ended: its open steps are closed, nothing kept beyond what it committed."""
        rolled_back = self.steps.held_by(client_id)
        for step in rolled_back:
            self.close(step, committed=False, drain=True)
        return rolled_back

    # end_step's answers about steps that did not simply commit -----------------------------------------------
    def unknown(self, step_id) -> EndStepReply:
        """A step this coordinator does not hold open: committed before a restart (its timings), else raises."""
        before = self.steps.before_restart(step_id)
        if before and any(s.last_step == step_id for s in self.table.sequences.values()):
            return step_outcome.COMMITTED_BEFORE_RESTART   # journalled, then the old incarnation died
        if before:
            self.metrics.record_error("StepFencedError")
        raise step_outcome.unknown_step_error(step_id, before)

    def raise_unless_replaced(self, step: OpenStep, failure: str, lost: dict[int, str], silent: dict[int, float],
                              epoch: int) -> None:
        """A rolled-back step: ServiceError (run it again now or later) unless a shard was replaced meanwhile,
        when only the KV of the step's sequences decides (``check_survived``)."""
        if lost or step.epoch == epoch:
            self.metrics.record_error("ServiceError")
            raise step_outcome.failed_step_error(step.step_id, failure, silent, lost, self.config.shard_hang_timeout_s)

    def check_survived(self, step: OpenStep) -> None:
        """After a replacement: ShardLostError naming the step's sequences whose KV went with the lost shard."""
        self.table.release_dropped(step.seq_ids)   # dropped while in this step: released now it is closed
        try:
            self.table.raise_if_unavailable(step.seq_ids, step.client_id)
        except ShardLostError as exc:
            self.metrics.record_error(type(exc).__name__)
            raise

    # fill_synthetic: a step without attention ----------------------------------------------------------------
    def plan_fill(self, client_id: str, seq_id: str, num_tokens: int, seed, gen: Generations
                  ) -> tuple[Sequence, Growth, list[ShardStepPlan]]:
        """The sequence held in no step (id -1) with the pages of ``num_tokens`` more, and each rank's plan."""
        self.table.raise_if_unavailable([seq_id], client_id)
        seq = self.table.get(seq_id, client_id)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**40:
            raise InvalidRequestError(f"seed {seed!r} must be an int in 0..2**40")
        self.table.limits.check_growth(seq, num_tokens, "num_tokens", "in")
        self.table.limits.check_quota(self.table.owned_by(client_id), num_tokens, self.steps.pending_lengths(client_id))
        growth = self.table.grow([seq], [seq.length + num_tokens])
        plans = plan_step(self.table.allocator, [StepRequest(seq.rows, seq.length, num_tokens)], 0, False, 1,
                          gen.incarnation, gen.shard_secret, growth=growth)
        self.table.begin([seq], -1)
        return seq, growth, plans

    def commit_fill(self, seq: Sequence, num_tokens: int, growth: Growth) -> int:
        self.table.commit([seq.seq_id], [seq.length + num_tokens], seq.last_step)
        self.table.finish(growth)
        return seq.length

    def undo_fill(self, seq: Sequence, growth: Growth) -> None:
        self.table.undo(growth, [seq.seq_id], -1)

