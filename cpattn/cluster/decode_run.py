"""Decode runs, the coordinator's side: several decode steps planned by one begin_step.

A decode loop asks the coordinator for the same thing every step (each sequence + 1 token), and each ask
cost a Ray round trip, a plan, a Ray call to every remote shard and the shard's own plan: 7-13 ms per step
on two H200s against ~10 ms of kernels for 32 layers at 128K. So a client whose step is decode-only asks
for ``ahead`` steps at once (config ``decode_run_steps``); the coordinator grows every sequence by up to
that many tokens, plans each step (step ids step_id, step_id + 1, ...), and hands each remote shard the
whole run in one call. The client then runs the steps without asking again (cluster/gateway.DecodeRun);
each step is committed as before (``end_step(..., done=n)``: the first n steps are in), and a run the
client stops early gives back the pages of the steps it did not run.

Pure functions of the sequence table (no Ray); the coordinator holds its lock around them.
"""

from __future__ import annotations

from cpattn.attention.pcp import WireCost
from cpattn.cluster.messages import StepPlans
from cpattn.cluster.decode_run_plans import RunPlans, RunSteps, client_step, plan_decode_run, shard_step
from cpattn.cluster.sequence_table import Sequence, SequenceTable
from cpattn.cluster.step_planner import ShardStepPlan, StepRequest, for_client, plan_step, table_gatherer
from cpattn.config import ServiceConfig
from cpattn.errors import InvalidRequestError
from cpattn.kvstore.sharded_allocator import Growth, ShardedKVAllocator

MAX_RUN_STEPS = 256
"""A run longer than this saves nothing more (its start is already ~0.05 ms of each step's time on an H200 host) and
holds more pages ahead."""


def run_length(request: dict[str, int], ahead, free_threads: int, other_clients: int) -> int:
    """How many steps to plan: ``ahead`` for a decode-only request, else 1.

    A run keeps its step open (and a thread on every shard) between its steps, so it is granted only
    while as many threads stay free as there are other clients (each can still open a step).
    """
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 1 <= ahead <= MAX_RUN_STEPS:
        raise InvalidRequestError(f"ahead {ahead!r} must be an int in 1..{MAX_RUN_STEPS}")
    if ahead == 1 or any(n != 1 for n in request.values()) or free_threads <= other_clients:
        return 1
    return ahead


def grow_run(table: SequenceTable, client_id: str, seqs: list[Sequence], num_steps: int) -> list[Growth]:
    """Pages for the run's steps after its first (the first grew as any step does): as many steps as fit
    the cache and the client's quota, at most ``num_steps - 1`` more; the run is shortened, never refused."""
    for seq in seqs:   # step j holds length + j + 1 tokens: check_growth's limit
        num_steps = min(num_steps, table.limits.capacity_tokens() - seq.length)
    quota = table.config.max_tokens_per_client
    if quota is not None and seqs:   # check_quota's limit
        num_steps = min(num_steps, (quota - sum(map(table.limits.held_tokens, table.owned_by(client_id)))) // len(seqs))
    return table.grow_run(seqs, num_steps)


def extension_length(table: SequenceTable, step, seqs: list[Sequence], ahead, free_threads: int,
                     other_clients: int) -> int:
    """How many steps an open run ``step`` (open_steps.OpenStep) may add after its last planned one: up to
    ``ahead``, while a thread stays free for each other client (run_length's rule: ``free_threads`` already
    leaves out the run's own), within its step ids (RUN_ID_SPAN), the cache and the client's quota, counted from
    the run's planned end."""
    num_steps = run_length({s.seq_id: 1 for s in seqs}, ahead, free_threads, other_clients)
    if num_steps == 1:   # not granted (or asked for one step: an extension of one saves nothing)
        return 0
    num_steps = min(num_steps, step.id_span - step.num_substeps)
    for end in step.new_lengths:   # step j of the extension holds end + j + 1 tokens
        num_steps = min(num_steps, table.limits.capacity_tokens() - end)
    quota = table.config.max_tokens_per_client
    if quota is not None and seqs:   # the run's planned tokens count as held
        held = sum(map(table.limits.held_tokens, table.owned_by(step.client_id)))
        planned = held + (step.num_substeps - step.done) * len(seqs)
        num_steps = min(num_steps, (quota - planned) // len(seqs))
    return max(num_steps, 0)


def plan_steps(allocator: ShardedKVAllocator, seqs: list[Sequence], lengths: list[int], new_tokens: list[int],
               step_ids: list[int], cfg: ServiceConfig, incarnation: int, secret: str,
               growths: list[Growth], local: tuple[int, ...] = ()) -> list[list[ShardStepPlan]]:
    """Every rank's plan of each step (a plain step: one; ``growths[j]`` its pages). ``local``: the client's
    in-process ranks (a prefill's causal part gives the others a share smaller by what their wire costs).

    Every page of the run is allocated before it is planned, so the block tables gathered for the first step
    serve all (gathering them again was 60% of a run's plan). Those tables already hold every copy-on-write
    page of the run, so the first step makes all the run's copies (a shared page never changes while shared:
    copying it early is exact, and a step given back undoes its copy with its growth)."""
    tables: dict = {}
    first = Growth(copies=[c for g in growths for c in g.copies])
    if all(t == 1 for t in new_tokens):   # decode-only: every step at once (decode_run_plans.py)
        gather = table_gatherer(allocator, [s.rows for s in seqs], tables)
        return plan_decode_run(allocator, [s.rows for s in seqs], lengths, step_ids, gather, incarnation, secret,
                               cfg.row_window(), first, cfg.pcp_enabled, cfg.pcp_min_tokens)
    cost = None
    if local:
        cost = WireCost.of([r for r in range(allocator.num_shards) if r not in local], cfg.num_q_heads,
                           cfg.num_kv_heads, cfg.head_size, cfg.torch_dtype.itemsize, cfg.pcp_wire_flops_per_byte)
    return [plan_step(allocator, [StepRequest(s.rows, n + j, t) for s, n, t in zip(seqs, lengths, new_tokens)],
                      step_id, cfg.pcp_enabled, cfg.pcp_min_tokens, incarnation, secret,
                      row_window=cfg.row_window(), growth=first if j == 0 else None, tables=tables, wire_cost=cost)
            for j, step_id in enumerate(step_ids)]


def shard_plans(runs: list[list[ShardStepPlan]], rank: int) -> tuple:
    """run_step's (plan, later) for a remote shard: a run planned at once travels whole as its RunSteps (the block
    table once, every step built on the shard as it is reached), else the first plan and the later ones."""
    if isinstance(runs, RunPlans):
        return RunSteps(shard_step, [runs.ranks[rank]], 0), None
    return runs[0][rank], later_plans(runs, rank)


def later_plans(runs: list[list[ShardStepPlan]], rank: int) -> list[ShardStepPlan]:
    """What a remote shard gets of a run's steps after the first (compact when the run was planned at once)."""
    if isinstance(runs, RunPlans):
        return RunSteps(shard_step, [runs.ranks[rank]], 1)
    return [plans[rank] for plans in runs[1:]]


def client_steps(runs: list[list[ShardStepPlan]], step_ids: list[int],
                 local: list[int]) -> tuple[StepPlans, list[StepPlans]]:
    """What begin_step tells the client of each step, (the first, the later ones): its in-process shards' plans
    (without secret or block table) and the rows each remote shard sends back."""
    def of(j: int) -> StepPlans:
        plans = runs[j]
        return StepPlans(step_ids[j], {r: for_client(plans[r]) for r in local},
                         {r: p.rows for r, p in enumerate(plans) if r not in local and p.num_rows},
                         remote_kv_rows={r: p.kv_rows for r, p in enumerate(plans) if r not in local}
                         if plans[0].selected else None)
    if isinstance(runs, RunPlans):
        return of(0), RunSteps(client_step, [r.for_client() for r in runs.ranks], 1, tuple(local))
    return of(0), [of(j) for j in range(1, len(runs))]


def check_done(done, num_substeps: int) -> int:
    """``done`` of end_step: how many of a run's steps completed (0 .. its number of steps)."""
    if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= num_substeps:
        raise InvalidRequestError(f"done {done!r} must be an int in 0..{num_substeps} (the steps of this run)")
    return done
