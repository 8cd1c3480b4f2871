"""Shard worker: owns one shard of every layer's paged KV and runs the attention backend on it.

A plain class; ``ray.remote`` is applied where the group is created, so it is testable without Ray.
Per step it receives one ShardStepPlan (metadata planned once, reused by every layer), then
serves layers from its data-plane group until the gateway says commit or abort.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time

import torch

from cpattn.attention import get_attn_backend, write_kv_cache
from cpattn.attention.registry import apply_registry_state
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, connect_group, partial_tag
from cpattn.cluster.fencing import StepFence
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner
from cpattn.cluster.netbind import bind_address
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError, StepFencedError
from cpattn.kvstore.fp8 import dequantize, dynamic_scales, fp8_dtype, initial_scales, is_fp8, quantize, rescale_cache

logger = logging.getLogger("cpattn.shard")


SYNTHETIC_CHUNK = 1 << 16


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
                 secret: str | None = None, ready: bool = True):
        self.config = config
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
        self.backend = get_attn_backend(
            config.backend, head_size=config.head_size, dtype=self.dtype, block_size=config.block_size,
            num_q_heads=config.num_q_heads, num_kv_heads=config.num_kv_heads, device=self.device,
            **config.backend_features())
        self.num_blocks = config.blocks_per_shard()
        shape = self.backend.get_kv_cache_shape(self.num_blocks, config.block_size, config.num_kv_heads,
                                                config.head_size)
        self.kv_format = config.kv_cache_format if is_fp8(config.kv_cache_format) else None
        self.cache_dtype = fp8_dtype(self.kv_format) if self.kv_format else self.dtype
        self.kv_caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
                          for _ in range(config.num_layers)]
        # fp8: [2, Hk] float32 scales per layer (static from the config, or dynamic: 0 until the first write).
        self.kv_scales = None if self.kv_format is None else [
            initial_scales(config.num_kv_heads, None if config.kv_scales is None else config.kv_scales[layer],
                           self.device) for layer in range(config.num_layers)]
        self.runner = ShardLayerRunner(config, self.backend, self.kv_caches, self.device, self.kv_scales)
        self.kernel_block_size = self.runner.kernel_block_size
        self._groups: dict[str, DataPlane] = {}
        self._lock = threading.Lock()
        self._hang = False
        self._fence = StepFence()   # coordinator fencing: steps of an older incarnation never write (fencing.py)
        logger.info("shard %d: backend %s (%s), %d blocks of %d tokens, kernel pages of %d, device %s",
                    bundle_index, self.backend.get_name(), self.backend.kernel_version(), self.num_blocks,
                    config.block_size, self.kernel_block_size, self.device)

    # Introspection --------------------------------------------------------------------------------
    def info(self) -> dict:
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
        return {"bundle_index": self.bundle_index, "node_id": node_id, "node_ip": node_ip, "gpu_ids": gpu_ids,
                "gpu_uuid": gpu_uuid, "pid": os.getpid(), "device": str(self.device), "backend": self.backend.get_name(),
                "kernel_version": self.backend.kernel_version(), "lse_base": self.backend.lse_base.name,
                "num_blocks": self.num_blocks, "kernel_block_size": self.kernel_block_size, "ready": self._ready,
                "kv_cache_dtype": str(self.cache_dtype).removeprefix("torch."),
                "kv_bytes": sum(t.numel() * t.element_size() for t in self.kv_caches)}

    def ping(self) -> bool:
        return not self._hang

    def simulate_hang(self, hang: bool = True) -> None:
        """Test hook: stop answering pings and data-plane traffic, as a wedged process would."""
        self._hang = hang

    def kv_checksum(self) -> float:
        """Sum of |KV| over every layer, a cheap fingerprint for 'nothing changed' checks (an fp8 cache's real,
        dequantised values, so a replacement holding the same values under other scales sums the same)."""
        if self.kv_scales is None:
            return float(sum(t.double().abs().sum() for t in self.kv_caches))
        return float(sum(dequantize(t, s[:, None, None, :, None], torch.float64).abs().sum()
                         for t, s in zip(self.kv_caches, self.kv_scales)))

    def get_kv_scales(self) -> list[list[list[float]]] | None:
        """fp8 caches: every layer's [2, Hk] scales (identical on every shard: see cpattn/kvstore/fp8.py)."""
        return None if self.kv_scales is None else [s.tolist() for s in self.kv_scales]

    def _authorize(self, secret: str | None, what: str) -> None:
        """Calls that read or write KV, or end a client, come from this service's coordinator only."""
        if self._secret is not None and not (isinstance(secret, str) and hmac.compare_digest(secret, self._secret)):
            raise CpattnError(f"shard {self.bundle_index}: {what} refused: only the service's coordinator may call it")

    def _admit(self, plan: ShardStepPlan) -> bool:
        """Before a step: the plan must come from the coordinator (else raises) and not be fenced (else False)."""
        self._authorize(plan.auth, "a step plan")
        return self._fence.admits(plan.incarnation)

    def mark_ready(self, secret: str | None = None) -> None:
        """The coordinator finished refilling this replacement: it may serve now."""
        self._authorize(secret, "mark_ready")
        self._ready = True

    def export_kv(self, group_name: str, ticket: str | None = None) -> list[tuple]:
        """CUDA IPC handles of every layer's KV cache, for a client on this GPU to open once per connection.

        Such a client computes this shard's share in its own process (no per-layer hand-over between
        two processes on one GPU, which costs a context switch each way); the caches stay owned here.
        Only non-detached services use it (gateway._local_ranks): writes made there bypass the fence. The
        caller proves it is a registered client (a group ticket); it then holds this whole shard's KV, which
        is why clients that must be isolated from each other run with local_shards='off' (README Security).
        """
        self._check_ticket(group_name, ticket)
        if self.device.type != "cuda":
            raise CpattnError(f"shard {self.bundle_index} keeps its KV on {self.device}: only CUDA caches can be shared")
        from torch.multiprocessing.reductions import reduce_tensor

        return [reduce_tensor(t)[1] for t in self.kv_caches]

    def read_blocks(self, block_ids: list[int], secret: str | None = None) -> torch.Tensor:
        """KV pages [num_layers, 2, n, block_size, Hk, D] on the CPU (recovery and tests; never per layer).
        An fp8 cache's pages come back dequantised (float32 real values), so the receiver needs no scales."""
        self._authorize(secret, "read_blocks")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.kv_scales is None:
            return torch.stack([t[:, idx] for t in self.kv_caches]).cpu()
        return torch.stack([dequantize(t[:, idx], s[:, None, None, :, None], torch.float32)
                            for t, s in zip(self.kv_caches, self.kv_scales)]).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, secret: str | None = None) -> None:
        self._authorize(secret, "write_blocks")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, t in enumerate(self.kv_caches):
            if self.kv_scales is None:
                t[:, idx] = data[layer].to(self.device, self.dtype)
                continue
            pages = data[layer].to(self.device, torch.float32)             # [2, n, B, Hk, D] real values
            scale = self.kv_scales[layer]
            if self.config.kv_scales is None:
                # Dynamic: grow to cover the copied pages (powers of two, so the copy is exact; fp8.py).
                flat = pages.reshape(2, -1, pages.shape[-2], pages.shape[-1])
                grown = dynamic_scales(scale, flat[0], flat[1], self.kv_format)
                rescale_cache(t, scale, grown)
                scale.copy_(grown)
            t[:, idx] = quantize(pages, scale[:, None, None, :, None], t.dtype)

    def fill_synthetic(self, plan: ShardStepPlan, seed: int) -> int:
        """Write seeded random K/V for the plan's new tokens this shard owns (benchmarks, load tests).

        Every shard draws the same values (synthetic_kv on its device) and keeps its own tokens, so
        the sequence's logical KV is reproducible from ``seed``.
        """
        self._authorize(plan.auth, "fill_synthetic")
        slots = plan.metadata.slot_mapping.to(self.device)
        replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(self.device)
        hk, d = self.config.num_kv_heads, self.config.head_size
        for layer, cache in enumerate(self.kv_caches):
            if not self._fence.enter(plan.incarnation):
                raise StepFencedError(f"shard {self.bundle_index}: fill_synthetic of coordinator incarnation "
                                      f"{plan.incarnation} was fenced by a restarted coordinator: fill again")
            try:
                for start in range(0, plan.num_tokens, SYNTHETIC_CHUNK):
                    n = min(SYNTHETIC_CHUNK, plan.num_tokens - start)
                    k, v = synthetic_kv(seed, layer, start, n, hk, d, self.device)
                    k, v = k.to(self.dtype), v.to(self.dtype)
                    scale = None
                    if self.kv_scales is not None:
                        scale = self.kv_scales[layer]
                        if self.config.kv_scales is None:
                            grown = dynamic_scales(scale, k, v, self.kv_format)
                            rescale_cache(cache, scale, grown)
                            scale.copy_(grown)
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
        self._authorize(secret, "fence")
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
            for name in [n for n, p in self._groups.items() if p is plane]:
                del self._groups[name]
        plane.close()
        logger.warning("shard %d: step %d of coordinator incarnation %d refused (fenced at %d)", self.bundle_index,
                       plan.step_id, plan.incarnation, self._fence.floor)
        return dict(timings or {}, outcome="fenced",
                    error=f"step {plan.step_id} was fenced by a restarted coordinator")

    # Data plane -----------------------------------------------------------------------------------
    def _check_ticket(self, group_name: str, ticket: str | None) -> None:
        """A client joins or leaves only its own groups: the coordinator's ticket (HMAC of the name) proves it."""
        if self._secret is None:
            return
        expected = hmac.new(self._secret.encode(), str(group_name).encode(), hashlib.sha256).hexdigest()
        if not (isinstance(ticket, str) and hmac.compare_digest(ticket, expected)):
            raise CpattnError(f"shard {self.bundle_index}: group {group_name!r} refused: no valid ticket (get one "
                              "from the coordinator with the client's credential)")

    def join_group(self, group_name: str, host: str, port: int, rank: int, world_size: int, backend: str,
                   ticket: str | None = None) -> bool:
        self._check_ticket(group_name, ticket)
        with self._lock:
            if group_name in self._groups:
                raise CpattnError(f"shard {self.bundle_index}: group {group_name!r} exists: rejoin under a new name")
        cfg = self.config
        bind_ip, interface = bind_address(_node_ip(), cfg.data_plane_interface)
        group = connect_group(host, port, group_name, rank, world_size, backend, cfg.collective_timeout_s,
                              bind_ip=bind_ip, interface=interface, explicit_interface=bool(cfg.data_plane_interface))
        with self._lock:
            self._groups[group_name] = DataPlane(group, rank, world_size, backend)
        return True

    def drop_client(self, secret: str, client_id: str) -> int:
        """Close every data-plane group of a client that ended (close() or a lapsed lease); returns how many."""
        self._authorize(secret, "drop_client")
        with self._lock:
            names = [n for n in self._groups if n.startswith(f"{client_id}-")]
            planes = [self._groups.pop(n) for n in names]
        for plane in planes:
            plane.close()
        return len(planes)

    def group_names(self) -> list[str]:
        with self._lock:
            return list(self._groups)

    def leave_group(self, group_name: str, ticket: str | None = None) -> None:
        self._check_ticket(group_name, ticket)
        with self._lock:
            plane = self._groups.pop(group_name, None)
        if plane is not None:
            plane.close()

    def run_step(self, group_name: str, plan: ShardStepPlan) -> dict:
        """Serve every layer of one step from the group; returns timings (seconds) and how it ended."""
        plane = self._groups.get(group_name)
        if plane is None:
            raise CpattnError(f"shard {self.bundle_index}: not in data-plane group {group_name!r}")
        if not self._admit(plan):   # a plan of this coordinator (auth), not fenced by a restarted one
            return self._refuse_fenced(plane, plan)
        t0 = time.perf_counter()
        planned = self.runner.plan(plan)
        timings = {"plan_s": time.perf_counter() - t0, "attention_s": 0.0, "wire_s": 0.0, "layers": 0}
        try:
            return self._serve_layers(plane, planned, timings)
        except RuntimeError as exc:
            # The group broke (a peer died or timed out): report it as data, the coordinator decides.
            return dict(timings, outcome="broken", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._fence.leave()   # fencing: this thread writes no more

    def _serve_layers(self, plane: DataPlane, planned: PlannedStep, timings: dict) -> dict:
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
