"""The shard actors of one service: their placement group, handles by rank, and liveness.

The coordinator owns what the shards hold (sequences, pages); this owns the actors themselves:
placing them one bundle per shard, ranking them by where they landed, pinging them, and starting
a replacement in a lost shard's bundle.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cpattn.cluster.messages import ShardInfo
from cpattn.cluster.placement import (ShardLocation, assign_ranks, placement_group_name, shard_actor_name,
                                      shard_bundles)
from cpattn.cluster.rpc import raise_remote_cause
from cpattn.cluster.shard import RemoteShard
from cpattn.config import ServiceConfig
from cpattn.errors import ServiceError

logger = logging.getLogger("cpattn.coordinator")

# Threads per shard actor beyond max_open_steps (each open step holds one): joins, leaves, fills, checksums.
SHARD_THREAD_HEADROOM = 16
# Pings, fencing and recovery copies run in their own threads: open steps can never starve them (issue 12).
CONTROL_GROUP = "control"
CONTROL_THREADS = 4


def probe_backend(config: ServiceConfig, backend_registry: dict | None) -> str:
    """Select the shards' backend (and prefill backend) as a shard would; raises BackendUnavailableError with
    ``.reasons``. Returns the decode backend's name."""
    from cpattn.attention import select_backend, select_prefill_backend
    from cpattn.attention.registry import apply_registry_state

    if backend_registry:
        apply_registry_state(backend_registry)
    backend = select_backend(config)
    select_prefill_backend(config, backend)
    return backend.get_name()


def creation_error(exc: BaseException) -> str:
    """What a shard's __init__ raised, without Ray's remote frames and colour codes: the cpattn error and its
    indented detail lines (a BackendUnavailableError's reasons), else the error's last line."""
    import re

    lines = [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        match = re.match(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)", lines[i])
        if match:
            tail = [line for line in lines[i + 1:] if line.startswith("  ") and line.strip()]
            return "\n".join([f"{match.group(1)}: {match.group(2)}", *tail])
    nonempty = [line for line in lines if line.strip()]
    return nonempty[-1] if nonempty else type(exc).__name__


class ShardSet:
    def __init__(self, config: ServiceConfig, backend_registry: dict | None = None, secret: str | None = None,
                 operator_digest: str | None = None):
        self.config = config
        self.secret = secret                        # handed to every shard: proves calls come from the coordinator
        self.operator_digest = operator_digest      # lets the operator read checksums and group names
        self._backend_registry = backend_registry   # plugin backends, replayed in every shard process
        self.handles: list = []                     # actor handles, index = rank (None while missing)
        self.infos: list[ShardInfo] = []            # what each shard reported (node, device, backend ...)
        self.lost: dict[int, str] = {}              # rank -> why, until replaced
        self._silent_since: dict[int, float] = {}   # rank -> when its first unanswered ping was sent
        self._pg = None
        self._lock = threading.Lock()

    def check_backend(self) -> None:
        """Before anything is placed: an explicit backend that cannot serve here raises BackendUnavailableError
        with every reason (what select_backend says), instead of shards dying in their constructors.

        CPU shards are checked in this process. GPU shards are checked by a probe task in the first bundle
        once the placement group is ready (``probe_backend_in_bundle``), since this process may have no GPU.
        """
        if self.config.resolved_device() == "cpu":
            probe_backend(self.config, self._backend_registry)

    def _probe_backend_in_bundle(self) -> None:
        cfg = self.config
        if cfg.resolved_device() == "cpu" or (cfg.backend == "auto" and cfg.prefill_backend in ("same", "auto")):
            return   # nothing explicit to probe: auto and same fail, if at all, in the shards themselves
        probe = ray.remote(probe_backend).options(
            num_cpus=0, num_gpus=cfg.num_gpus_per_shard,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0))
        try:
            ray.get(probe.remote(cfg, self._backend_registry), timeout=cfg.start_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise_remote_cause(exc)
            raise

    def start(self) -> None:
        """Place and start the shards, ranked by node then GPU; on any failure remove what was started."""
        cfg = self.config
        self.check_backend()
        try:
            bundles = shard_bundles(cfg.num_shards, cfg.num_cpus_per_shard, cfg.num_gpus_per_shard, cfg.shard_resources)
            labels = {"bundle_label_selector": [dict(cfg.shard_label_selector)] * cfg.num_shards} \
                if cfg.shard_label_selector else {}
            self._pg = placement_group(bundles, strategy=cfg.placement_strategy, name=placement_group_name(cfg.name),
                                       lifetime="detached" if cfg.detached else None, **labels)
            try:
                ray.get(self._pg.ready(), timeout=cfg.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                steer = "".join(f", {name} {getattr(cfg, name)}" for name in ("shard_resources", "shard_label_selector")
                                if getattr(cfg, name))
                raise ServiceError(
                    f"could not place {cfg.num_shards} shards ({cfg.num_cpus_per_shard} CPU, {cfg.num_gpus_per_shard} GPU "
                    f"each, {cfg.placement_strategy}{steer}) within {cfg.start_timeout_s}s: the cluster lacks the "
                    "resources (or nodes with those resources/labels); lower num_shards / per-shard resources or add "
                    "nodes") from None
            self._probe_backend_in_bundle()
            handles = [self._new_shard(i) for i in range(cfg.num_shards)]
            self.handles = handles
            try:
                infos = ray.get([h.info.remote(self.secret) for h in handles], timeout=cfg.start_timeout_s)
            except ray.exceptions.RayTaskError as exc:
                raise_remote_cause(exc)
                raise ServiceError(f"a shard failed to start: {exc}") from exc
            except ray.exceptions.RayActorError as exc:
                raise ServiceError(f"a shard failed to start: {creation_error(exc)}") from exc
            except ray.exceptions.GetTimeoutError:   # (was a raw RayTaskError(GetTimeoutError) with a traceback)
                raise ServiceError(f"the shards did not start within start_timeout_s={cfg.start_timeout_s:g}s"
                                   f"{_starting_gpu_note(cfg)}: raise start_timeout_s, or see what they wait for in "
                                   "`ray status` and the shards' logs") from None
            ranks = assign_ranks([ShardLocation(i.bundle_index, i.node_ip, i.node_id, tuple(i.gpu_ids)) for i in infos])
            by_rank = sorted(range(len(handles)), key=lambda i: ranks[i])
            self.handles = [handles[i] for i in by_rank]
            self.infos = [infos[i].with_rank(r) for r, i in enumerate(by_rank)]
        except BaseException:
            self.teardown()
            raise

    def attach(self, bundles: list[int]) -> None:
        """After a coordinator restart: find the detached, named shards again (rank r in bundle bundles[r])."""
        cfg = self.config
        self._pg = ray.util.get_placement_group(placement_group_name(cfg.name))
        self.handles, self.infos = [], []
        for rank, bundle in enumerate(bundles):
            handle, info = None, ShardInfo(bundle_index=bundle, rank=rank)
            try:
                handle = ray.get_actor(shard_actor_name(cfg.name, bundle), namespace=cfg.namespace)
                info = ray.get(handle.info.remote(self.secret), timeout=cfg.rpc_timeout_s).with_rank(rank)
                if not info.ready:
                    self.lost[rank] = "a replacement whose refill had not finished when the coordinator restarted"
            except Exception as exc:   # gone while the coordinator was down: the health check replaces it
                self.lost[rank] = f"missing after coordinator restart ({type(exc).__name__})"
            self.handles.append(handle)
            self.infos.append(info)

    @property
    def bundles(self) -> list[int]:
        return [i.bundle_index for i in self.infos]

    def _new_shard(self, bundle_index: int, ready: bool = True):
        cfg = self.config
        options = {}
        if cfg.detached:
            # Detached and named: the shards (and their KV) outlive a coordinator restart.
            options = {"name": shard_actor_name(cfg.name, bundle_index), "namespace": cfg.namespace,
                       "lifetime": "detached"}
        # Custom resources are the bundle's too: an actor in a bundle must ask for what it uses of it.
        if cfg.shard_resources:
            options["resources"] = dict(cfg.shard_resources)
        return ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_THREADS})(RemoteShard).options(
            num_cpus=cfg.num_cpus_per_shard, num_gpus=cfg.num_gpus_per_shard, max_concurrency=cfg.max_open_steps + SHARD_THREAD_HEADROOM,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle_index),
            **options).remote(cfg, bundle_index, self._backend_registry, self.secret, ready, self.operator_digest)

    def check(self, timeout_s: float) -> dict[int, str]:
        """Ping every shard; a dead one, or one silent for shard_hang_timeout_s, is recorded as lost.
        Returns rank -> why for the lost.

        Silence is a ping unanswered within ``timeout_s`` or a lost connection (ActorUnavailableError: a
        network partition, a reset connection); it is timed from the first unanswered ping, so a short
        check (end_step's) never declares a shard lost that the link may still bring back.
        An answer counts only for the shard it asked: one replaced while its ping was out (checks run on the
        health thread, on end_step's and on a recovery's) is the new shard's rank, and the old one's death is
        not the new one's (it was replaced again, once per concurrent check: chaos test, CI 2026-12-01).
        """
        pinged = list(self.handles)
        refs = [None if h is None else h.ping.options(concurrency_group=CONTROL_GROUP).remote(self.secret)
                for h in pinged]
        sent = time.monotonic()
        deadline = sent + timeout_s
        for rank, ref in enumerate(refs):
            if rank in self.lost or ref is None:
                continue
            try:
                ok = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                why = None if ok else "stopped answering (hung)"
                with self._lock:
                    if self.handles[rank] is pinged[rank]:
                        self._silent_since.pop(rank, None)
            except ray.exceptions.GetTimeoutError:
                why = self._silent(rank, sent, "did not answer pings", pinged[rank])
            except ray.exceptions.ActorUnavailableError:
                why = self._silent(rank, sent, "was unreachable (ActorUnavailableError: network partition?)",
                                   pinged[rank])
            except ray.exceptions.RayActorError as exc:
                why = f"died ({type(exc).__name__})"
            if why is not None:
                with self._lock:
                    if self.handles[rank] is not pinged[rank]:   # replaced meanwhile: the new one was not asked
                        continue
                    self.lost[rank] = why
                logger.error("shard %d lost: %s", rank, why)
        return dict(self.lost)

    def _silent(self, rank: int, sent: float, what: str, pinged) -> str | None:
        """Why shard ``rank`` is lost once silent for shard_hang_timeout_s (since its first unanswered ping);
        None while it may still answer, or when ``pinged`` (the handle asked) is no longer the rank's shard."""
        # The earliest unanswered ping counts: the health thread's long ping may time out after a later, shorter
        # one (end_step's) recorded its own send time.
        with self._lock:
            if self.handles[rank] is not pinged:
                return None
            since = self._silent_since[rank] = min(self._silent_since.get(rank, sent), sent)
        silent_s = time.monotonic() - since
        if silent_s < self.config.shard_hang_timeout_s:
            return None
        return f"{what} for {silent_s:.1f}s (shard_hang_timeout_s={self.config.shard_hang_timeout_s:g})"

    def start_replacement(self, rank: int):
        """Kill the lost shard and start a new one in its bundle; returns (handle, info), not yet installed.

        When a node died, Ray may first place the new actor on that node (not yet known dead) and then
        move the bundle: keep trying until start_timeout_s.
        """
        old = self.handles[rank]
        try:
            if old is not None:
                ray.kill(old, no_restart=True)   # a hung shard must not come back half-alive
        except Exception:
            pass
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            new = self._new_shard(self.infos[rank].bundle_index, ready=False)   # ready once refilled
            try:
                return new, ray.get(new.info.remote(self.secret),
                                    timeout=max(1.0, deadline - time.monotonic())).with_rank(rank)
            except ray.exceptions.GetTimeoutError:
                # Its node is unreachable (partition) or full: do not leave it to start later and hold the bundle.
                ray.kill(new, no_restart=True)
                raise ServiceError(f"shard {rank}'s replacement did not start within start_timeout_s="
                                   f"{self.config.start_timeout_s:g}s (its node unreachable or out of resources); "
                                   "the health check tries again") from None
            except ray.exceptions.RayActorError as exc:
                if time.monotonic() > deadline:
                    raise ServiceError(f"shard {rank}'s replacement kept dying on start ({creation_error(exc)}); "
                                       "the health check tries again") from exc
                time.sleep(1.0)

    @property
    def silent(self) -> dict[int, float]:
        """rank -> seconds since its first unanswered ping, for shards silent but not (yet) lost."""
        now = time.monotonic()
        return {r: now - t for r, t in dict(self._silent_since).items() if r not in self.lost}

    def install(self, rank: int, handle, info: ShardInfo) -> None:
        """Make a started replacement the shard of ``rank``."""
        with self._lock:
            self.handles[rank] = handle
            self.infos[rank] = info
            self.lost.pop(rank, None)
            self._silent_since.pop(rank, None)

    def drop_client(self, handles: list, client_id: str, ended_at: float) -> None:
        """Every shard closes the client's data-plane groups and voids its tickets issued before ``ended_at``."""
        refs = [h.drop_client.remote(self.secret, client_id, ended_at) for h in handles]
        try:
            ray.get(refs, timeout=self.config.rpc_timeout_s)
        except Exception as exc:   # a lost shard's groups went with it
            logger.warning("dropping client %s's groups: %s", client_id, exc)

    def teardown(self) -> None:
        for h in self.handles:
            try:
                if h is not None:
                    ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.handles = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None


def _starting_gpu_note(cfg: ServiceConfig) -> str:
    if cfg.num_gpus_per_shard <= 0:
        return ""
    return (" (a GPU shard compiles its kernels while it starts, cluster/kernel_warmup.py: FlashInfer's JIT takes about a "
            "minute per prefill variant on a node that never ran it)")
