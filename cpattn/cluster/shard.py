"""Shard worker: owns one shard of every layer's paged KV and runs the attention backend on it.

A plain class; ``ray.remote`` is applied where the group is created, so it is testable without Ray.
Per step it receives one ShardStepPlan (metadata planned once, reused by every layer), then
serves layers from its data-plane group until the gateway says commit or abort.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch

from cpattn.attention import select_backend, write_kv_cache
from cpattn.attention.registry import apply_registry_state
from cpattn.cluster import authority
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.shard_graphs import ShardStepGraphs
from cpattn.cluster.data_plane import (CMD_ABORT, CMD_ATTEND, CMD_END, CMD_NEXT, DataPlane, connect_group,
                                       partial_tag)
from cpattn.cluster.fencing import StepFence
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner
from cpattn.cluster.messages import ShardInfo, ShardStepReport
from cpattn.cluster.netbind import bind_address
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import AccessDeniedError, CapacityError, CpattnError, ServiceError, StepFencedError
from cpattn.kvstore import copy_pages
from cpattn.kvstore.fp8 import PageScaleWrites, dequantize, fp8_dtype, initial_page_scales, is_fp8, page_scales_of, quantize

logger = logging.getLogger("cpattn.shard")


SYNTHETIC_CHUNK = 1 << 16
# Data-plane joins a shard runs at once: per client (a client joins one group at a time; two lets a rejoin
# overlap a join still timing out), and in all (half of shard_set.SHARD_THREAD_HEADROOM), so joins that never
# finish their handshake can never take the threads open steps need.
MAX_JOINS_PER_CLIENT = 2
MAX_JOINS_IN_FLIGHT = 8


def synthetic_kv(seed: int, layer: int, start: int, num_tokens: int, num_kv_heads: int, head_size: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, Hk, D] float32 of tokens [start, start + T) that fill_synthetic writes for one layer.

    Drawn in fixed chunks of SYNTHETIC_CHUNK tokens (each seeded by seed, layer, chunk), so every shard
    draws the same values on the same device kind, and memory stays bounded for million-token fills.
    """
    if start % SYNTHETIC_CHUNK:
        raise ValueError(f"start {start} must be a multiple of {SYNTHETIC_CHUNK}")
    parts = []
    for c in range(start, start + num_tokens, SYNTHETIC_CHUNK):
        n = min(SYNTHETIC_CHUNK, start + num_tokens - c)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer * 10_007 + c // SYNTHETIC_CHUNK)
        parts.append(torch.randn(2, n, num_kv_heads, head_size, generator=gen, device=device))
    kv = torch.cat(parts, dim=1)
    return kv[0], kv[1]


def _node_ip() -> str:
    """This node's IP as Ray knows it (loopback when used as a plain class, without a Ray worker)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class ShardWorker:
    def __init__(self, config: ServiceConfig, bundle_index: int, backend_registry: dict | None = None,
                 secret: str | None = None, ready: bool = True, operator_digest: str | None = None):
        self.config = config
        self._operator_digest = operator_digest   # the operator may read checksums and group names
        # A replacement is not ready until the coordinator refilled it; a restarted coordinator that finds an
        # unready one (its predecessor died mid-refill) replaces it again instead of serving a half-empty shard.
        self._ready = ready
        self._secret = secret   # the coordinator's: KV reads/writes, plans and group joins prove it (issue 12)
        if backend_registry:
            # Plugins registered by the process that started the service (register_backend) live there only.
            apply_registry_state(backend_registry)
        self.bundle_index = bundle_index
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(0)   # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(max(1, int(config.num_cpus_per_shard)))
        self.dtype = config.torch_dtype
        self.backend = select_backend(config, self.device)
        self.num_blocks = config.blocks_per_shard()
        shape = self.backend.get_kv_cache_shape(self.num_blocks, config.block_size, config.num_kv_heads,
                                                config.head_size)
        self.kv_format = config.kv_cache_format if is_fp8(config.kv_cache_format) else None
        self.cache_dtype = fp8_dtype(self.kv_format) if self.kv_format else self.dtype
        self.kv_caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
                          for _ in range(config.num_layers)]
        # fp8: [2, num_blocks, Hk] float32 page scales per layer (static from the config on every page, or
        # dynamic: 0 until a write into the page; cpattn/kvstore/fp8.py).
        self.kv_scales = None if self.kv_format is None else [
            initial_page_scales(self.num_blocks, config.num_kv_heads,
                                None if config.kv_scales is None else config.kv_scales[layer], self.device)
            for layer in range(config.num_layers)]
        self.runner = ShardLayerRunner(config, self.backend, self.kv_caches, self.device, self.kv_scales)
        self.kernel_block_size = self.runner.kernel_block_size
        self._groups: dict[str, DataPlane] = {}
        self._graphs: dict[str, DecodeGraphs | None] = {}   # per group: a client runs one step at a time
        self._step_graphs: dict[str, ShardStepGraphs] = {}   # per NCCL group: whole decode steps (shard_graphs)
        self._admitted: dict[str, float] = {}   # ticket -> when it expires (a ticket joins once)
        self._ended: dict[str, float] = {}      # client id -> when it ended (its older tickets are void)
        self._joining: dict[str, int] = {}      # client id -> joins whose handshake is still running
        self._lock = threading.Lock()
        self._hang = False
        self._fence = StepFence()   # coordinator fencing: steps of an older incarnation never write (fencing.py)
        logger.info("shard %d: backend %s (%s), %d blocks of %d tokens, kernel pages of %d, device %s",
                    bundle_index, self.backend.get_name(), self.backend.kernel_version(), self.num_blocks,
                    config.block_size, self.kernel_block_size, self.device)

    # Authority (the remote surface calls this before every method: cluster.authority) ----------------
    def authorize(self, rule: authority.Rule, proof, arguments: dict, method: str) -> None:
        if self._secret is None:
            return   # a plain worker in a unit test: no service, nothing to prove
        who = f"shard {self.bundle_index}"
        if rule.who == authority.TICKET:
            group_name = arguments.get("group_name")
            if authority.read_ticket(self._secret, group_name, proof) is None:
                raise authority.refuse(who, method, f"group {group_name!r} refused: no valid ticket (get one from "
                                                    "the coordinator with the client's credential)")
            return
        if rule.who == authority.PLAN:
            proof = getattr(proof, "auth", None)
        ok = authority.matches_secret(proof, self._secret) or (
            rule.who in (authority.SECRET_OR_OPERATOR, authority.TEST_HOOK)
            and authority.matches_digest(proof, self._operator_digest))
        if not ok:
            raise authority.refuse(who, method, "only the service's coordinator may call it" + (
                "" if rule.who in (authority.SECRET, authority.PLAN) else " (or the operator credential)"))
        if rule.who == authority.TEST_HOOK and not self.config.test_hooks:
            raise authority.refuse(who, method, "test hooks are off: only a service started with test_hooks=True "
                                                "(the test suite's) serves them")

    # Introspection --------------------------------------------------------------------------------
    def info(self, secret: str | None = None) -> ShardInfo:
        gpu_ids: tuple[str, ...] = ()
        node_id = socket.gethostname()
        node_ip = "127.0.0.1"
        try:
            import ray

            ctx = ray.get_runtime_context()
            node_id = ctx.get_node_id()
            node_ip = ray.util.get_node_ip_address()
            gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        except Exception:   # plain-class use in unit tests: no Ray worker context
            pass
        gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else None
        return ShardInfo(bundle_index=self.bundle_index, node_id=node_id, node_ip=node_ip, gpu_ids=gpu_ids,
                         gpu_uuid=gpu_uuid, pid=os.getpid(), device=str(self.device), backend=self.backend.get_name(),
                         kernel_version=self.backend.kernel_version(), lse_base=self.backend.lse_base.name,
                         num_blocks=self.num_blocks, kernel_block_size=self.kernel_block_size, ready=self._ready,
                         kv_cache_dtype=str(self.cache_dtype).removeprefix("torch."),
                         kv_bytes=sum(t.numel() * t.element_size() for t in self.kv_caches))

    def ping(self, secret: str | None = None) -> bool:
        return not self._hang

    def simulate_hang(self, secret: str | None = None, hang: bool = True) -> None:
        """Test hook: stop answering pings and data-plane traffic, as a wedged process would."""
        self._hang = hang

    def kv_checksum(self, secret: str | None = None) -> float:
        """Sum of |KV| over every layer, a cheap fingerprint for 'nothing changed' checks (an fp8 cache's real,
        dequantised values, so a replacement holding the same values under other scales sums the same)."""
        if self.kv_scales is None:
            return float(sum(t.double().abs().sum() for t in self.kv_caches))
        return float(sum(dequantize(t, s[:, :, None, :, None], torch.float64).abs().sum()
                         for t, s in zip(self.kv_caches, self.kv_scales)))

    def get_kv_scales(self, secret: str | None = None) -> list[list[list[float]]] | None:
        """fp8 caches: every layer's [2, Hk] largest page scale (a summary; read_block_scales has the pages')."""
        return None if self.kv_scales is None else [s.amax(dim=1).tolist() for s in self.kv_scales]

    def read_block_scales(self, block_ids: list[int], secret: str | None = None) -> torch.Tensor | None:
        """fp8 caches: the pages' scales [num_layers, 2, n, Hk] float32 on the CPU (None for other caches), so a
        copy made with read_blocks + write_blocks holds exactly the source's bytes and scales."""
        if self.kv_scales is None:
            return None
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return torch.stack([s.index_select(1, idx) for s in self.kv_scales]).cpu()

    def mark_ready(self, secret: str | None = None) -> None:
        """The coordinator finished refilling this replacement: it may serve now."""
        self._ready = True

    def export_kv(self, group_name: str, ticket: str | None = None) -> list[tuple]:
        """CUDA IPC handles of every layer's KV cache (and an fp8 cache's page scales), for a client on this GPU to
        open once per connection.

        Such a client computes this shard's share in its own process (no per-layer hand-over between
        two processes on one GPU, which costs a context switch each way); the caches stay owned here.
        Only non-detached services use it (gateway._local_ranks): writes made there bypass the fence. The
        caller proves it is a registered client (a group ticket); it then holds this whole shard's KV, which
        is why clients that must be isolated from each other run with local_shards='off' (README Security).
        """
        self._live_ticket(group_name, ticket)
        if self.device.type != "cuda":
            raise CpattnError(f"shard {self.bundle_index} keeps its KV on {self.device}: only CUDA caches can be shared")
        from torch.multiprocessing.reductions import reduce_tensor

        # fp8: the page scales too (after the caches), which the client grows as it writes its pages.
        return [reduce_tensor(t)[1] for t in self.kv_caches + (self.kv_scales or [])]

    def read_blocks(self, block_ids: list[int], secret: str | None = None) -> torch.Tensor:
        """KV pages [num_layers, 2, n, block_size, Hk, D] on the CPU (recovery and tests; never per layer).
        An fp8 cache's pages come back dequantised (float32 real values), so the receiver needs no scales."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.kv_scales is None:
            return torch.stack([t[:, idx] for t in self.kv_caches]).cpu()
        return torch.stack([dequantize(t[:, idx], s.index_select(1, idx)[:, :, None, :, None], torch.float32)
                            for t, s in zip(self.kv_caches, self.kv_scales)]).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, secret: str | None = None,
                     scales: torch.Tensor | None = None) -> None:
        """Pages [num_layers, 2, n, B, Hk, D] of real values into ``block_ids``. An fp8 cache takes the pages'
        ``scales`` (read_block_scales of the source: the copy is then exact, bytes and scales); without them
        dynamic scales are computed from the pages as if written afresh, static ones are the config's."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, t in enumerate(self.kv_caches):
            if self.kv_scales is None:
                t[:, idx] = data[layer].to(self.device, self.dtype)
                continue
            pages = data[layer].to(self.device, torch.float32)             # [2, n, B, Hk, D] real values
            scale = self.kv_scales[layer]
            if scales is not None:
                scale.index_copy_(1, idx, scales[layer].to(self.device, torch.float32))
            elif self.config.kv_scales is None:
                scale.index_copy_(1, idx, page_scales_of(pages, self.kv_format))
            t[:, idx] = quantize(pages, scale.index_select(1, idx)[:, :, None, :, None], t.dtype)

    def fill_synthetic(self, plan: ShardStepPlan, seed: int) -> int:
        """Write seeded random K/V for the plan's new tokens this shard owns (benchmarks, load tests).

        Every shard draws the same values (synthetic_kv on its device) and keeps its own tokens, so
        the sequence's logical KV is reproducible from ``seed``.
        """
        slots = plan.metadata.slot_mapping.to(self.device)
        replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(self.device)
        hk, d = self.config.num_kv_heads, self.config.head_size
        copies = None if plan.page_copies is None else plan.page_copies.to(self.device)
        for layer, cache in enumerate(self.kv_caches):
            if not self._fence.enter(plan.incarnation):
                raise StepFencedError(f"shard {self.bundle_index}: fill_synthetic of coordinator incarnation "
                                      f"{plan.incarnation} was fenced by a restarted coordinator: fill again")
            try:
                if copies is not None:
                    copy_pages(cache, copies)   # copy on write of a forked prefix's shared page
                for start in range(0, plan.num_tokens, SYNTHETIC_CHUNK):
                    n = min(SYNTHETIC_CHUNK, plan.num_tokens - start)
                    k, v = synthetic_kv(seed, layer, start, n, hk, d, self.device)
                    k, v = k.to(self.dtype), v.to(self.dtype)
                    scale = None
                    if self.kv_scales is not None:
                        scale = self.kv_scales[layer]
                        if self.config.kv_scales is None:
                            chunk = [a[start:start + n] for a in (plan.metadata.slot_mapping,
                                                                  plan.replica_slot_mapping) if a is not None]
                            PageScaleWrites(chunk, self.config.block_size, self.device).grow(
                                cache, scale, k, v, self.kv_format)
                    for chunk_slots in (slots, replica):
                        if chunk_slots is not None:
                            write_kv_cache(cache, k, v, chunk_slots[start:start + n], scale)
            finally:
                self._fence.leave()
        return int((slots >= 0).sum())

    # Coordinator fencing (issue 12) ----------------------------------------------------------------
    def fence(self, incarnation: int, timeout_s: float, secret: str | None = None) -> dict:
        """Called by a restarted coordinator before it hands out any page: steps of older incarnations
        write nothing more (see cluster/fencing.py). Returns once none of them is mid-write."""
        report = self._fence.raise_floor(incarnation, timeout_s)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # writes launched before the floor rose have landed
        logger.warning("shard %d fenced coordinator incarnations below %d (%d steps were mid-write)",
                       self.bundle_index, incarnation, report["waited_for"])
        return report

    def _refuse_fenced(self, plane: DataPlane, plan: ShardStepPlan, timings: dict | None = None) -> dict:
        """A step of a fenced incarnation: write nothing, and drop its group so the client's collective fails
        now (the client then learns from the coordinator that the step must be run again)."""
        with self._lock:
            names = [n for n, p in self._groups.items() if p is plane]
            for name in names:
                del self._groups[name]
        self._drop_graphs(names)
        plane.close()
        logger.warning("shard %d: step %d of coordinator incarnation %d refused (fenced at %d)", self.bundle_index,
                       plan.step_id, plan.incarnation, self._fence.floor)
        return dict(timings or {}, outcome="fenced",
                    error=f"step {plan.step_id} was fenced by a restarted coordinator")

    # Data plane -----------------------------------------------------------------------------------
    def _live_ticket(self, group_name: str, ticket: str | None) -> authority.Ticket | None:
        """Under the lock: a genuine ticket (the surface checked its HMAC) that has not expired and whose
        client has not ended since it was issued; raises AccessDeniedError otherwise."""
        if self._secret is None:
            return None
        t = authority.read_ticket(self._secret, group_name, ticket)
        now, ttl = time.time(), self.config.client_lease_s
        # Forget what can no longer matter: tickets older than ttl are refused as expired anyway.
        self._admitted = {k: exp for k, exp in self._admitted.items() if exp >= now}
        self._ended = {c: at for c, at in self._ended.items() if at >= now - 2 * ttl}
        if now > t.issued_at + ttl:
            raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: its ticket expired "
                                    f"(tickets last client_lease_s={ttl:g}s): get a new one")
        if t.issued_at <= self._ended.get(t.client_id, float("-inf")):
            raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: the ticket's client "
                                    "ended after it was issued: connect again")
        return t

    def join_group(self, group_name: str, host: str, port: int, rank: int, world_size: int, backend: str,
                   ticket: str | None = None) -> bool:
        """Join a client's data-plane group: one join per ticket, at most MAX_JOINS_PER_CLIENT (and
        MAX_JOINS_IN_FLIGHT overall) at once, and a handshake that does not finish within join_timeout_s
        gives its thread back (it goes on, bounded by collective_timeout_s, in a thread of its own)."""
        with self._lock:
            t = self._live_ticket(group_name, ticket)
            client = t.client_id if t is not None else group_name
            if ticket in self._admitted or group_name in self._groups:
                raise AccessDeniedError(f"shard {self.bundle_index}: group {group_name!r} refused: its ticket was "
                                        "already used (a ticket admits one join): rejoin under a new group name")
            if self._joining.get(client, 0) >= MAX_JOINS_PER_CLIENT or sum(self._joining.values()) >= MAX_JOINS_IN_FLIGHT:
                raise CapacityError(f"shard {self.bundle_index}: {self._joining.get(client, 0)} joins of this client "
                                    f"and {sum(self._joining.values())} in all are still in their handshake (at most "
                                    f"{MAX_JOINS_PER_CLIENT} per client, {MAX_JOINS_IN_FLIGHT} in all): finish or "
                                    "abandon those first, then retry", shard=self.bundle_index)
            if t is not None:
                self._admitted[ticket] = t.issued_at + self.config.client_lease_s
            self._joining[client] = self._joining.get(client, 0) + 1
        outcome: dict = {}
        done = threading.Event()
        cfg = self.config
        bind_ip, interface = bind_address(_node_ip(), cfg.data_plane_interface)

        def handshake() -> None:
            try:
                group = connect_group(host, port, group_name, rank, world_size, backend, cfg.collective_timeout_s,
                                      bind_ip=bind_ip, interface=interface,
                                      explicit_interface=bool(cfg.data_plane_interface))
                plane = DataPlane(group, rank, world_size, backend)
                with self._lock:
                    if outcome.get("abandoned"):
                        plane.close()   # the caller was told it failed: nobody will use this group
                    else:
                        self._groups[group_name] = plane
                        outcome["joined"] = True
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                with self._lock:
                    self._joining[client] -= 1
                    if not self._joining[client]:
                        del self._joining[client]
                done.set()

        threading.Thread(target=handshake, daemon=True, name=f"cpattn-join-{group_name}").start()
        done.wait(self.config.join_timeout_s)
        with self._lock:
            if not outcome.get("joined") and "error" not in outcome:
                outcome["abandoned"] = True
                raise ServiceError(f"shard {self.bundle_index}: group {group_name!r}: the handshake did not finish "
                                   f"within join_timeout_s={self.config.join_timeout_s:g}s: is the client's store "
                                   "reachable from the shards? join again")
        if "error" in outcome:
            raise outcome["error"]
        return True

    def drop_client(self, secret: str, client_id: str, ended_at: float | None = None) -> int:
        """Close every data-plane group of a client that ended (close() or a lapsed lease); returns how many.
        Its tickets issued up to ``ended_at`` (the coordinator's clock) are void from now on."""
        with self._lock:
            self._ended[client_id] = time.time() if ended_at is None else ended_at
            names = [n for n in self._groups if n.startswith(f"{client_id}-")]
            planes = [self._groups.pop(n) for n in names]
        self._drop_graphs(names)
        for plane in planes:
            plane.close()
        return len(planes)

    def group_names(self, secret: str | None = None) -> list[str]:
        with self._lock:
            return list(self._groups)

    def leave_group(self, group_name: str, ticket: str | None = None) -> None:
        """Leaving needs a genuine ticket of the group (checked by the surface), spent or expired or not."""
        with self._lock:
            plane = self._groups.pop(group_name, None)
        self._drop_graphs([group_name])
        if plane is not None:
            plane.close()

    def _drop_graphs(self, names: list[str]) -> None:
        """Forget the groups' graphs; step graphs captured NCCL work, so they go before the communicator does
        (destroying a communicator that captured graphs still hold hangs in its abort)."""
        with self._lock:
            dropped = [self._step_graphs.pop(n, None) for n in names]
            for name in names:
                self._graphs.pop(name, None)
        for step_graphs in dropped:
            if step_graphs is not None:
                step_graphs.release()

    def run_step(self, group_name: str, plan: ShardStepPlan, later: list[ShardStepPlan] | None = None
                 ) -> ShardStepReport:
        """Serve every layer of one step from the group; returns timings (seconds) and how it ended.

        ``later``: the next steps of a decode run (cluster/decode_run.py), each served after the client's run
        header says NEXT (planned before that header arrives, so its first layer starts at once); END stops.
        """
        plane = self._groups.get(group_name)
        if plane is None:
            raise CpattnError(f"shard {self.bundle_index}: not in data-plane group {group_name!r}")
        later = list(later or [])
        if self._secret is not None and not all(authority.matches_secret(getattr(p, "auth", None), self._secret)
                                                for p in later):
            raise authority.refuse(f"shard {self.bundle_index}", "run_step", "a run's plans come from its coordinator")
        if group_name not in self._graphs:
            self._graphs[group_name] = self.runner.new_graphs()
            if self._graphs[group_name] is not None and ShardStepGraphs.supported(plane, self.runner):
                self._step_graphs[group_name] = ShardStepGraphs(plane, self.runner)
        step_graphs = self._step_graphs.get(group_name)
        timings = {"plan_s": 0.0, "attention_s": 0.0, "wire_s": 0.0, "layers": 0, "steps": 0}
        for index, step_plan in enumerate([plan, *later]):
            if not self._fence.admits(step_plan.incarnation):   # not fenced by a restarted coordinator
                return ShardStepReport.of(self._refuse_fenced(plane, step_plan, timings))
            t0 = time.perf_counter()
            planned = self.runner.plan(step_plan, self._graphs[group_name])
            timings["plan_s"] += time.perf_counter() - t0
            try:
                if index and not self._next_in_run(plane, index, step_plan):
                    return ShardStepReport(**dict(timings, outcome="ended"))
                timings = self._serve_layers(plane, planned, timings, step_graphs)
            except RuntimeError as exc:
                # The group broke (a peer died or timed out): report it as data, the coordinator decides.
                return ShardStepReport(**dict(timings, outcome="broken", error=f"{type(exc).__name__}: {exc}"))
            finally:
                self._fence.leave()   # fencing: this thread writes no more
            if timings["outcome"] != "served":
                return ShardStepReport.of(timings)
            timings["steps"] += 1
        return ShardStepReport.of(timings)

    def _next_in_run(self, plane: DataPlane, index: int, plan: ShardStepPlan) -> bool:
        """Wait for the run header before a run's step ``index``: True for NEXT, False for END."""
        command, got_index, step_id, num_tokens = plane.recv_run_header(self.device)
        if command == CMD_END:
            return False
        if command != CMD_NEXT or (got_index, step_id, num_tokens) != (index, plan.step_id, plan.num_tokens):
            raise CpattnError(f"shard {self.bundle_index}: unexpected run header {(command, got_index, step_id, num_tokens)}"
                              f" before step {plan.step_id} ({index} of its run, {plan.num_tokens} tokens)")
        return True

    def _serve_layers_ahead(self, plane: DataPlane, planned: PlannedStep, timings: dict,
                            step_graphs: ShardStepGraphs | None = None) -> dict:
        """NCCL: every layer of the step enqueued at once, in order 0..L-1, without waiting for its message.

        NCCL operations are stream-ordered, so the GPU waits for each layer's message and the host does not:
        the shard's kernels start the moment a message lands instead of after a host round trip per layer.
        The client attends layers in order (Step enforces it on NCCL) and, when it stops early, sends every
        remaining message marked ABORT and drains their partials; the headers are read once, at the end.
        A coordinator restart's fence() waits until these launched writes have landed (cuda synchronize).
        With ``step_graphs`` ready for this step, the whole step is one graph replay (cluster/shard_graphs.py).
        """
        plan = planned.plan
        hq, hk, d = self.config.num_q_heads, self.config.num_kv_heads, self.config.head_size
        while self._hang:
            time.sleep(0.05)
        if not self._fence.enter(plan.incarnation):   # fencing: write nothing past a coordinator restart
            return self._refuse_fenced(plane, plan, timings)
        a0 = time.perf_counter()
        graphed = step_graphs is not None and step_graphs.prepare(planned)
        headers = []
        try:
            if graphed:
                step_graphs.replay()
            else:
                for layer in range(self.config.num_layers):
                    header, qkv = plane.recv_layer_ahead(plan.num_tokens, hq + 2 * hk, d, self.dtype, self.device)
                    headers.append(header)
                    out, lse = self.runner.run_layer(planned, layer, qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:])
                    if plan.num_rows:
                        plane.send_partial(out, lse, partial_tag(plan.step_id, layer))
        finally:
            self._fence.leave()   # every write is launched; fence() waits for them on the device
        a1 = time.perf_counter()
        # The one host wait of the step: until its last message.
        got = step_graphs.wait(self.config.collective_timeout_s) if graphed else torch.stack(headers).tolist()
        timings["graphed_steps"] = timings.get("graphed_steps", 0) + int(graphed)
        timings["attention_s"] += a1 - a0
        timings["wire_s"] += time.perf_counter() - a1
        timings["layers"] += sum(1 for h in got if h[0] == CMD_ATTEND)
        for layer, (command, h_layer, step_id, num_tokens) in enumerate(got):
            if command == CMD_ABORT:
                timings["outcome"] = "abort"
                return timings
            if command != CMD_ATTEND or step_id != plan.step_id or num_tokens != plan.num_tokens or h_layer != layer:
                raise CpattnError(f"shard {self.bundle_index}: unexpected header {(command, h_layer, step_id, num_tokens)}"
                                  f" for layer {layer} of step {plan.step_id} ({plan.num_tokens} tokens)")
        timings["outcome"] = "served"
        return timings

    def _serve_layers(self, plane: DataPlane, planned: PlannedStep, timings: dict,
                      step_graphs: ShardStepGraphs | None = None) -> dict:
        if plane.backend == "nccl":
            return self._serve_layers_ahead(plane, planned, timings, step_graphs)
        plan = planned.plan
        hq, hk, d = self.config.num_q_heads, self.config.num_kv_heads, self.config.head_size
        t = plan.num_tokens
        served: set[int] = set()
        while len(served) < self.config.num_layers:
            while self._hang:
                time.sleep(0.05)
            w0 = time.perf_counter()
            (command, layer, step_id, num_tokens), qkv = plane.recv_layer(t, hq + 2 * hk, d, self.dtype, self.device)
            if command == CMD_ABORT:
                timings["outcome"] = "abort"
                return timings
            if command != CMD_ATTEND or step_id != plan.step_id or num_tokens != t or layer in served:
                raise CpattnError(f"shard {self.bundle_index}: unexpected header {(command, layer, step_id, num_tokens)} "
                                  f"in step {plan.step_id} of {t} tokens")
            served.add(layer)
            if not self._fence.enter(plan.incarnation):   # fencing: write nothing past a coordinator restart
                return self._refuse_fenced(plane, plan, timings)
            a0 = time.perf_counter()
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
            out, lse = self.runner.run_layer(planned, layer, q, k, v)
            self._fence.leave()   # fencing: this layer's KV writes are launched (fence() waits for the device)
            a1 = time.perf_counter()
            if plan.num_rows:
                plane.send_partial(out, lse, partial_tag(plan.step_id, layer))
            timings["attention_s"] += a1 - a0
            timings["wire_s"] += (a0 - w0) + (time.perf_counter() - a1)
            timings["layers"] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the step's sends are done before it reports
        timings["outcome"] = "served"
        return timings


RemoteShard = authority.remote_surface(ShardWorker, authority.SHARD_METHODS, "RemoteShard", __name__)
"""What Ray runs (cluster.shard_set): only the methods of authority.SHARD_METHODS, each checked."""
