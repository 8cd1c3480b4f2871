"""A shard's step with no context of its own (a prefill from empty): only the causal pieces among the new tokens.

Legend: T tokens of the step, Rq the query rows the shard computes, Rkv the new tokens whose K/V it receives.
Such a step writes its K/V and attends its causal pieces, and nothing else: no context pass, no merge. Its q, k
and v come either as the step's T rows (the client's in-process shards, a broadcast) or *compact*: a remote rank's
own message of a selected step (cluster/wire_select.py), q [Rq] its computed rows, k, v [Rkv] the tokens it
stores or attends. Compact, nothing is expanded to T rows: the slots and the pieces are renumbered once per step
into the message's rows, and the kernel reads the message as it arrived (AttentionImpl.forward_causal_pieces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.cluster.step_planner import ShardStepPlan


@dataclass
class NewTokensStep:
    slots: torch.Tensor
    """(T,) or, compact, (Rkv,) int64 (on the device once ``to`` moved it): where each row of k/v is written
    (-1: not on this shard)."""
    replica_slots: torch.Tensor | None
    """The same rows' slots of the replica this shard keeps (kv_replicas=2), else None."""
    pieces: torch.Tensor
    """[P, 4] int64 on the host (q_start, q_end, k_start, k_end) in q's and k's rows; their query rows, in order,
    are the rows the shard returns."""
    compact: bool

    def to(self, device: torch.device) -> NewTokensStep:
        replica = None if self.replica_slots is None else self.replica_slots.to(device)
        return NewTokensStep(self.slots.to(device), replica, self.pieces, self.compact)


def _all(rows: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens) if rows is None else rows


def plan_new_tokens(plan: ShardStepPlan, compact: bool) -> NewTokensStep:
    """Once per step, on the host. ``compact``: q/k/v will be the rank's own message (plan.rows, plan.kv_rows)."""
    pieces = plan.causal_pieces
    q_start, q_end, k_start = (pieces[:, i].contiguous() for i in range(3))
    slots, replica = plan.metadata.slot_mapping, plan.replica_slot_mapping
    if not compact:
        pieces_P4 = torch.stack([q_start, q_end, k_start, q_end], 1)
    else:
        q_rows, kv_rows = _all(plan.rows, plan.num_tokens), _all(plan.kv_rows, plan.num_tokens)
        # Each piece's queries and keys are consecutive tokens, all in the rows sent (wire_select.needed_kv_rows),
        # so each maps to a consecutive run of the message's rows.
        cq, ck = torch.searchsorted(q_rows, q_start), torch.searchsorted(kv_rows, k_start)
        pieces_P4 = torch.stack([cq, cq + (q_end - q_start), ck, ck + (q_end - k_start)], 1)
        if plan.kv_rows is not None:
            slots = slots.index_select(0, plan.kv_rows)
            replica = None if replica is None else replica.index_select(0, plan.kv_rows)
    return NewTokensStep(slots, replica, pieces_P4.contiguous(), compact)


def covers_rows(plan: ShardStepPlan) -> bool:
    """The pieces' query rows are exactly the rows the shard returns (a step with no context on it: always). The
    planner puts every piece's rows among them (step_planner.computed_rows) and pieces are disjoint, so counting
    suffices."""
    pieces = plan.causal_pieces
    return int((pieces[:, 1] - pieces[:, 0]).sum()) == plan.num_rows
