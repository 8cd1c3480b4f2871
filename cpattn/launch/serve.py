"""``cpattn serve``: start a detached, named service from a YAML file and/or flags (flags win)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from cpattn.config import ServiceConfig, load_config
from cpattn.launch.cli import _SERVICE_FLAG_EXCLUDED


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The service config: YAML file values, overridden by every flag given. Raises ConfigError."""
    overrides = {f: getattr(args, f, None) for f in ServiceConfig.model_fields if f not in _SERVICE_FLAG_EXCLUDED}
    overrides.update(name=args.name, namespace=args.namespace, ray_address=args.address, detached=True)
    if args.config:
        return load_config(args.config, **overrides)
    return ServiceConfig(**{k: v for k, v in overrides.items() if v is not None})


def serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    import ray

    from cpattn.cluster.service import ensure_ray, launch_coordinator, stop_coordinator

    embedded = cfg.ray_address is None and not ray.is_initialized()
    try:
        started_ray = ensure_ray(cfg.ray_address, cfg.namespace,
                                 num_cpus_hint=cfg.num_shards * cfg.num_cpus_per_shard)
    except ConnectionError as exc:
        from cpattn.launch.common import connection_error

        raise connection_error(cfg.ray_address, exc) from None
    try:
        coordinator = launch_coordinator(cfg)
        described = ray.get(coordinator.describe.remote(), timeout=cfg.rpc_timeout_s)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    shards = described["shards"]
    nodes = sorted({s["node_id"] for s in shards})
    first = shards[0]
    print(f"cpattn service {cfg.name!r} (namespace {cfg.namespace!r}) is up: {len(shards)} shards on "
          f"{len(nodes)} node(s), backend {first['backend']} ({first['kernel_version']}), device {first['device']}, "
          f"{first['num_blocks']} blocks of {cfg.block_size} tokens per shard", flush=True)
    print(f"attach with cpattn.connect(name={cfg.name!r}, namespace={cfg.namespace!r}); "
          f"inspect with `cpattn status`; stop with `cpattn stop`", flush=True)
    if not embedded:
        # The coordinator is detached: it outlives this process on the cluster.
        if started_ray:
            ray.shutdown()
        return 0
    # An embedded Ray instance dies with the process that started it, so stay up until told to stop.
    address = ray.get_runtime_context().gcs_address
    print(f"embedded Ray at {address}: serving until Ctrl-C (other shells: `cpattn status --address {address}`; "
          "use --address to run on a cluster that outlives this process)", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping the service", file=sys.stderr, flush=True)
    finally:
        stop_coordinator(coordinator, cfg.rpc_timeout_s)
        ray.shutdown()
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
