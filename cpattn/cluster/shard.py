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

from cpattn.attention import get_attn_backend, write_kv_cache
from cpattn.attention.registry import apply_registry_state
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, create_group, make_store, partial_tag
from cpattn.cluster.layer_runner import PlannedStep, ShardLayerRunner
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError
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


class ShardWorker:
    def __init__(self, config: ServiceConfig, bundle_index: int, backend_registry: dict | None = None):
        self.config = config
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
                "num_blocks": self.num_blocks, "kernel_block_size": self.kernel_block_size,
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

    def export_kv(self) -> list[tuple]:
        """CUDA IPC handles of every layer's KV cache, for a client on this GPU to open once per connection.

        Such a client computes this shard's share in its own process (no per-layer hand-over between
        two processes on one GPU, which costs a context switch each way); the caches stay owned here.
        """
        if self.device.type != "cuda":
            raise CpattnError(f"shard {self.bundle_index} keeps its KV on {self.device}: only CUDA caches can be shared")
        from torch.multiprocessing.reductions import reduce_tensor

        return [reduce_tensor(t)[1] for t in self.kv_caches]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """KV pages [num_layers, 2, n, block_size, Hk, D] on the CPU (recovery and tests; never per layer).
        An fp8 cache's pages come back dequantised (float32 real values), so the receiver needs no scales."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.kv_scales is None:
            return torch.stack([t[:, idx] for t in self.kv_caches]).cpu()
        return torch.stack([dequantize(t[:, idx], s[:, None, None, :, None], torch.float32)
                            for t, s in zip(self.kv_caches, self.kv_scales)]).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
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
        slots = plan.metadata.slot_mapping.to(self.device)
        replica = None if plan.replica_slot_mapping is None else plan.replica_slot_mapping.to(self.device)
        hk, d = self.config.num_kv_heads, self.config.head_size
        for layer, cache in enumerate(self.kv_caches):
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
        return int((slots >= 0).sum())

    # Data plane -----------------------------------------------------------------------------------
    def join_group(self, group_name: str, host: str, port: int, rank: int, world_size: int, backend: str) -> bool:
        store = make_store(host, port, world_size, False, self.config.collective_timeout_s)
        group = create_group(store, group_name, rank, world_size, backend, self.config.collective_timeout_s)
        with self._lock:
            self._groups[group_name] = DataPlane(group, rank, world_size, backend)
        return True

    def leave_group(self, group_name: str) -> None:
        with self._lock:
            plane = self._groups.pop(group_name, None)
        if plane is not None:
            plane.close()

    def run_step(self, group_name: str, plan: ShardStepPlan) -> dict:
        """Serve every layer of one step from the group; returns timings (seconds) and how it ended."""
        plane = self._groups.get(group_name)
        if plane is None:
            raise CpattnError(f"shard {self.bundle_index}: not in data-plane group {group_name!r}")
        t0 = time.perf_counter()
        planned = self.runner.plan(plan)
        timings = {"plan_s": time.perf_counter() - t0, "attention_s": 0.0, "wire_s": 0.0, "layers": 0}
        try:
            return self._serve_layers(plane, planned, timings)
        except RuntimeError as exc:
            # The group broke (a peer died or timed out): report it as data, the coordinator decides.
            return dict(timings, outcome="broken", error=f"{type(exc).__name__}: {exc}")

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
            a0 = time.perf_counter()
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
            out, lse = self.runner.run_layer(planned, layer, q, k, v)
            a1 = time.perf_counter()
            if plan.num_rows:
                plane.send_partial(out, lse, partial_tag(plan.step_id, layer))
            timings["attention_s"] += a1 - a0   # kernel launch time on CUDA (no per-layer sync)
            timings["wire_s"] += (a0 - w0) + (time.perf_counter() - a1)
            timings["layers"] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the step's sends are done before it reports
        timings["outcome"] = "served"
        return timings
