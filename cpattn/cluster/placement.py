"""Placement of shard actors: one bundle per shard, ranks by a pure function of where shards landed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLocation:
    """Where one shard actor runs, as it reports itself."""

    bundle_index: int
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...] = ()


def assign_ranks(locations: list[ShardLocation]) -> list[int]:
    """Rank of each shard: sorted by node, then GPU, then bundle, so neighbouring ranks share a node.

    Returns ranks[i] for locations[i]. Pure and deterministic: tested without Ray.
    """
    def gpu_key(loc: ShardLocation):
        return tuple(int(g) if str(g).isdigit() else -1 for g in loc.gpu_ids) or (-1,)

    order = sorted(range(len(locations)),
                   key=lambda i: (locations[i].node_ip, locations[i].node_id, gpu_key(locations[i]),
                                  locations[i].bundle_index))
    ranks = [0] * len(locations)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def shard_bundles(num_shards: int, num_cpus: float, num_gpus: float,
                  resources: dict[str, float] | None = None) -> list[dict[str, float]]:
    """One resource bundle per shard (plus the config's custom ``resources``); Ray rejects empty bundles, so a
    shard asks for a sliver of CPU at least."""
    bundle: dict[str, float] = {"CPU": num_cpus if num_cpus > 0 else 0.01}
    if num_gpus > 0:
        bundle["GPU"] = num_gpus
    bundle.update(resources or {})
    return [dict(bundle) for _ in range(num_shards)]


# The names of a service's Ray objects, here (no torch, no actors) so that `cpattn stop` can remove what a dead
# coordinator left without importing the shard code.
def shard_actor_name(service_name: str, bundle_index: int) -> str:
    return f"{service_name}-shard-{bundle_index}"


def placement_group_name(service_name: str) -> str:
    return f"{service_name}-pg"
