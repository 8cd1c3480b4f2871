"""Starting and finding the service on Ray: the named coordinator actor and its shards."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import ray

from cpattn.cluster.authority import CONTROL_GROUP, CONTROL_THREADS, digest
from cpattn.cluster.placement_wait import wait_for_start
from cpattn.cluster.rpc import raise_remote_cause
from cpattn.config import ServiceConfig
from cpattn.errors import AccessDeniedError, ServiceError

logger = logging.getLogger("cpattn")

COORDINATOR_MAX_CONCURRENCY = 64


def coordinator_threads(config: ServiceConfig) -> int:
    """The coordinator's default threads: every open step may hold one in end_step (waiting up to rpc_timeout_s
    for shards its client may never serve; a second end_step of a step is refused at once), and 16 stay for
    everything else. Heartbeats and stop have threads of their own (authority.CONTROL_GROUP)."""
    return max(COORDINATOR_MAX_CONCURRENCY, config.max_open_steps + 16)


def ensure_ray(address: str | None, namespace: str, num_cpus_hint: float = 0) -> bool:
    """Join ``address`` or start an embedded local Ray; returns True when this call started Ray."""
    if ray.is_initialized():
        return False
    if address is None:
        # Logical CPUs: enough for every shard bundle even on a 2-core machine; shards mostly wait on data.
        num_cpus = max(os.cpu_count() or 1, int(num_cpus_hint) + 2)
        from cpattn.cluster.reach import announce_new_token, use_local_token_auth

        new_token = use_local_token_auth()   # Ray's default for a local instance, without its banner every time
        # address="local": always a fresh embedded instance, never a `ray start` cluster found on the machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace,
                 logging_level=logging.WARNING, configure_logging=True, log_to_driver=True)
        if new_token:
            announce_new_token()
    else:
        from cpattn.cluster.reach import join_cluster

        join_cluster(address, namespace)
    return True


@contextmanager
def ray_for(config: ServiceConfig):
    """Ray for starting ``config``'s service (``ensure_ray``); yields whether this started it, and shuts the Ray it
    started down again if the body raises (nothing half-started outlives a failed start)."""
    started_ray = ensure_ray(config.ray_address, config.namespace,
                             num_cpus_hint=config.num_shards * config.num_cpus_per_shard)
    try:
        yield started_ray
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise


def launch_coordinator(config: ServiceConfig, operator_credential: str):
    """Create the named coordinator and start its shards; cleans up everything if any part fails.

    ``operator_credential`` (authority.new_operator_credential) is made by the caller, who keeps it; the
    coordinator gets only its hash, which the shards get too."""
    # Imported here: they pull in torch, which `cpattn status/stop/list` (find/stop_coordinator) never need.
    from cpattn.attention.registry import registry_state
    from cpattn.cluster.coordinator import RemoteCoordinator

    try:
        existing = ray.get_actor(config.name, namespace=config.namespace)
    except ValueError:
        existing = None
    if existing is not None:
        raise ServiceError(f"a service named {config.name!r} already runs in namespace {config.namespace!r}: "
                           f"attach with cpattn.connect(name={config.name!r}) or stop it with `cpattn stop`")
    # A shard dying in __init__ reaches us only as an opaque ActorDiedError: unknown names and settings the
    # backend cannot serve fail here, with every reason, before anything is placed.
    check_backend(config)
    options = {"name": config.name, "namespace": config.namespace, "num_cpus": 0,
               "max_concurrency": coordinator_threads(config)}
    if config.coordinator_resources:
        options["resources"] = dict(config.coordinator_resources)   # e.g. a resource only the head has
    if config.coordinator_label_selector:
        options["label_selector"] = dict(config.coordinator_label_selector)
    if config.detached:
        # Ray restarts a crashed detached coordinator; it restores its sequences from the journal.
        options["lifetime"] = "detached"
        options["max_restarts"] = -1
    actor_class = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_THREADS})(RemoteCoordinator)
    coordinator = actor_class.options(**options).remote(config, registry_state(), digest(operator_credential))
    try:
        # Says every few seconds what a pending placement lacks and who holds it; fails when nothing will free it.
        wait_for_start(coordinator, config, operator_credential)
    except BaseException as exc:
        try:
            ray.get(coordinator.shutdown.remote(operator_credential), timeout=config.rpc_timeout_s)
        except Exception:
            pass
        ray.kill(coordinator, no_restart=True)
        if config.detached:   # a detached placement group outlives its creator: remove it if still there
            remove_leftovers(config)
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise_remote_cause(exc)
            raise exc.as_instanceof_cause() from None
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            steer = "".join(f"; {name} is {getattr(config, name)}: a node must offer it"
                            for name in ("coordinator_resources", "coordinator_label_selector") if getattr(config, name))
            raise ServiceError(f"service {config.name!r} did not start within {config.start_timeout_s}s: "
                               f"check the cluster's free resources (ray status){steer}") from None
        raise
    return coordinator


def check_backend(config: ServiceConfig) -> None:
    """Select the attention backends (decode and prefill) here, as every shard will, before any actor (or Ray) starts.

    Raises BackendUnavailableError with every reason. CPU shards run the same selection on the same registry
    (plugins included), so it is checked in full. GPU shards may have devices and kernel packages this process
    lacks: here only what the backend declares is checked against the settings (an explicit TRITON asked for
    an fp8 cache it cannot serve fails now); the platform is probed in the first bundle once placed.
    """
    from cpattn.attention.selector import select_backend, select_prefill_backend
    from cpattn.kvstore import select_common_kernel_block_size

    if config.resolved_device() != "cpu":
        select_prefill_backend(config, select_backend(config, platform_here=False), platform_here=False)
        return
    backend = select_backend(config, "cpu")
    prefill = select_prefill_backend(config, backend, "cpu")   # an explicit one sharing the cache, every reason
    select_common_kernel_block_size(config.block_size, [b.get_supported_kernel_block_sizes() for b in (backend, prefill)])


def find_coordinator(name: str, namespace: str):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ServiceError(f"no cpattn service named {name!r} in namespace {namespace!r}: start one with "
                           "cpattn.start(...) or `cpattn serve`, or pass the right name/namespace") from None


def stop_coordinator(coordinator, timeout_s: float, config: ServiceConfig | None = None,
                     operator_credential: str | None = None) -> None:
    """Stop shards, remove the placement group, then the coordinator itself (the operator only: a coordinator
    that refuses ``operator_credential`` raises AccessDeniedError and is left running).

    With ``config`` of a detached service, also removes what a dead coordinator could leave behind
    (named shards, the named placement group, the journal).
    """
    try:
        ray.get(coordinator.shutdown.remote(operator_credential), timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        raise_remote_cause(exc, AccessDeniedError)
        logger.warning("coordinator shutdown call failed (%s); killing it", exc)
    except Exception as exc:   # already dead or hung: still kill it below
        logger.warning("coordinator shutdown call failed (%s); killing it", exc)
    try:
        ray.kill(coordinator, no_restart=True)
    except Exception:
        pass
    if config is not None and config.detached:
        remove_leftovers(config)


def remove_leftovers(config: ServiceConfig) -> None:
    """Kill a detached service's named shards, remove its placement group and clear its journal."""
    from ray.util import get_placement_group
    from ray.util.placement_group import remove_placement_group

    from cpattn.cluster.journal import CoordinatorJournal
    from cpattn.cluster.placement import placement_group_name, shard_actor_name

    for bundle in range(config.num_shards):
        try:
            ray.kill(ray.get_actor(shard_actor_name(config.name, bundle), namespace=config.namespace), no_restart=True)
        except ValueError:
            pass
    try:
        remove_placement_group(get_placement_group(placement_group_name(config.name)))
    except (ValueError, Exception):
        pass
    CoordinatorJournal(config.namespace, config.name).clear()
