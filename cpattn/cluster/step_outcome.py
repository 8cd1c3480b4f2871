"""What end_step answers: a committed step's shard timings, or why a step did not commit and what to do.

Pure functions (no Ray, no state): the coordinator decides the order, these the words.
"""

from __future__ import annotations

from cpattn.cluster.messages import EndStepReply, ShardStepReport
from cpattn.errors import InvalidRequestError, ServiceError, StepFencedError

COMMITTED_BEFORE_RESTART = EndStepReply(committed_before_restart=True)


def shard_timings(reports: list[ShardStepReport]) -> EndStepReply:
    """The slowest shard's plan, attention and wire seconds (the step waited for it), and the most steps a
    shard served as one graph replay (cluster/shard_graphs.py)."""
    return EndStepReply(shard_plan_s=max((r.plan_s for r in reports), default=0.0),
                        attention_s=max((r.attention_s for r in reports), default=0.0),
                        shard_wire_s=max((r.wire_s for r in reports), default=0.0),
                        shard_graphed_steps=max((r.graphed_steps for r in reports), default=0))


def unknown_step_error(step_id, begun_before_restart: bool) -> InvalidRequestError | StepFencedError:
    if begun_before_restart:
        return StepFencedError(f"step {step_id} was open when the coordinator restarted: the shards stopped writing "
                               "it and it was rolled back (none of its tokens were committed); run the step again")
    return InvalidRequestError(f"step {step_id} is not open")


def failed_step_error(step_id: int, failure: str, silent: dict[int, float], lost: dict[int, str],
                      shard_hang_timeout_s: float) -> ServiceError:
    """A rolled-back step whose shards all kept their KV (``lost`` empty), or whose lost shards are not replaced yet."""
    if lost:   # not replaced while end_step waited: its node is unreachable or full
        return ServiceError(
            f"step {step_id} failed and was rolled back: {failure}; shard(s) {sorted(lost)} were lost "
            f"({'; '.join(lost.values())}) and are being replaced (a replacement starts once its node is reachable "
            "again): run the step again; the next step waits for the replacement. With kv_replicas=2 the "
            "replacement is refilled from the replicas; with 1, sequences that had KV there raise ShardLostError")
    if silent:
        return ServiceError(
            f"step {step_id} failed and was rolled back: {failure}; shard(s) {sorted(silent)} have not answered "
            f"for {max(silent.values()):.0f}s (a network partition?) and are replaced only after "
            f"shard_hang_timeout_s={shard_hang_timeout_s:g}s; no KV was lost: run the step again once they answer")
    return ServiceError(f"step {step_id} failed and was rolled back: {failure}; no shard was lost: run the step "
                        "again (the client rebuilds its data-plane group first)")
