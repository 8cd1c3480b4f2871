"""CUDA graphs of a remote shard's whole decode step over NCCL: one replay per step, not ~10 launches per layer.

Runs in: a shard actor (cluster/shard.py), for a client's data-plane group on NCCL.
A remote shard serves a decode step's layers ahead (shard._serve_layers_ahead): per layer it receives the
header and q|k|v (a broadcast from the client), writes K/V and attends (its decode graphs,
cluster/decode_graphs.py) and sends its partial back. Launched from Python that is 0.15-0.25 ms of host
work per layer (eager NCCL calls ~50 us each), more than the kernels of a 64K-token shard take, so at
128K on 2 H200s the client waited for this shard's launches every layer (0.36 ms/layer against ~0.15
of GPU work). Here the step's L layers are one graph, replayed once per step; the client cannot tell (the
same NCCL operations, in the same order, as the eager path and as its own graphs issue).

Per step only device buffers change: the decode graphs' metadata (their prepare, before this replay) and
the partials' tags. The headers the client sent land in a device buffer that the shard reads once, after
the replay finished, exactly as the eager path reads them; that wait is bounded by collective_timeout_s
(a graph's NCCL work has no watchdog), after which the step is reported broken and its group is closed,
which aborts the communicator and with it the stuck kernels. The first step of a bucket runs eagerly
(warm kernels and NCCL's point-to-point communicator); anything that cannot be captured turns the graphs
off for this group with a warning.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from cpattn.cluster.graph_capture import capture_graphs
from cpattn.cluster.data_plane import HEADER_BYTES, TAG_BYTES

logger = logging.getLogger("cpattn")

POLL_S = 20e-6   # how often the end-of-step wait looks at the device (a step is 5-40 ms)


class ShardStepGraphs:
    """One group's step graph on a shard: ``prepare`` per step (False: serve eagerly), then ``replay`` and
    ``headers`` (the step's L headers [L, 4] int64, read on the host once per step)."""

    def __init__(self, plane, runner):
        self.plane = plane
        self.runner = runner
        self.key: tuple | None = None
        self.seen: set[tuple] = set()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.done: torch.cuda.Event | None = None
        self.buffers: tuple | None = None
        self.disabled = False

    @staticmethod
    def supported(plane, runner) -> bool:
        return (plane.backend == "nccl" and runner.device.type == "cuda" and runner.config.cuda_graphs == "auto")

    def prepare(self, planned) -> bool:
        """Ready this step's graph (capturing a warm bucket once); False when the step is served eagerly."""
        graphs, plan = planned.graphs, planned.plan
        if self.disabled or graphs is None or graphs.key is None or planned.copies is not None:
            return False   # decode graphs off for this step (copies, cascade, row subsets, odd shapes)
        key = (graphs.key, plan.num_tokens, plan.num_rows)
        # The decode graphs' buffers this graph reads: kept alive here, so a recapture there (new buffers) is
        # seen by identity and the old addresses are never reused under this graph.
        if key != self.key or self.buffers is None or self.buffers[0] is not graphs.static:
            if key not in self.seen:
                self.seen.add(key)
                return False
            try:
                self._capture(graphs, plan.num_tokens, plan.num_rows)
            except RuntimeError as exc:   # an op that cannot be captured here: stay eager
                logger.warning("shard step graphs off for this group (%s); layers are launched one by one", exc)
                self.release()
                self.disabled = True
                return False
            self.key, self.buffers = key, (graphs.static, graphs.qkv)
        torch.add(self.layer_ids, plan.step_id * 65536 + 1, out=self.tags)   # data_plane.partial_tag per layer
        return True

    def replay(self) -> None:
        self.graph.replay()
        self.done.record()

    def wait(self, timeout_s: float) -> list[list[int]]:
        """The step's headers once its replay finished; RuntimeError after ``timeout_s`` (a peer that never
        sent: the caller reports the group broken, and closing it aborts the stuck NCCL kernels)."""
        deadline = time.monotonic() + timeout_s
        while not self.done.query():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the step's messages did not all arrive within collective_timeout_s={timeout_s:g}s")
            time.sleep(POLL_S)
        return self.headers.tolist()

    def release(self) -> None:
        """Drop the graph (and the NCCL work captured in it) before the group's communicator is destroyed.
        A replay still waiting on a dead peer is not waited for: the communicator's abort ends it."""
        finished = self.done is None or self.done.query()
        self.graph, self.key, self.buffers = None, None, None
        gc.collect()
        if finished:
            torch.cuda.synchronize(self.runner.device)

    # Capture --------------------------------------------------------------------------------------
    def _layer(self, graphs, layer: int, num_rows: int) -> None:
        plane = self.plane
        plane.broadcast(self.message)
        self.headers[layer].copy_(self.message[:HEADER_BYTES].view(torch.int64))
        graphs.qkv.copy_(self.qkv)
        out, lse = graphs._layer(layer)
        if not num_rows:
            return
        self.out.copy_(out)
        self.lse.copy_(lse)
        self.tag.copy_(self.tags[layer:layer + 1])
        plane._run(plane.group.send([self.partial], 0, 0))

    def _capture(self, graphs, num_tokens: int, num_rows: int) -> None:
        r, cfg = self.runner, self.runner.config
        self.graph, self.key = None, None
        hq, hk, d, num_layers = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.num_layers
        device, dtype, lse_dtype = r.device, r.dtype, r.lse_dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.message = torch.zeros(HEADER_BYTES + num_tokens * (hq + 2 * hk) * d * itemsize, dtype=torch.uint8,
                                   device=device)
        self.qkv = self.message[HEADER_BYTES:].view(dtype).view(num_tokens, hq + 2 * hk, d)
        out_bytes = num_tokens * hq * d * itemsize
        lse_bytes = num_tokens * hq * torch.empty(0, dtype=lse_dtype).element_size()
        self.partial = torch.zeros(out_bytes + lse_bytes + TAG_BYTES, dtype=torch.uint8, device=device)
        self.out = self.partial[:out_bytes].view(dtype).view(num_tokens, hq, d)
        self.lse = self.partial[out_bytes:out_bytes + lse_bytes].view(lse_dtype).view(num_tokens, hq)
        self.tag = self.partial[out_bytes + lse_bytes:].view(torch.int64)
        self.headers = torch.zeros(num_layers, 4, dtype=torch.int64, device=device)
        self.layer_ids = torch.arange(num_layers, dtype=torch.int64, device=device)
        self.tags = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.done = torch.cuda.Event()
        captured, _ = capture_graphs(device, 1, lambda _: [self._layer(graphs, layer, num_rows)
                                                            for layer in range(num_layers)])
        self.graph = captured[0]
        logger.info("captured a %d-layer shard step graph (%d tokens, %d rows)", num_layers, num_tokens, num_rows)
