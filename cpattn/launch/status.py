"""``cpattn status`` and ``cpattn stop``: describe or stop a running service by name."""

from __future__ import annotations

import argparse
import json

from cpattn.launch.common import attach, detach

_STATUS_TIMEOUT_S = 30.0


def gather_status(name: str, namespace: str, operator_credential: str) -> dict:
    """The coordinator's description (config, shards) and live stats (blocks, sequences) of one service."""
    from cpattn.cluster.rpc import call
    from cpattn.cluster.service import find_coordinator

    coordinator = find_coordinator(name, namespace)
    described = call(coordinator.describe.remote(operator_credential), _STATUS_TIMEOUT_S, "describe")
    stats = call(coordinator.stats.remote(operator_credential, True), _STATUS_TIMEOUT_S, "stats")   # admin view
    return {"describe": described, "stats": stats}


def _operator_credential(args: argparse.Namespace, name: str, namespace: str):
    """(credential, the file serve saved it in): flag, else environment, else that file."""
    import ray

    from cpattn.launch import operator

    path = operator.credential_path(ray.get_runtime_context().gcs_address, namespace, name)
    return operator.find(getattr(args, "operator_credential", None), path, args.command), path


def format_status(status: dict) -> str:
    cfg = status["describe"]["config"]
    shards = status["describe"]["shards"]
    stats = status["stats"]
    nodes = sorted({s["node_id"] for s in shards})
    first = shards[0] if shards else {}
    lines = [
        f"service {cfg['name']!r} (namespace {cfg['namespace']!r}): {len(shards)} shards on {len(nodes)} node(s)",
        f"backend {stats.get('backend') or first.get('backend')} ({stats.get('kernel_version') or first.get('kernel_version')}), "
        f"LSE base {first.get('lse_base')}, dtype {cfg['dtype']}, block_size {cfg['block_size']} "
        f"(kernel pages {first.get('kernel_block_size')}), dcp_interleave {cfg['dcp_interleave']}, "
        f"placement {cfg['placement_strategy']}",
        f"layers {cfg['num_layers']}, heads {cfg['num_q_heads']}q/{cfg['num_kv_heads']}kv x {cfg['head_size']}; "
        f"sequences {stats['num_sequences']}, clients {len(stats.get('clients', {}))}, "
        f"steps committed {stats['steps_committed']}, rolled back {stats['steps_rolled_back']}",
        "",
        f"{'rank':>4}  {'node_ip':<15} {'node_id':<12} {'device':<8} {'used':>7} {'free':>7} {'tokens':>9} "
        f"{'KV MiB':>8}  alive",
    ]
    by_rank = {s["rank"]: s for s in shards}
    for row in stats["shards"]:
        info = by_rank.get(row["rank"], {})
        lines.append(f"{row['rank']:>4}  {str(row.get('node_ip')):<15} {str(info.get('node_id', ''))[:12]:<12} "
                     f"{str(row.get('device')):<8} {row['blocks_used']:>7} {row['blocks_free']:>7} {row['tokens']:>9} "
                     f"{row['bytes'] / 2**20:>8.2f}  {'yes' if row['alive'] else 'LOST'}")
    lost = status["describe"].get("lost") or {}
    for rank, why in lost.items():
        lines.append(f"shard {rank} lost: {why}")
    return "\n".join(lines)


def status(args: argparse.Namespace) -> int:
    name, namespace = args.name or "cpattn", args.namespace or "cpattn"
    connected = attach(args.address, namespace)
    try:
        result = gather_status(name, namespace, _operator_credential(args, name, namespace)[0])
    finally:
        detach(connected)
    print(json.dumps(result, indent=2, default=str) if args.json else format_status(result))
    return 0


def stop(args: argparse.Namespace) -> int:
    import ray

    from cpattn.cluster.service import find_coordinator, stop_coordinator
    from cpattn.config import ServiceConfig
    from cpattn.errors import AccessDeniedError
    from cpattn.launch import operator

    name, namespace = args.name or "cpattn", args.namespace or "cpattn"
    connected = attach(args.address, namespace)
    try:
        coordinator = find_coordinator(name, namespace)
        credential, path = _operator_credential(args, name, namespace)
        try:   # the config lets stop remove what a dead coordinator left (named shards, placement group)
            config = ServiceConfig(**ray.get(coordinator.describe.remote(credential), timeout=_STATUS_TIMEOUT_S)["config"])
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, AccessDeniedError):
                raise exc.cause from None
            config = None
        except Exception:
            config = None
        stop_coordinator(coordinator, _STATUS_TIMEOUT_S, config, credential)
        operator.forget(path)
    finally:
        detach(connected)
    print(f"stopped cpattn service {name!r} (namespace {namespace!r})")
    return 0
