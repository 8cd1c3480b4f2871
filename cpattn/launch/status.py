"""``cpattn status``, ``stop`` and ``list``: describe or stop a running service by name, or list them all."""

from __future__ import annotations

import argparse
import json

from cpattn.errors import ServiceError
from cpattn.launch.common import attach, detach

_STATUS_TIMEOUT_S = 30.0


def gather_status(name: str, namespace: str, credential_for) -> dict:
    """The coordinator's description (config, shards) and live stats (blocks, sequences) of one service.
    ``credential_for()`` gives its operator credential, asked once the service is known to exist."""
    from cpattn.cluster.rpc import call
    from cpattn.cluster.service import find_coordinator

    try:
        coordinator = find_coordinator(name, namespace)
    except ServiceError as exc:
        raise ServiceError(f"{exc} (`cpattn list` shows every service on the cluster)") from None
    operator_credential = credential_for()
    described = call(coordinator.describe.remote(operator_credential), _STATUS_TIMEOUT_S, "describe")
    stats = call(coordinator.stats.remote(operator_credential, True), _STATUS_TIMEOUT_S, "stats")   # admin view
    return {"describe": described, "stats": stats}


def _operator_credential(args: argparse.Namespace, name: str, namespace: str):
    """(credential, the file serve saved it in): flag, else environment, else that file."""
    import ray

    from cpattn.launch import operator

    path = operator.credential_path(ray.get_runtime_context().gcs_address, namespace, name)
    return operator.find(getattr(args, "operator_credential", None), path, args.command), path


def _status_refs(coordinator, credential: str | None) -> list:
    return [coordinator.describe.remote(credential), coordinator.stats.remote(credential, True)]   # admin view


def _saved_credential(name: str, namespace: str) -> str | None:
    """The operator credential of a service from the environment or the file serve saved, else None."""
    import ray

    from cpattn.errors import AccessDeniedError
    from cpattn.launch import operator

    try:
        return operator.find(None, operator.credential_path(ray.get_runtime_context().gcs_address, namespace, name),
                             "list")
    except AccessDeniedError:
        return None


def format_status(status: dict) -> str:
    cfg = status["describe"]["config"]
    shards = status["describe"]["shards"]
    stats = status["stats"]
    nodes = sorted({s["node_id"] for s in shards})
    first = shards[0] if shards else {}
    lines = [
        f"service {cfg['name']!r} (namespace {cfg['namespace']!r}): {len(shards)} shards on {len(nodes)} node(s)",
        f"backend {stats.get('backend') or first.get('backend')} ({stats.get('kernel_version') or first.get('kernel_version')}), "
        f"prefill {stats.get('prefill_backend') or first.get('prefill_backend')}, "
        f"LSE base {first.get('lse_base')}, dtype {cfg['dtype']}, block_size {cfg['block_size']} "
        f"(kernel pages {first.get('kernel_block_size')}), dcp_interleave {cfg['dcp_interleave']}, "
        f"placement {cfg['placement_strategy']}",
        f"layers {cfg['num_layers']}, heads {cfg['num_q_heads']}q/{cfg['num_kv_heads']}kv x {cfg['head_size']}; "
        f"sequences {stats['num_sequences']}, clients {len(stats.get('clients', {}))}, "
        f"steps committed {stats['steps_committed']}, rolled back {stats['steps_rolled_back']}",
        *_warmup_line(shards),
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


def _warmup_line(shards: list[dict]) -> list[str]:
    """GPU shards: how long their kernels took to run once at start (compiling), the slowest shown."""
    seconds = [s["warmup_s"] for s in shards if s.get("warmup_s") is not None]
    if not seconds:
        return []
    return [f"kernels warmed at start in {max(seconds):.1f} s (the slowest of {len(seconds)} GPU shard(s): mostly "
            "compiling)"]


def status(args: argparse.Namespace) -> int:
    name, namespace = args.name or "cpattn", args.namespace or "cpattn"
    connected = attach(args.address, namespace)
    try:
        result = gather_status(name, namespace, lambda: _operator_credential(args, name, namespace)[0])
    finally:
        detach(connected)
    print(json.dumps(result, indent=2, default=str) if args.json else format_status(result))
    return 0


def stop(args: argparse.Namespace) -> int:
    import ray

    from cpattn.cluster.rpc import raise_remote_cause
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
            raise_remote_cause(exc, AccessDeniedError)
            config = None
        except Exception:
            config = None
        stop_coordinator(coordinator, _STATUS_TIMEOUT_S, config, credential)
        operator.forget(path)
    finally:
        detach(connected)
    print(f"stopped cpattn service {name!r} (namespace {namespace!r})")
    return 0


NO_CREDENTIAL = "no operator credential here"


def coordinator_actors() -> list[tuple[str, str, int]]:
    """(name, namespace, start time in ms) of every alive cpattn coordinator, by namespace and name."""
    from cpattn.cluster.placement_wait import COORDINATOR_CLASSES, alive_actors

    return sorted(((a.name, a.ray_namespace, a.start_time) for a in alive_actors()
                   if a.class_name in COORDINATOR_CLASSES and a.name), key=lambda f: (f[1], f[0]))


def gather_services() -> list[dict]:
    """Every cpattn service on the cluster (alive coordinators in any namespace), each with its status or why
    it did not answer; the calls run in parallel, bounded by one timeout."""
    import time

    import ray

    if ray.util.client.ray.is_connected():   # Ray Client (ray://): the GCS tables are read on the cluster
        found = ray.get(ray.remote(num_cpus=0)(coordinator_actors).remote(), timeout=_STATUS_TIMEOUT_S)
    else:
        found = coordinator_actors()
    pending = {}
    for name, namespace, _ in found:
        try:
            credential = _saved_credential(name, namespace)
            if credential is not None:   # a service whose operator credential is not here is listed without status
                pending[(name, namespace)] = _status_refs(ray.get_actor(name, namespace=namespace), credential)
        except ValueError:   # stopped meanwhile
            pass
    if pending:
        ray.wait([ref for refs in pending.values() for ref in refs], num_returns=2 * len(pending),
                 timeout=_STATUS_TIMEOUT_S)
    services = []
    for name, namespace, started_ms in found:
        entry = {"name": name, "namespace": namespace, "age_s": max(0.0, time.time() - started_ms / 1e3)}
        if (name, namespace) not in pending:
            entry["error"] = NO_CREDENTIAL
            services.append(entry)
            continue
        try:
            described, stats = ray.get(pending[(name, namespace)], timeout=0.1)
            entry.update(describe=described, stats=stats)
        except Exception as exc:   # one service that does not answer does not hide the others
            entry["error"] = type(exc).__name__
        services.append(entry)
    return services


def format_services(services: list[dict]) -> str:
    if not services:
        return "no cpattn services on this cluster (start one with `cpattn serve`)"
    lines = [f"{'service':<20} {'namespace':<12} {'shards':>6} {'clients':>7} {'sequences':>9} {'KV blocks':>15} "
             f"{'KV MiB':>8} {'age':>8}"]
    for s in services:
        head = f"{s['name']:<20} {s['namespace']:<12}"
        if "stats" not in s and s["error"] == NO_CREDENTIAL:   # it may be well: this machine cannot ask it
            lines.append(f"{head} status needs its operator credential (serve saved it on the machine that "
                         "started it; or set CPATTN_OPERATOR_CREDENTIAL)")
            continue
        if "stats" not in s:
            lines.append(f"{head} not answering ({s['error']})")
            continue
        shards = s["stats"]["shards"]
        alive = sum(1 for r in shards if r["alive"])
        used = sum(r["blocks_used"] for r in shards)
        total = used + sum(r["blocks_free"] for r in shards)
        lines.append(f"{head} {f'{alive}/{len(shards)}':>6} {len(s['stats'].get('clients', {})):>7} "
                     f"{s['stats']['num_sequences']:>9} {f'{used}/{total}':>15} "
                     f"{sum(r['bytes'] for r in shards) / 2**20:>8.2f} {_age(s['age_s']):>8}")
    return "\n".join(lines)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def list_services(args: argparse.Namespace) -> int:
    connected = attach(args.address, "cpattn")
    try:
        services = gather_services()
    finally:
        detach(connected)
    print(json.dumps(services, indent=2, default=str) if args.json else format_services(services))
    return 0
