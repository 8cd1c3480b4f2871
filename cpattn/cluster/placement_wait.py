"""Waiting for a service to start, out loud: while its shards' placement group is pending, a line every few
seconds saying what is missing and what holds it; a wait that nothing will end by itself fails within
``placement_wait_s`` naming the fix (which service to stop, which field to lower).

Runs in the process that starts the service (the coordinator places the shards; this only reads the GCS's
actor and placement-group tables and the cluster's resources, each call bounded by Ray's GCS timeouts).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import ray

from cpattn.config import ServiceConfig
from cpattn.errors import ServiceError

REPORT_EVERY_S = 5.0
POLL_S = 0.5
# Placement-group bundle resources appear as e.g. CPU_group_<id>; only the plain resources are compared.
_PENDING, _CREATED, _ALIVE = "PENDING", "CREATED", "ALIVE"
_PLAIN = ("CPU", "GPU")


@dataclass
class Holder:
    """Something on the cluster holding resources: a service, another placement group, an actor, tasks."""

    what: str
    resources: dict[str, float]
    frees_by_itself: bool = False      # running tasks end; placement groups and actors stay until stopped
    stop_hint: str | None = None       # e.g. "`cpattn stop --name other`"


@dataclass
class Shortfall:
    need: dict[str, float]                       # the pending group's bundles, summed
    available: dict[str, float]
    total: dict[str, float]
    holders: list[Holder] = field(default_factory=list)

    @property
    def missing(self) -> dict[str, float]:
        return {r: n - self.available.get(r, 0.0) for r, n in self.need.items() if n > self.available.get(r, 0.0) + 1e-9}

    @property
    def too_small(self) -> dict[str, float]:
        """Resources the whole cluster has less of than the group needs: no wait can place it."""
        return {r: self.total.get(r, 0.0) for r, n in self.need.items() if n > self.total.get(r, 0.0) + 1e-9}

    def can_free_up(self) -> bool:
        """Something holding a missing resource will release it by itself (a running task)."""
        missing = self.missing
        return not self.too_small and any(h.frees_by_itself and any(h.resources.get(r, 0) > 0 for r in missing)
                                          for h in self.holders)

    def describe(self) -> str:
        lacking = ", ".join(f"{_num(n)} {r} (of {_num(self.need[r])} needed, {_num(self.available.get(r, 0))} free)"
                            for r, n in self.missing.items())
        held = "; ".join(f"{h.what}: {_amounts(h.resources)}" for h in self.holders
                         if any(h.resources.get(r, 0) > 0 for r in self.missing))
        if not lacking:
            return "the free resources do not fit the bundles on any node arrangement the strategy allows"
        return f"missing {lacking}" + (f"; held by {held}" if held else "")


COORDINATOR_CLASSES = ("RemoteCoordinator", "Coordinator")
"""Ray's class names of a cpattn coordinator (RemoteCoordinator since the authority surface; Coordinator before)."""


def wait_for_start(coordinator, config: ServiceConfig, operator_credential: str | None = None, report=None):
    """``coordinator.start(operator_credential)``, reporting a pending placement every REPORT_EVERY_S and
    failing with ServiceError once nothing can place the shards within ``placement_wait_s``."""
    report = report or _print_line
    start_ref = coordinator.start.remote(operator_credential)
    creator = coordinator._actor_id.binary()
    deadline = time.monotonic() + config.start_timeout_s + 30
    next_report = time.monotonic() + REPORT_EVERY_S
    stuck_since, last_state = None, None
    while True:
        ready, _ = ray.wait([start_ref], timeout=POLL_S)
        if ready:
            return ray.get(start_ref, timeout=config.rpc_timeout_s)
        now = time.monotonic()
        if now > deadline:
            raise ServiceError(f"service {config.name!r} did not start within {config.start_timeout_s}s: "
                               "check the cluster's free resources (ray status)")
        if now < next_report:
            continue
        next_report = now + REPORT_EVERY_S
        try:
            shortfall = pending_shortfall(config, creator)
        except Exception:   # no GCS tables here (a Ray Client driver, ray://): wait silently as before
            shortfall = None
        if shortfall is None:   # placed (or not yet created): the shards are starting
            stuck_since, last_state = None, None
            continue
        state = (tuple(sorted(shortfall.available.items())), tuple(h.what for h in shortfall.holders))
        if state != last_state or shortfall.can_free_up():
            stuck_since, last_state = now, state   # something changed or will: the wait is worth it
        waited = now - stuck_since
        if shortfall.too_small or waited >= config.placement_wait_s:
            raise ServiceError(_failure(config, shortfall))
        report(f"cpattn: waiting to place {config.num_shards} shards of service {config.name!r}: "
               f"{shortfall.describe()} (gives up in {config.placement_wait_s - waited:.0f}s unless that changes)")


def pending_shortfall(config: ServiceConfig, creator: bytes) -> Shortfall | None:
    """What the service's pending placement group (made by the actor ``creator``, its coordinator) lacks and who
    holds it; None when it is not pending."""
    from cpattn.cluster.placement import placement_group_name

    groups = _placement_groups()
    ours = [g for g in groups if g.name == placement_group_name(config.name) and g.creator_actor_id == creator
            and _pg_state(g) == _PENDING]
    if not ours:
        return None
    mine = ours[0]
    need = _bundle_sum(mine)
    return Shortfall(need=need, available=_plain(ray.available_resources()), total=_plain(ray.cluster_resources()),
                     holders=_holders(groups, mine.placement_group_id))


def _failure(config: ServiceConfig, shortfall: Shortfall) -> str:
    where = f"could not place {config.num_shards} shards of service {config.name!r}"
    per_shard = {"CPU": config.num_cpus_per_shard, "GPU": config.num_gpus_per_shard}
    fixes = []
    if shortfall.too_small:
        have = ", ".join(f"{_num(v)} {r}" for r, v in shortfall.too_small.items())
        return (f"{where}: they need {_amounts(shortfall.need)} and the whole cluster has {have}: "
                f"{_lower_hint(config, shortfall.total, per_shard)}, or add nodes")
    fixes += [h.stop_hint for h in shortfall.holders if h.stop_hint
              and any(h.resources.get(r, 0) > 0 for r in shortfall.missing)]
    fixes.append(_lower_hint(config, shortfall.available, per_shard))
    return (f"{where} within {config.placement_wait_s:.0f}s, and nothing holding the resources will release them: "
            f"{shortfall.describe()}. Fix: {'; or '.join(fixes)}")


def _lower_hint(config: ServiceConfig, room: dict[str, float], per_shard: dict[str, float]) -> str:
    """Which field to lower so the shards fit in ``room``."""
    tight = [r for r in ("GPU", "CPU") if per_shard[r] > 0 and per_shard[r] * config.num_shards > room.get(r, 0) + 1e-9]
    resource = tight[0] if tight else "CPU"
    fit = int(room.get(resource, 0) // per_shard[resource]) if per_shard[resource] > 0 else config.num_shards
    flag = "num_cpus_per_shard (--num-cpus-per-shard)" if resource == "CPU" else "num_gpus_per_shard (--num-gpus-per-shard)"
    hint = f"lower num_shards (--num-shards) to {fit}" if 0 < fit < config.num_shards else "lower num_shards (--num-shards)"
    if resource == "CPU" and room.get("CPU", 0) > 0:
        hint += f", or {flag} to {_num(room['CPU'] / config.num_shards)}"
    elif resource == "CPU" or fit == 0:
        hint += f" or {flag}"
    return hint


def _holders(groups, exclude_id: bytes) -> list[Holder]:
    actors = alive_actors()
    by_id = {a.actor_id: a for a in actors}
    holders, accounted = [], {}
    for g in groups:
        if _pg_state(g) != _CREATED or g.placement_group_id == exclude_id:   # only a created group holds bundles
            continue
        res = _bundle_sum(g)
        _add(accounted, res)
        creator = by_id.get(g.creator_actor_id)
        if creator is not None and creator.class_name in COORDINATOR_CLASSES:
            flags = "" if creator.name == "cpattn" else f" --name {creator.name}"
            flags += "" if creator.ray_namespace == "cpattn" else f" --namespace {creator.ray_namespace}"
            holders.append(Holder(f"service {creator.name!r} (namespace {creator.ray_namespace!r})", res,
                                  stop_hint=f"stop service {creator.name!r} (`cpattn stop{flags}`)"))
        else:
            holders.append(Holder(f"placement group {g.name or g.placement_group_id.hex()[:8]!r}", res))
    for a in actors:
        if a.placement_group_id.strip(b"\x00") or not a.required_resources:   # in a group: counted with it
            continue
        res = _plain(dict(a.required_resources))
        if any(res.values()):
            _add(accounted, res)
            holders.append(Holder(f"actor {a.class_name}" + (f" {a.name!r}" if a.name else ""), res))
    total, available = _plain(ray.cluster_resources()), _plain(ray.available_resources())
    tasks = {r: total.get(r, 0) - available.get(r, 0) - accounted.get(r, 0) for r in total}
    tasks = {r: v for r, v in tasks.items() if v > 1e-6}
    if tasks:
        holders.append(Holder("running tasks", tasks, frees_by_itself=True))
    return holders


def _placement_groups():
    from ray.core.generated import gcs_pb2

    accessor = ray._private.state.state._connect_and_get_accessor()
    return [gcs_pb2.PlacementGroupTableData.FromString(raw) for raw in accessor.get_placement_group_table()]


def alive_actors():
    from ray.core.generated import gcs_pb2

    accessor = ray._private.state.state._connect_and_get_accessor()
    return [gcs_pb2.ActorTableData.FromString(raw) for raw in accessor.get_actor_table(None, _ALIVE)]


def _pg_state(group) -> str:
    from ray.core.generated import gcs_pb2

    return gcs_pb2.PlacementGroupTableData.PlacementGroupState.Name(group.state)


def _bundle_sum(group) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in group.bundles:
        _add(total, _plain(dict(bundle.unit_resources)))
    return total


def _plain(resources: dict) -> dict[str, float]:
    return {r: float(v) for r, v in resources.items() if r in _PLAIN}


def _add(into: dict[str, float], more: dict[str, float]) -> None:
    for r, v in more.items():
        into[r] = into.get(r, 0.0) + v


def _num(x: float) -> str:
    return f"{x:g}" if abs(x) >= 0.01 or x == 0 else f"{x:.2g}"


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{_num(v)} {r}" for r, v in resources.items() if v)


def _print_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
