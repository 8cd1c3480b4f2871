"""The client's side of the service: coordinator handle, data-plane group, local shards, epoch, rejoin.

Legend: T tokens of a step, Q query heads, K kv heads, D head size, N partials.
Per layer the gateway (rank 0 of its group) broadcasts q|k|v to the *remote* shards, computes the
share of every *local* shard itself, receives each remote shard's computed rows and merges on its
own device. A shard is local when it lives on this process's GPU: the client opens that shard's
KV cache once per connection by CUDA IPC and runs the shard's kernels in its own process, because
two processes taking turns on one GPU pay a context switch each way (~320 us per round trip on an
H200) and NCCL cannot put two ranks on one GPU. Remote shards talk NCCL when every rank has a GPU
of its own, gloo otherwise (CPU, or remote shards sharing a GPU).

A step's commit is sent without waiting (``async_commit``): the coordinator's answer is collected
by the next call this client makes, so a steady decode loop pays one Ray round trip per step
(begin_step), not two.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from cpattn.attention import select_backend
from cpattn.attention.ops.merge import merge_rows
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, WireError, create_group, partial_tag
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.lease import LeaseKeeper
from cpattn.cluster.messages import ShardInfo
from cpattn.cluster.netbind import bind_address
from cpattn.cluster.netstore import make_bound_store
from cpattn.cluster.page_delta import PageCache
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner, lse_wire_dtype
from cpattn.cluster.rpc import call, call_across_restart
from cpattn.config import ServiceConfig
from cpattn.errors import ConfigError, CpattnError, InvalidRequestError, ServiceError

logger = logging.getLogger("cpattn")


@dataclass
class StepWire:
    """What one open step needs per layer: local plans and the rows each remote rank returns."""

    step_id: int
    num_tokens: int
    local: dict[int, PlannedStep]
    remote_rows: dict[int, torch.Tensor | None]
    """rank -> (R,) int64 rows on the gateway's device (None = all T); ranks with no rows are absent."""
    norms: torch.Tensor | None = None
    """(L,) float32 on a CUDA gateway with nan_policy 'reject': max |q|k|v| of each attended layer, NaN or
    inf when they held one; read once, at the end of the step (a read per layer would stall the GPU)."""
    broken: list[torch.Tensor] = field(default_factory=list)
    """Per received partial: a 0-dim bool, True if it did not arrive whole (read once, at the end)."""

    def saw_nonfinite(self) -> bool:
        return self.norms is not None and not bool(torch.isfinite(self.norms).all())


@dataclass
class PendingCommit:
    """A committed step whose coordinator answer has not been read yet."""

    step_id: int
    request: dict[str, int]
    replay: list[tuple[int, torch.Tensor, torch.Tensor | None]] | None
    """(layer, q|k|v, sinks) of every attended layer (kv_replicas=2)."""
    timings: dict[str, float]
    """The Step's own timings dict: completed in place when the answer is read."""
    ref: Any


def client_device(config: ServiceConfig) -> torch.device:
    """The GPU this process computes on (its current device) when the shards are on CUDA, else the CPU."""
    if config.resolved_device() == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_data_plane(config: ServiceConfig, device: torch.device, remote_infos: list[ShardInfo]) -> str:
    """nccl when the gateway and every remote shard each have a GPU of their own; gloo otherwise."""
    gpus = [_gpu_uuid(device)] + [i.gpu_uuid for i in remote_infos]
    nccl_ok = device.type == "cuda" and None not in gpus and len(set(gpus)) == len(gpus)
    if config.data_plane == "nccl" and not nccl_ok:
        raise ConfigError("data_plane 'nccl' needs the client and every shard it reaches over the wire on a GPU "
                          "of its own (NCCL cannot have two ranks on one GPU): use data_plane 'auto'")
    if config.data_plane == "gloo":
        return "gloo"
    return "nccl" if nccl_ok else "gloo"


def _gpu_uuid(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def open_shared_cache(handle_args: tuple, device: torch.device) -> torch.Tensor:
    """A shard's exported KV cache, opened on this process's index of the same physical GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle_args)
    args[6] = device.index   # the shard numbered its GPU 0 (Ray narrows its visible devices)
    return rebuild_cuda_tensor(*args)


class Gateway:
    """One client's side of the service. Its ``client_id`` is public (group names, stats); its ``credential``
    is the secret every coordinator call proves; a LeaseKeeper thread keeps the client alive between calls."""

    def __init__(self, coordinator, config: ServiceConfig, on_lapse: str = "free", credential: str | None = None,
                 registered: dict | None = None):
        self.coordinator = coordinator
        self.config = config
        self.device = client_device(config)
        self.plane: DataPlane | None = None
        self.plane_broken = False      # a collective failed: rebuild the group before the next step
        self.local: dict[int, ShardLayerRunner] = {}
        self.local_graphs: dict[int, DecodeGraphs | None] = {}
        self.pages = PageCache()   # pages of this client's sequences on its in-process shards
        self.remote: list[int] = []
        self.shards: list = []
        self.pending: PendingCommit | None = None
        self.open_step = None
        self.last_step_timings: dict[str, float] = {}
        self._guard = threading.Lock()
        self._store = None
        self._generation = 0
        self._ticket: str | None = None
        if registered is None:   # connect() registers first: only a client may read the service's config
            registered = call(coordinator.register_client.remote(on_lapse, credential), config.rpc_timeout_s,
                              "register_client")
        self.client_id: str = registered["client_id"]
        self.credential: str = registered["credential"]
        self.lease = LeaseKeeper(coordinator, self.credential, config.client_lease_s)
        self.lease.start()
        try:
            self.join()
        except BaseException:
            self.lease.stop()   # the lease lapses and the coordinator reclaims this half-made client
            raise

    @property
    def group_name(self) -> str:
        return f"{self.client_id}-e{self.epoch}-g{self._generation}"

    # Coordinator calls ---------------------------------------------------------------------------
    def call(self, method: str, *args, timeout_s: float | None = None):
        """A coordinator call proving this client's credential, after its previous commit was confirmed."""
        self.flush()
        return call(getattr(self.coordinator, method).remote(self.credential, *args),
                    timeout_s or self.config.rpc_timeout_s, method)

    def end_step(self, step_id: int, commit: bool, why: str | None) -> dict:
        """end_step, asked again across a detached coordinator's restart (it knows from its journal whether
        the step committed, else raises StepFencedError: run the step again)."""
        cfg = self.config
        return call_across_restart(lambda: self.coordinator.end_step.remote(step_id, commit, why, self.credential),
                                   cfg.rpc_timeout_s + cfg.start_timeout_s, "end_step",
                                   cfg.rpc_timeout_s if cfg.detached else 0.0)

    def end_step_async(self, step_id: int):
        return self.coordinator.end_step.remote(step_id, True, None, self.credential)

    def defer_commit(self, step_id: int, request: dict[str, int], replay, timings: dict[str, float]) -> None:
        """Send a step's commit without waiting for the answer; the next flush() reads it."""
        self.pending = PendingCommit(step_id, request, replay, timings, self.end_step_async(step_id))

    def flush(self) -> None:
        """Read the answer to a commit sent without waiting; replay or report a step that failed after all."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        from cpattn.step import finish_deferred_commit

        finish_deferred_commit(self, pending)

    # Data plane ----------------------------------------------------------------------------------
    def join(self) -> None:
        """(Re)build: open the local shards' caches, then one group with the remote shards (rank 0 is us)."""
        cfg = self.config
        current = call(self.coordinator.get_shards.remote(self.credential), cfg.rpc_timeout_s, "get_shards")
        self.epoch, self.shards, infos = current["epoch"], current["shards"], current["infos"]
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
            backend = select_backend(cfg, self.device, backend=infos[rank].backend)
            try:
                caches = [open_shared_cache(h, self.device) for h in handles]
            except RuntimeError as exc:
                raise ServiceError(f"could not open shard {rank}'s KV cache on {self.device} by CUDA IPC ({exc}): "
                                   "run the client where the shard's GPU is visible, or set local_shards='off' "
                                   "to reach every shard over the data plane") from exc
            self.local[rank] = ShardLayerRunner(cfg, backend, caches, self.device)
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
            except CpattnError:
                # The shards' joins fail as ours did, within their own deadline: collect them (unread errors get
                # logged by Ray as unhandled) and report ours, which names the addresses.
                ready, _ = ray.wait(joins, num_returns=len(joins), timeout=cfg.collective_timeout_s)
                for ref in ready:
                    try:
                        ray.get(ref, timeout=0)
                    except Exception:   # the same failure, seen from that shard
                        pass
                raise
            call(joins, cfg.rpc_timeout_s, "shards joining the data plane")
            self._store = store   # the store must outlive the group
            self.plane = DataPlane(group, 0, world, backend)
        logger.info("cpattn client %s: %d local shard(s) on %s, %d over %s", self.client_id, len(self.local),
                    self.device, len(self.remote), self.plane.backend if self.plane else "no wire")

    def _local_ranks(self, infos: list[ShardInfo]) -> list[int]:
        # A detached service's coordinator can restart mid-step; shards fence the old incarnation's writes,
        # but writes this process makes into a shard's cache bypass that fence, so they stay off there.
        if self.config.local_shards == "off" or self.device.type != "cuda" or self.config.detached:
            return []
        if self.config.kv_cache_dtype != "auto":
            return []   # fp8 scales live (and grow) in the shard's process; not shared by IPC yet

        node = ray.get_runtime_context().get_node_id()
        mine = _gpu_uuid(self.device)
        return [r for r, i in enumerate(infos) if i.gpu_uuid == mine and i.node_id == node]

    def leave(self) -> None:
        old, ticket = self.group_name, self._ticket
        if self.plane is not None:
            self.plane.close()
            self.plane = None
        for r in self.remote:
            try:
                self.shards[r].leave_group.remote(old, ticket)
            except Exception:
                pass
        self.local, self.local_graphs = {}, {}   # drops the IPC mappings (and graphs reading them)

    def rejoin(self) -> None:
        """After a shard was replaced or a collective failed: drop the group and the mappings, join again."""
        self.leave()
        self.join()

    # One step ------------------------------------------------------------------------------------
    def claim(self, step) -> None:
        """One open step per client, atomically: a second thread or a nested step is rejected."""
        with self._guard:
            self.check_no_open_step()
            self.open_step = step

    def check_no_open_step(self) -> None:
        if self.open_step is not None:
            raise InvalidRequestError("a step is already open on this client: finish it first; a client serves one "
                                      "thread and one step at a time (use a second client for concurrent steps)")

    def release(self, step) -> None:
        with self._guard:
            if self.open_step is step:
                self.open_step = None

    def committed(self, timings: dict[str, float], report: dict) -> None:
        """Completes a committed step's timings (the Step's own dict, in place) with what the shards reported."""
        timings["plan_s"] += report.get("shard_plan_s", 0.0)
        timings["attention_s"] = report.get("attention_s", 0.0)
        self.last_step_timings = dict(timings)

    def wait_for_device(self, wire: StepWire) -> None:
        """Before a commit: the step's GPU work (KV writes included) is done and every partial arrived whole.

        Bounded by collective_timeout_s: a dead NCCL peer leaves our stream waiting, never the caller;
        then the group is aborted (releasing the stream) and WireError raised.
        """
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            deadline = time.monotonic() + self.config.collective_timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    if self.plane is not None:
                        self.plane.abort()
                    raise WireError(f"step {wire.step_id}: the data plane did not finish within collective_timeout_s="
                                    f"{self.config.collective_timeout_s}s (a shard died or hung)")
                time.sleep(0)
        if wire.broken and bool(torch.stack(wire.broken).any()):
            raise WireError(f"step {wire.step_id}: a shard's partial did not arrive whole (the shard died or its "
                            "collective was aborted)")

    def begin(self, request: dict[str, int]) -> dict | None:
        """Plan a step; None when the service moved to a new epoch (rejoin, then begin again)."""
        cfg = self.config
        if self.plane_broken:
            self.rejoin()
        held = self.pages.held(list(request), sorted(self.local)) if self.local else None
        info = self.call("begin_step", self.group_name, request, self.epoch, sorted(self.local), held,
                         timeout_s=cfg.rpc_timeout_s + cfg.start_timeout_s)
        if "rejoin" in info:
            return None
        for r, p in info["local_plans"].items():   # block tables came as deltas (cluster/page_delta.py)
            p.metadata.block_table_tensor = self.pages.apply(r, info["seq_ids"], info["local_pages"][r])
        local = {r: self.local[r].plan(p, self.local_graphs.get(r)) for r, p in info["local_plans"].items()}
        remote_rows = {r: (None if rows is None else rows.to(self.device))
                       for r, rows in info["remote_rows"].items()}
        norms = None
        if self.device.type == "cuda" and cfg.nan_policy == "reject":
            norms = torch.zeros(cfg.num_layers, dtype=torch.float32, device=self.device)
        info["wire"] = StepWire(info["step_id"], info["num_tokens"], local, remote_rows, norms)
        return info

    def attend(self, wire: StepWire, command: int, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor,
               v_TKD: torch.Tensor, sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
        """One layer: broadcast to remote shards, compute the local ones, merge every partial here.
        ``sinks_Q`` (learned sink logits per query head) enter once, after the merge (apply_sinks)."""
        cfg = self.config
        q, k, v = (x.to(self.device, non_blocking=True) for x in (q_TQD, k_TKD, v_TKD))
        if self.plane is not None or wire.norms is not None:
            packed = torch.cat([q, k, v], dim=1)
            if wire.norms is not None and command == CMD_ATTEND:
                torch.linalg.vector_norm(packed, math.inf, dtype=torch.float32, out=wire.norms[layer])
            if self.plane is not None:
                self.plane.send_layer(command, layer, wire.step_id, packed)
        parts = [(step.rows, *self.local[r].run_layer(step, layer, q, k, v)) for r, step in wire.local.items()]
        dtype, lse_dtype = cfg.torch_dtype, lse_wire_dtype(cfg.torch_dtype)
        for i, r in enumerate(self.remote):
            if r in wire.remote_rows:
                rows = wire.remote_rows[r]
                n = wire.num_tokens if rows is None else rows.numel()
                out, lse, broken = self.plane.recv_partial(i + 1, n, cfg.num_q_heads, cfg.head_size, dtype,
                                                           lse_dtype, self.device, partial_tag(wire.step_id, layer))
                wire.broken.append(broken)
                parts.append((rows, out, lse))
        if len(parts) == 1 and sinks_Q is None and any(s.graphs is not None for s in wire.local.values()):
            return parts[0][1].clone()   # the graph's buffer is overwritten when this layer replays
        return merge_rows(parts, wire.num_tokens, sinks_Q)

    def abort_wire(self, wire: StepWire, remaining: int) -> None:
        """Release the remote shards still waiting for this step's ``remaining`` layers (messages of a layer's size).

        gloo shards read each header, so one ABORT ends their step. NCCL shards enqueued every layer ahead
        (shard._serve_layers_ahead): each remaining layer gets its ABORT message, and the partials they
        compute from it are drained, so no operation is left waiting on either side.
        """
        if self.plane is None:
            return
        cfg = self.config
        unused = torch.zeros(wire.num_tokens, cfg.num_q_heads + 2 * cfg.num_kv_heads, cfg.head_size,
                             dtype=cfg.torch_dtype, device=self.device)
        if not self.runs_ahead:
            self.plane.send_layer(CMD_ABORT, -1, wire.step_id, unused)
            return
        for _ in range(remaining):
            self.plane.send_layer(CMD_ABORT, -1, wire.step_id, unused)
            for i, r in enumerate(self.remote):
                if r in wire.remote_rows:
                    rows = wire.remote_rows[r]
                    n = wire.num_tokens if rows is None else rows.numel()
                    self.plane.recv_partial(i + 1, n, cfg.num_q_heads, cfg.head_size, cfg.torch_dtype,
                                            lse_wire_dtype(cfg.torch_dtype), self.device, 0)

    @property
    def runs_ahead(self) -> bool:
        """Remote shards enqueue a step's layers ahead (NCCL): the step must attend layers in order."""
        return self.plane is not None and self.plane.backend == "nccl"

    def close(self) -> None:
        """End this client (its sequences stay); the service keeps running."""
        try:
            self.flush()
        except CpattnError as exc:
            logger.warning("closing client %s: %s", self.client_id, exc)
        self.lease.stop()
        self.leave()
        try:   # waited for, so what the client held is settled when close() returns
            call(self.coordinator.unregister_client.remote(self.credential), self.config.rpc_timeout_s,
                 "unregister_client")
        except CpattnError as exc:
            logger.warning("closing client %s: %s", self.client_id, exc)


__all__ = ["Gateway", "StepWire", "PendingCommit", "choose_data_plane", "client_device"]
