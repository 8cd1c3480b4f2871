"""CUDA graph capture as every graph of the decode path does it: on a side stream, after the work before it.

Runs in: the client (client_graphs.py, decode_graphs.py for in-process shards) and shard actors
(decode_graphs.py, shard_graphs.py).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch


def capture_graphs(device: torch.device, count: int, record: Callable[[int], Any],
                   warmup: Callable[[], Any] | None = None,
                   sync_device: bool = True) -> tuple[list[torch.cuda.CUDAGraph], list[Any]]:
    """``count`` graphs sharing one memory pool, graph i capturing ``record(i)`` (its return value is kept:
    the tensors the graph writes). ``warmup`` runs first, outside any capture (kernel JIT, allocations);
    ``sync_device``: wait for all of the device's work first (NCCL work enqueued before must not be in flight).
    thread_local capture: the process's other threads (a shard's other clients) keep launching meanwhile."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    if warmup is not None:
        with torch.cuda.stream(side):
            warmup()
        side.synchronize()
    if sync_device:
        torch.cuda.synchronize(device)
    gc.collect()
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    with torch.cuda.stream(side):
        for i in range(count):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs.append(record(i))
            finally:
                graph.capture_end()
            graphs.append(graph)
    current.wait_stream(side)
    return graphs, outputs


def fill_qkv(qkv_TXD: torch.Tensor, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> None:
    """A layer's q, k, v into a graph's packed input buffer (q|k|v heads along dim 1), before its replay: one
    launch (torch.cat into the buffer) where three copies were three cudaMemcpyAsync calls, 17-30 us of host
    time each on an H200 host while the GPU runs the previous layers (kernel launches there cost ~9 us; torch
    profiler, 2026-12-02). Inputs of another dtype than the buffer's are converted by copy_, as before."""
    if q_TQD.dtype == k_TKD.dtype == v_TKD.dtype == qkv_TXD.dtype:
        torch.cat([q_TQD, k_TKD, v_TKD], dim=1, out=qkv_TXD)
        return
    hq, hk = q_TQD.shape[1], k_TKD.shape[1]
    qkv_TXD[:, :hq].copy_(q_TQD)
    qkv_TXD[:, hq:hq + hk].copy_(k_TKD)
    qkv_TXD[:, hq + hk:].copy_(v_TKD)
