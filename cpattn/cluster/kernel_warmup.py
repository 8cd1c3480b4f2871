"""A shard's kernels run once before it serves, on a scratch cache of their own. No Ray.

Why: the first call of a GPU kernel compiles it. Measured on an H200:
- FlashInfer's JIT took 14 s for decode and 89 s for prefill on a fresh node.
- FA4 compiles each variant once per process, 3-16 s each.
Inside a first step, that time counts against collective_timeout_s, and the client sees a hung shard. At start,
it counts against start_timeout_s, which is there for exactly that kind of wait. vLLM does the same: it runs a
profile pass before it serves.

What runs: the three kinds of step every service sees, through the same ShardLayerRunner a step uses:
1. a prefill from empty (causal pieces only);
2. a chunked prefill (the context pass and the causal pieces, merged);
3. a decode (the decode backend), of one sequence and of two.
Each prefill runs short (two pages) and long (LONG_CHUNK tokens): kernels choose tiles, query groups and splits
by shape, and each choice compiles once (on an H100, a warm-up of short shapes alone left FA4 2.3 s and TRITON
3.1 s of compiling in the first 512-token steps). Each runs on one layer of every distinct (window, soft cap)
pair, since a kernel variant is compiled per pair.
Before them, a backend that compiles one module per variant (FlashInfer: one per wrapper, soft cap, window and
mask) has every module it can plan built side by side, instead of one after another inside the steps' plans.
The scratch cache is a few pages, shared by those layers, and is dropped on return: the shard's own cache and its
fp8 scales are never touched.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.config import ServiceConfig
from cpattn.errors import ServiceError
from cpattn.kvstore.fp8 import fp8_dtype, initial_page_scales, is_fp8
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator

logger = logging.getLogger("cpattn")

# Builds at once: a FlashInfer prefill module is 4-8 nvcc jobs (ninja runs a module's files in parallel already) of
# a few GB each, so more builds than cores / 8 only contend for the CPU, and for memory.
COMPILE_WORKERS = max(1, (os.cpu_count() or 1) // 8)
LONG_CHUNK = 512   # tokens of the long prefills: several kernel tiles, and query groups of a context pass at their largest

_warmed: set[tuple] = set()
"""What this process has warmed: (backend, prefill backend, device, kernel shapes). A client that rejoins, or opens
a second shard on the same GPU, does not warm it again."""


def warm_up_kernels(config: ServiceConfig, backend_cls, prefill_backend_cls, device: torch.device,
                    who: str = "shard") -> float:
    """Runs the kernels once on ``device``. Returns the seconds taken, or 0.0 when this process already warmed
    them. A kernel that fails, or that gives non-finite output on finite input, raises ServiceError naming the
    backend and the step: the service then fails to start, instead of failing its first step."""
    key = (backend_cls, prefill_backend_cls, str(device), config.num_q_heads, config.num_kv_heads,
           config.head_size, config.dtype, config.block_size, config.kv_cache_format, config.kv_scales is None,
           tuple(config.layer_windows()), tuple(config.layer_soft_caps()))
    if key in _warmed:
        return 0.0
    t0 = time.perf_counter()
    short, long = 2 * config.block_size, max(LONG_CHUNK, 2 * config.block_size)
    runner, allocator = _scratch(config, backend_cls, prefill_backend_cls, device, 2 * short + 2 * long + 2)
    _compile_side_by_side(runner, config.num_shards > 1, who)
    rows = [allocator.add_rows(), allocator.add_rows()]
    lengths = [0, 0]
    gen = torch.Generator().manual_seed(0)
    for step_id, (kind, request) in enumerate(_steps(short, long), 1):
        allocator.grow([(rows[s], lengths[s] + n) for s, n in request.items()])
        plan, = plan_step(allocator, [StepRequest(rows[s], lengths[s], n) for s, n in request.items()], step_id,
                          config.pcp_enabled, config.pcp_min_tokens, row_window=config.row_window())
        _run_layers(runner, runner.plan(plan), config, sum(request.values()), gen, f"{who}: the "
                    f"{_name(runner, kind)} kernel's first run on {device} ({kind}")
        for s, n in request.items():
            lengths[s] += n
    _warmed.add(key)
    seconds = time.perf_counter() - t0
    logger.info("%s: kernels warmed on %s in %.1f s (%s)", who, device, seconds, _name(runner, "decode"))
    return seconds


def _compile_side_by_side(runner: ShardLayerRunner, sharded: bool, who: str) -> None:
    """The modules a backend compiles per variant on first use (FlashInfer's ``jit_variants``), built at once in
    threads (each build is nvcc in subprocesses), at most COMPILE_WORKERS at a time, before the steps below plan
    them one after another. A call that fails is only logged: the steps then plan that variant again, and a
    failure there is the ServiceError that names it."""
    calls = []
    for r, prefill in ((runner, runner.prefill_runner is None), (runner.prefill_runner, True)):
        variants = getattr(r.builder, "jit_variants", None) if r is not None else None
        calls += variants(prefill, sharded) if variants is not None else []
    if not calls:
        return
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(COMPILE_WORKERS, len(calls)), thread_name_prefix="cpattn-jit") as pool:
        futures = [pool.submit(call) for call in calls]
    failed = [f.exception() for f in futures if f.exception() is not None]
    for exc in failed:
        logger.warning("%s: compiling a kernel variant ahead failed (the warm-up's steps try it again): %s: %s",
                       who, type(exc).__name__, exc)
    logger.info("%s: %d kernel variants compiled side by side in %.1f s", who, len(calls) - len(failed),
                time.perf_counter() - t0)


def _run_layers(runner: ShardLayerRunner, planned, config: ServiceConfig, t: int, gen: torch.Generator,
                where: str) -> None:
    """One layer of each variant on random q/k/v of ``t`` tokens; a failure or a non-finite output is a
    ServiceError that starts with ``where``."""
    device = runner.device
    for layer in _one_layer_per_variant(config):
        q, k, v = (torch.randn(t, h, config.head_size, generator=gen).to(device, config.torch_dtype)
                   for h in (config.num_q_heads, config.num_kv_heads, config.num_kv_heads))
        try:
            out, lse = runner.run_layer(planned, layer, q, k, v)
            finite = bool(out.isfinite().all()) and not bool(lse.isnan().any())
        except Exception as exc:
            raise ServiceError(f"{where}, layer {layer}) failed: {type(exc).__name__}: {exc}") from exc
        if not finite:
            raise ServiceError(f"{where}, layer {layer}) gave non-finite output on finite input: choose another "
                               "backend")


def _steps(short: int, long: int) -> list[tuple[str, dict[int, int]]]:
    """(kind, {sequence: new tokens}) in order. Kernels pick tile sizes, query groups and splits from a step's
    shape, and each choice compiles on its own, so every kind runs short and long (two sequences)."""
    return [("prefill", {0: short}), ("prefill", {1: long}), ("chunked prefill", {0: short}),
            ("chunked prefill", {1: long}), ("decode", {0: 1}), ("decode", {0: 1, 1: 1})]


def _scratch(config: ServiceConfig, backend_cls, prefill_backend_cls, device: torch.device, tokens: int
             ) -> tuple[ShardLayerRunner, ShardedKVAllocator]:
    """A runner over one cache of just enough pages for ``tokens``, which every layer shares."""
    blocks = -(-tokens // config.block_size) + 1
    scratch = config.model_copy(update=dict(num_shards=1, kv_replicas=1, dcp_interleave=1,
                                            num_blocks_per_shard=blocks))
    kv_format = config.kv_cache_format
    shape = backend_cls.get_kv_cache_shape(blocks, config.block_size, config.num_kv_heads, config.head_size)
    dtype = fp8_dtype(kv_format) if is_fp8(kv_format) else config.torch_dtype
    cache = torch.zeros(shape, dtype=dtype, device=device)
    scales = None
    if is_fp8(kv_format):
        static = None if config.kv_scales is None else config.kv_scales[0]
        scales = [initial_page_scales(blocks, config.num_kv_heads, static, device)] * config.num_layers
    runner = ShardLayerRunner(scratch, backend_cls, [cache] * config.num_layers, device, scales,
                              prefill_backend_cls)
    return runner, ShardedKVAllocator(1, blocks, config.block_size, 1, max_rows=2)


def _one_layer_per_variant(config: ServiceConfig) -> list[int]:
    first: dict[tuple, int] = {}
    for layer, variant in enumerate(zip(config.layer_windows(), config.layer_soft_caps())):
        first.setdefault(variant, layer)
    return sorted(first.values())


def _name(runner: ShardLayerRunner, kind: str) -> str:
    backend = runner.prefill_backend if kind != "decode" else runner.backend
    return backend.get_name()
