"""The client's data-plane group: join it (the shards on this GPU opened by CUDA IPC, one group with the
remote shards, rank 0 this client), leave it, and rejoin after a shard was replaced or a collective failed.

A group is named after the client, its epoch and a generation (``group_name``), so a rejoin never meets
its predecessor's messages; the coordinator's ticket proves each join to the shards.
"""

from __future__ import annotations

import logging
import time

import ray

from cpattn.attention import select_backend, select_prefill_backend
from cpattn.cluster.client_device import _gpu_uuid, choose_data_plane, open_shared_cache
from cpattn.cluster.client_graphs import ClientLayerGraphs
from cpattn.cluster.data_plane import DataPlane, create_group
from cpattn.cluster.kernel_warmup import warm_up_kernels
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.messages import ShardInfo
from cpattn.cluster.netbind import bind_address
from cpattn.cluster.netstore import make_bound_store
from cpattn.cluster.rpc import call
from cpattn.errors import CpattnError, DataPlaneError, ServiceError

logger = logging.getLogger("cpattn")

# Joins tried in a row when shards die while the group forms (each death is replaced first, as between steps).
MAX_JOINS = 4


class GroupMembership:
    """The Gateway's methods on its data-plane group (a mixin: they use its coordinator handle, credential, config,
    device, shards and page cache)."""

    @property
    def group_name(self) -> str:
        """Unique per (re)join: the client, its epoch, its generation."""
        return f"{self.client_id}-e{self.epoch}-g{self._generation}"

    def join(self) -> None:
        """(Re)build: open the local shards' caches, then one group with the remote shards (rank 0 is us)."""
        cfg = self.config
        current = call(self.coordinator.get_shards.remote(self.credential), cfg.rpc_timeout_s, "get_shards")
        self.epoch, self.shards, infos = current.epoch, current.shards, current.infos
        self._generation += 1   # a fresh group name on every (re)join
        self.plane_broken = False
        self.pages.clear()      # a new epoch may have refilled shards: whole block tables again
        self._ticket = call(self.coordinator.group_ticket.remote(self.credential, self.group_name),
                            cfg.rpc_timeout_s, "group_ticket")   # proves this client's joins to the shards
        local_ranks = self._local_ranks(infos)
        self.local, self.local_graphs = {}, {}
        for rank in local_ranks:
            handles = call(self.shards[rank].export_kv.remote(self.group_name, self._ticket), cfg.rpc_timeout_s,
                           "export_kv")
            backend = select_backend(cfg, self.device, backend=infos[rank].backend)   # the shard's choices
            prefill = select_prefill_backend(cfg, backend, self.device, prefill_backend=infos[rank].prefill_backend)
            try:
                # Every layer's cache, then (fp8) every layer's page scales: pages belong to one sequence, so this
                # client growing its pages' scales never touches another client's (cpattn/kvstore/fp8.py).
                shared = [open_shared_cache(h, self.device) for h in handles]
                caches, scales = shared[:cfg.num_layers], shared[cfg.num_layers:] or None
            except RuntimeError as exc:
                raise ServiceError(f"could not open shard {rank}'s KV cache on {self.device} by CUDA IPC ({exc}): "
                                   "run the client where the shard's GPU is visible, or set local_shards='off' "
                                   "to reach every shard over the data plane") from exc
            warm_up_kernels(cfg, backend, prefill, self.device, f"client {self.client_id}")   # once per process
            self.local[rank] = ShardLayerRunner(cfg, backend, caches, self.device, scales, prefill)
            self.local_graphs[rank] = self.local[rank].new_graphs()
        self.remote = [r for r in range(cfg.num_shards) if r not in self.local]
        self.plane = None
        if self.remote:
            backend = choose_data_plane(cfg, self.device, [infos[r] for r in self.remote])
            world = len(self.remote) + 1
            # The store and this rank's device on the node IP (or data_plane_interface's address), never on
            # whatever the hostname resolves to (netbind).
            host, interface = bind_address(ray.util.get_node_ip_address(), cfg.data_plane_interface)
            store = make_bound_store(host, world, cfg.collective_timeout_s)   # listens on that address only
            joins = [self.shards[r].join_group.remote(self.group_name, host, store.port, i + 1, world, backend,
                                                      self._ticket)
                     for i, r in enumerate(self.remote)]
            try:
                group = create_group(store, self.group_name, 0, world, backend, cfg.collective_timeout_s,
                                     bind_ip=host, interface=interface,
                                     explicit_interface=bool(cfg.data_plane_interface))
            except CpattnError as exc:
                died = self._collect_failed_joins(joins)
                if died is not None:   # not the network: a shard died while the group formed
                    raise DataPlaneError(f"{exc} (a shard died while the group formed: {died})") from died
                raise
            call(joins, cfg.rpc_timeout_s, "shards joining the data plane")
            self._store = store   # the store must outlive the group
            self.plane = DataPlane(group, 0, world, backend)
        self.client_graphs = ClientLayerGraphs(self) if ClientLayerGraphs.supported(self) else None
        logger.info("cpattn client %s: %d local shard(s) on %s, %d over %s", self.client_id, len(self.local),
                    self.device, len(self.remote), self.plane.backend if self.plane else "no wire")

    def _local_ranks(self, infos: list[ShardInfo]) -> list[int]:
        # A detached service's coordinator can restart mid-step; shards fence the old incarnation's writes,
        # but writes this process makes into a shard's cache bypass that fence, so they stay off there.
        if self.config.in_process_refusal() is not None or self.device.type != "cuda":
            return []
        node = ray.get_runtime_context().get_node_id()
        mine = _gpu_uuid(self.device)
        return [r for r, i in enumerate(infos) if i.gpu_uuid == mine and i.node_id == node]

    def leave(self) -> None:
        old, ticket = self.group_name, self._ticket
        for graph in list(self.user_graphs):   # the caller's graphs read this group's buffers and NCCL work too
            graph.release()
        if self.client_graphs is not None:   # graphs holding NCCL work go before their communicator (else abort hangs)
            self.client_graphs.release()
            self.client_graphs = None
        if self.plane is not None:
            self.plane.close()
            self.plane = None
        for r in self.remote:
            try:
                self.shards[r].leave_group.remote(old, ticket)
            except Exception:
                pass
        self.local, self.local_graphs = {}, {}   # drops the IPC mappings (and graphs reading them)
        self.client_graphs = None

    def _collect_failed_joins(self, joins: list) -> ray.exceptions.RayActorError | None:
        """After our side of a join failed: the shards' joins fail too, within their own deadline. Collects them
        (unread errors get logged by Ray as unhandled); returns a dead shard's error, if one died meanwhile."""
        ready, _ = ray.wait(joins, num_returns=len(joins), timeout=self.config.collective_timeout_s)
        died = None
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                died = exc
            except Exception:   # the same failure as ours, seen from that shard
                pass
        return died

    def rejoin(self) -> None:
        """After a shard was replaced or a collective failed: drop the group and the mappings, join again.

        A shard can die while the new group forms (its join never connects): that is one more shard loss, which
        the coordinator's health check replaces; wait for its next epoch and join that (MAX_JOINS in all)."""
        for attempt in range(1, MAX_JOINS + 1):
            self.leave()
            try:
                self.join()
                return
            except ServiceError as exc:
                if attempt == MAX_JOINS or not isinstance(exc.__cause__, ray.exceptions.RayActorError):
                    raise
                logger.warning("cpattn client %s: rejoining epoch %d failed (%s); waiting for the shard's "
                               "replacement", self.client_id, self.epoch, exc)
                self._await_epoch_after(self.epoch, exc)

    def _await_epoch_after(self, epoch: int, failure: ServiceError) -> None:
        """Until the coordinator has replaced the dead shard (its epoch moved past ``epoch``); bounded by the time
        a health check and a shard start may take."""
        cfg = self.config
        limit_s = cfg.health_check_interval_s + cfg.start_timeout_s + cfg.rpc_timeout_s
        deadline = time.monotonic() + limit_s
        while call(self.coordinator.get_shards.remote(self.credential), cfg.rpc_timeout_s,
                   "get_shards").epoch == epoch:
            if time.monotonic() > deadline:
                raise ServiceError(f"a shard died while this client rejoined and the service did not replace it "
                                   f"within {limit_s:.0f}s: check `cpattn status`") from failure
            time.sleep(min(0.1, cfg.health_check_interval_s))
