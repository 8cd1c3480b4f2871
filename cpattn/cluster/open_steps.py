"""The coordinator's open steps: their ids, who holds them, and the shard threads they (and rolled-back steps
whose shard calls have not returned yet) hold.

Pure state: no Ray and no lock (the coordinator holds its lock around every call; it hands in how to ask
which shard calls are still running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from cpattn.errors import AccessDeniedError, CapacityError, InvalidRequestError
from cpattn.kvstore.sharded_allocator import Growth

# Open steps one client may hold at once: a client is one thread with one step, so more is a tenant trying to
# hold the shards' step threads (each open step holds one on every shard) that other clients need.
MAX_OPEN_STEPS_PER_CLIENT = 1

# Step ids are journalled this far ahead, so a restarted coordinator never reuses one.
STEP_ID_RESERVE = 1000

RUN_ID_SPAN = 4096
"""Step ids a decode run holds: its steps are numbered step_id, step_id + 1, ... and an extension (extend_run)
continues the numbering, so the ids after a run's first are its own (another client's step given one of them
would meet the run's committed steps in the journal's committed-before-restart check). A run extended this far
ends; the next begins afresh (once per 4096 steps: nothing next to a step's time)."""


@dataclass
class OpenStep:
    step_id: int
    client_id: str
    seq_ids: list[str]
    new_lengths: list[int]
    growth: Growth
    num_tokens: int
    epoch: int
    local_ranks: tuple[int, ...] = ()   # shards whose share the client computes in its own process
    refs: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    plan_s: float = 0.0
    later_growths: list[Growth] = field(default_factory=list)
    """A decode run (cluster/decode_run.py): the pages of its steps after the first, one Growth each."""
    done: int = 0
    """A decode run: how many of its steps the client committed so far (each adds one token per sequence)."""
    group_name: str = ""
    """The client's data-plane group: where the remote shards serve it (an extension goes to the same run)."""
    id_span: int = 1
    """Step ids held from step_id on (a decode run: RUN_ID_SPAN; its extensions number their steps within)."""
    extending: bool = False
    """A decode run whose extension is being handed to its shards (one at a time: they take them in order)."""
    ending: bool = False
    """An end_step is waiting for its shards: another one for the same step is refused at once, so one step
    holds at most one coordinator thread however often its client calls (coordinator.end_step)."""

    @property
    def num_substeps(self) -> int:
        """1 for a step; a decode run's number of planned steps (step ids step_id .. step_id + n - 1)."""
        return 1 + len(self.later_growths)

    def lengths_after(self, kept: int) -> list[int]:
        """The sequences' lengths once ``kept`` of its steps committed (a run's step adds one token to each)."""
        not_kept = self.num_substeps - kept
        return [n - not_kept for n in self.new_lengths]

    def growths_from(self, kept: int) -> list[Growth]:
        """The page growths of the steps not kept, last first (the order they are undone in)."""
        return list(reversed([self.growth, *self.later_growths][kept:]))


class OpenSteps:
    def __init__(self, max_open_steps: int, pending: Callable[[list], list], next_step: int = 1):
        self.max_open_steps = max_open_steps
        self._pending = pending              # shard calls of ``refs`` still running (ray.wait, timeout 0)
        self.steps: dict[int, OpenStep] = {}
        self.draining: list[list] = []       # shard calls of rolled-back steps still holding a thread
        self.next_step = next_step
        self.first_step = next_step          # steps numbered below this were begun by an earlier incarnation
        self.num_committed = 0
        self.num_rolled_back = 0

    def __len__(self) -> int:
        return len(self.steps)

    def restart_at(self, next_step: int) -> None:
        """After a coordinator restart: new ids from ``next_step``; lower ones were an earlier incarnation's."""
        self.next_step = self.first_step = next_step

    def held_by(self, client_id: str) -> list[OpenStep]:
        return [s for s in self.steps.values() if s.client_id == client_id]

    def pending_lengths(self, client_id: str) -> dict[str, int]:
        """The lengths the client's open steps take their sequences to (a run: its planned end)."""
        return {seq_id: n for step in self.held_by(client_id) for seq_id, n in zip(step.seq_ids, step.new_lengths)}

    def of(self, step_id, client_id: str) -> OpenStep | None:
        """The client's open step ``step_id``; another client's is as unknown as one that never existed."""
        step = self.steps.get(step_id) if isinstance(step_id, int) else None
        return step if step is not None and step.client_id == client_id else None

    def is_open(self, step: OpenStep) -> bool:
        return self.steps.get(step.step_id) is step

    def before_restart(self, step_id) -> bool:
        """Was ``step_id`` begun by an earlier incarnation of the coordinator?"""
        return isinstance(step_id, int) and not isinstance(step_id, bool) and 0 < step_id < self.first_step

    # Question and command: may a client open a step / open it ------------------------------------------------
    def check_can_open(self, client_id: str) -> None:
        held = len(self.held_by(client_id))
        if held >= MAX_OPEN_STEPS_PER_CLIENT:
            raise CapacityError(f"this client already holds {held} open step(s), the most one client may: end it "
                                "first (a client is one thread with one step; use another client for concurrent "
                                "steps)", needed=held + 1, free=0)
        self._check_shard_threads()

    def _check_shard_threads(self) -> None:
        """Each open step holds a thread on every shard: refuse one more than max_open_steps (issue 12).

        Rolled-back steps whose shard calls have not returned yet (a client that died mid-step, until its
        group breaks) still hold their threads and count too. An open step whose shard calls all returned holds
        none: its layers are done, or its shards gave up waiting for them (a client stalled mid-step, its
        heartbeat alive, for collective_timeout_s), so it no longer keeps other clients' steps out. A step not yet
        handed to its shards (no calls yet) counts.
        """
        cap = self.max_open_steps
        if len(self.steps) + len(self.draining) < cap:
            return
        self.draining = [p for p in (self._pending(refs) for refs in self.draining) if p]
        serving = [s for s in self.steps.values() if not s.refs or self._pending(s.refs)]
        held = len(serving) + len(self.draining)
        if held >= cap:
            raise CapacityError(
                f"{held} steps are open on the shards, the most they serve at once (max_open_steps={cap}): finish "
                "open steps first (a client holds one at a time), retry later, or raise max_open_steps",
                needed=held + 1, free=0)

    def free_threads(self) -> int:
        """Shard threads no open (or draining) step holds."""
        return self.max_open_steps - len(self.steps) - len(self.draining)

    def new_id(self, count: int = 1) -> tuple[int, bool]:
        """The first of ``count`` fresh step ids in a row, and whether the journal must now reserve the next
        ``STEP_ID_RESERVE`` (the ids crossed a multiple of it)."""
        step_id = self.next_step
        self.next_step += count
        return step_id, (step_id + count - 1) // STEP_ID_RESERVE > (step_id - 1) // STEP_ID_RESERVE

    def open(self, step: OpenStep) -> None:
        self.steps[step.step_id] = step

    def close(self, step: OpenStep, committed: bool, drain: bool = False) -> None:
        """The step is over; with ``drain`` its shard calls may still hold threads until they return."""
        self.steps.pop(step.step_id, None)
        self.num_committed += step.done   # a run's steps the client committed (a plain step: 1 or 0)
        if not committed:
            self.num_rolled_back += 1
        if drain and step.refs:
            self.draining.append(list(step.refs))


def check_local_ranks(local_ranks, num_shards: int, refusal: str | None = None) -> tuple[int, ...]:
    """The shards a client computes in its own process, sorted, once each. ``refusal``: why no client may
    (ServiceConfig.in_process_refusal), so a client that asks anyway is refused here, not only by its own code."""
    if not isinstance(local_ranks, (list, tuple)) or not all(type(r) is int and 0 <= r < num_shards
                                                             for r in local_ranks):
        raise InvalidRequestError(f"local_ranks {local_ranks!r} must be shard ranks in 0..{num_shards - 1}")
    if local_ranks and refusal is not None:
        raise AccessDeniedError(f"begin_step: local_ranks {list(local_ranks)} refused: {refusal}; pass local_ranks=[]")
    return tuple(sorted(set(local_ranks)))


def check_step_size(num_tokens: int, cap: int) -> None:
    if num_tokens > cap:
        raise InvalidRequestError(
            f"a step of {num_tokens} new tokens exceeds max_tokens_per_step={cap}: split the prefill into chunks "
            f"of at most {cap} tokens (or raise max_tokens_per_step if the shards have the memory)")
