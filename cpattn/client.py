"""The public face: ``start``, ``connect`` and ``Service`` (``Step`` lives in cpattn.step).

The client process is the data-plane gateway (rank 0 of its own group with the shards): per
layer it validates q/k/v, broadcasts them, gathers each shard's partial (out, natural-log LSE)
and merges them. Everything per step (validation, allocation, planning) goes through the
coordinator once; nothing per layer goes through Ray.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from cpattn.cluster.data_plane import DataPlane, create_group
from cpattn.cluster.netstore import make_bound_store
from cpattn.cluster.ids import canonical_id, canonical_request
from cpattn.cluster.lease import LeaseKeeper
from cpattn.cluster.rpc import call as _call
from cpattn.cluster.service import ensure_ray, find_coordinator, launch_coordinator, stop_coordinator
from cpattn.config import ServiceConfig
from cpattn.errors import InvalidRequestError, ShardLostError
from cpattn.step import Step

logger = logging.getLogger("cpattn")


def start(config: ServiceConfig) -> "Service":
    """Start a service (a local embedded Ray instance unless ``config.ray_address``) and return its client."""
    started_ray = ensure_ray(config.ray_address, config.namespace,
                             num_cpus_hint=config.num_shards * config.num_cpus_per_shard)
    try:
        coordinator = launch_coordinator(config)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    try:
        return Service(coordinator, config, owns_service=True, owns_ray=started_ray)
    except BaseException:
        stop_coordinator(coordinator, config.rpc_timeout_s)
        if started_ray:
            ray.shutdown()
        raise


def connect(name: str = "cpattn", namespace: str = "cpattn", address: str | None = None,
            timeout_s: float = 60.0, on_lapse: str = "free", credential: str | None = None) -> "Service":
    """Attach to a running service; ``address`` defaults to the current Ray cluster ('auto').

    ``on_lapse``: what happens to this client's sequences if it dies without close() (its lease lapses after
    client_lease_s): "free" (default) or "keep". close() always keeps them. ``credential``: the
    ``Service.credential`` of a client that ended with sequences kept resumes that client (and its sequences).
    """
    started_ray = ensure_ray(address or "auto", namespace) if not ray.is_initialized() else False
    coordinator = find_coordinator(name, namespace)
    described = _call(coordinator.describe.remote(), timeout_s, "coordinator.describe")
    config = ServiceConfig(**described["config"])
    return Service(coordinator, config, owns_service=False, owns_ray=started_ray, on_lapse=on_lapse,
                   credential=credential)


class Service:
    """A client of one cpattn service, used by one thread: one open step at a time. A second thread opening
    a step (or attending another thread's) is refused with InvalidRequestError; give each thread its own
    ``cpattn.connect()``."""

    def __init__(self, coordinator, config: ServiceConfig, owns_service: bool, owns_ray: bool,
                 on_lapse: str = "free", credential: str | None = None):
        self.config = config
        self._coordinator = coordinator
        self._owns_service = owns_service
        self._owns_ray = owns_ray
        self._step: Step | None = None
        self._step_guard = threading.Lock()   # makes "one open step per client" atomic across threads
        self._closed = False
        self._plane: DataPlane | None = None
        self.last_step_timings: dict[str, float] = {}
        timeout = config.rpc_timeout_s
        # issue 12: a public id (group names, stats) and a secret credential that every coordinator call proves.
        registered = _call(coordinator.register_client.remote(on_lapse, credential), timeout, "register_client")
        self.client_id: str = registered["client_id"]
        self._credential: str = registered["credential"]
        self._lease = LeaseKeeper(coordinator, self._credential, config.client_lease_s)   # issue 12: client leases
        self._lease.start()
        try:
            described = _call(coordinator.describe.remote(), timeout, "coordinator.describe")
            self.shard_infos: list[dict] = described["shards"]
            self._join_data_plane()
        except BaseException:
            self._lease.stop()   # the lease lapses and the coordinator reclaims this half-made client
            raise

    @property
    def credential(self) -> str:
        """This client's secret: every call proves it; ``connect(credential=...)`` resumes the client after it
        ended with sequences kept (close(), or on_lapse='keep'). Never share it."""
        return self._credential

    @property
    def group_name(self) -> str:
        return f"{self.client_id}-e{self._epoch}-g{self._generation}"

    def _join_data_plane(self) -> None:
        """(Re)build this client's group with the current shards; rank 0 is this process."""
        cfg = self.config
        current = _call(self._coordinator.get_shards.remote(), cfg.rpc_timeout_s, "get_shards")
        self._epoch, self._shards = current["epoch"], current["shards"]
        self._generation = getattr(self, "_generation", 0) + 1   # a fresh group name on every (re)join
        self._plane_broken = False
        world = cfg.num_shards + 1
        backend = cfg.resolved_data_plane()
        host = ray.util.get_node_ip_address()
        store = make_bound_store(host, world, cfg.collective_timeout_s)   # issue 12: listens on the node IP only
        self._ticket = _call(self._coordinator.group_ticket.remote(self._credential, self.group_name),
                             cfg.rpc_timeout_s, "group_ticket")                   # issue 12: proves the join
        joins = [h.join_group.remote(self.group_name, host, store.port, rank + 1, world, backend, self._ticket)
                 for rank, h in enumerate(self._shards)]
        group = create_group(store, self.group_name, 0, world, backend, cfg.collective_timeout_s)
        _call(joins, cfg.rpc_timeout_s, "shards joining the data plane")
        self._store = store   # the store must outlive the group
        self._plane = DataPlane(group, 0, world, backend)

    def _rejoin(self) -> None:
        """After a shard was replaced: drop the broken group and join a new one."""
        old, old_ticket = self.group_name, self._ticket
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        for h in self._shards:
            try:
                h.leave_group.remote(old, old_ticket)
            except Exception:
                pass
        self._join_data_plane()

    # Sequences ------------------------------------------------------------------------------------
    def add_sequence(self) -> str:
        self._check_open()
        return _call(self._coordinator.add_sequence.remote(self._credential), self.config.rpc_timeout_s, "add_sequence")

    def free(self, seq_id: str) -> None:
        self._check_open()
        _call(self._coordinator.free.remote(self._credential, canonical_id(seq_id)), self.config.rpc_timeout_s, "free")

    def sequences(self) -> dict[str, int]:
        """This client's sequences and their lengths."""
        return _call(self._coordinator.list_sequences.remote(self._credential), self.config.rpc_timeout_s,
                     "list_sequences")

    def sequence_length(self, seq_id: str) -> int:
        return _call(self._coordinator.sequence_length.remote(self._credential, canonical_id(seq_id)), self.config.rpc_timeout_s,
                     "sequence_length")

    def fill_synthetic(self, seq_id: str, num_tokens: int, seed: int = 0) -> int:
        """Append seeded random KV without attention (benchmarks and load tests); returns the new length.

        The KV written is ``cpattn.cluster.shard.synthetic_kv(seed, layer, 0, num_tokens, Hk, D, device)`` (the
        fill's tokens in order, drawn on the shards' device).
        """
        self._check_open()
        return _call(self._coordinator.fill_synthetic.remote(self._credential, canonical_id(seq_id), num_tokens, seed),
                     self.config.rpc_timeout_s, "fill_synthetic")

    # Steps ----------------------------------------------------------------------------------------
    def step(self, request: dict[str, int]) -> "Step":
        """``with svc.step({seq_id: num_new_tokens}) as step: step.attend(layer, q, k, v)`` for every layer."""
        self._check_open()
        if self._step is not None:
            raise InvalidRequestError("a step is already open on this client: finish it before starting another; "
                                      "a client serves one thread (use a second client for concurrent steps)")
        return Step(self, canonical_request(request) if isinstance(request, dict) else request)

    # Introspection and lifecycle -----------------------------------------------------------------
    def stats(self, admin: bool = False) -> dict[str, Any]:
        """Usage: ``clients`` lists this client only, others are counted in ``other_clients``; ``admin=True``
        lists every client by its public id (an operator's view)."""
        return _call(self._coordinator.stats.remote(self._credential, admin), self.config.rpc_timeout_s, "stats")

    def info(self) -> dict[str, Any]:
        return _call(self._coordinator.describe.remote(), self.config.rpc_timeout_s, "describe")

    def close(self) -> None:
        """Leave the service running; drop this client's data-plane group."""
        if self._closed:
            return
        self._closed = True
        self._lease.stop()
        for h in self._shards:
            try:
                h.leave_group.remote(self.group_name, self._ticket)
            except Exception:
                pass
        try:
            self._coordinator.unregister_client.remote(self._credential)
        except Exception:
            pass
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        if self._owns_ray and not self._owns_service:
            ray.shutdown()

    def shutdown(self) -> None:
        """Stop the whole service (shards, placement group, coordinator); leaves nothing running."""
        was_closed = self._closed
        self._closed = True
        self._lease.stop()
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        stop_coordinator(self._coordinator, self.config.rpc_timeout_s, self.config)
        if self._owns_ray and ray.is_initialized() and not was_closed:
            ray.shutdown()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        if self._owns_service:
            self.shutdown()
        else:
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this client was closed or shut down: connect again with cpattn.connect()")


__all__ = ["Service", "Step", "start", "connect", "ShardLostError"]
