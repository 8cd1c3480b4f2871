"""CUDA graphs of the client's whole decode layer: one replay instead of ~5-20 launches from Python.

Legend: T tokens (= requests: a decode-only step), X = Q + 2 K packed heads, D head size, L layers.
A decode layer on the client, its in-process shards graphed (cluster.decode_graphs) and its remote shards (if any)
reached over NCCL, is: the layer's header and q|k|v broadcast (remote shards only), the NaN check, the in-process
shards' KV write and attention, each remote shard's partial received, the merge. Launched from Python this cost
~0.45 ms of host time per layer (eager NCCL calls ~50-150 us each) against ~0.15 ms of kernels at 128K on
2 H200s, so two GPUs decoded slower than one. With every shard in this process it was still five launches and
an allocation per layer (q|k|v packed, its NaN norm, q|k|v copied again into the shard's graph, the replay, the
output copied out): ~0.08 ms of host time against a windowed layer's 0.03 ms kernel on one H200. Captured once
per bucket (T, the in-process graphs' buckets, the remote ranks), one graph per layer, replayed per layer after
q|k|v are copied into the message buffer.

NCCL operations inside a graph run in the order captured, exactly as the eager ones (the shards, which run
their layers ahead eagerly, cannot tell). Everything a step changes lives on the device and is set once per
step: the headers' step id, the partials' expected tags and broken flags (remote shards only).
The first step of a bucket runs eagerly (kernel JIT and NCCL's point-to-point communicators are created outside
a capture). Anything that cannot be captured turns the graphs off for this client with a warning; the layer then
runs eagerly as before.
"""

from __future__ import annotations

import gc
import logging

import torch

from cpattn.attention.ops.merge import merge_partials
from cpattn.cluster.graph_capture import capture_graphs, fill_qkv
from cpattn.cluster.data_plane import CMD_ATTEND, HEADER_BYTES, TAG_BYTES

logger = logging.getLogger("cpattn")


class ClientLayerGraphs:
    """One client's per-layer graphs; ``prepare`` once per step (False: run this step eagerly), ``run`` per layer."""

    def __init__(self, gateway):
        self.gw = gateway
        self.key: tuple | None = None
        self.seen: set[tuple] = set()   # buckets that ran one eager step (warm)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[torch.Tensor] = []
        self.disabled = False

    @staticmethod
    def supported(gateway) -> bool:
        """A CUDA client with graphs on, whose remote shards are reached over NCCL (gloo shards read a header per
        layer on the host), or with every shard in this process."""
        if gateway.config.cuda_graphs != "auto" or gateway.device.type != "cuda":
            return False
        plane = gateway.plane
        return plane.backend == "nccl" if plane is not None else bool(gateway.local)

    def prepare(self, wire) -> bool:
        """Ready this step's graphs (capturing a warm bucket once); False when the step runs eagerly."""
        if self.disabled or any(s.graphs is None or s.copies is not None for s in wire.local.values()):
            return False   # copy on write runs outside the captured layer (layer_runner); a cascade's prefix pass
                           # is in it (decode_graphs)
        if any(rows is not None for rows in wire.remote_rows.values()):
            return False   # a remote shard computing only some rows: the eager merge scatters them
        key = (wire.num_tokens, tuple((r, s.graphs.key) for r, s in sorted(wire.local.items())),
               tuple(sorted(wire.remote_rows)))
        if key != self.key:
            if key not in self.seen:
                self.seen.add(key)
                return False
            try:
                self._capture(wire, key)
            except RuntimeError as exc:   # an op that cannot be captured here: stay eager
                logger.warning("client CUDA graphs off (%s); decode layers run eagerly", exc)
                self.disabled, self.key, self.graphs, self.outputs = True, None, [], []
                return False
        if self.gw.plane is not None:   # with remote shards: what the headers say and the partials must carry
            self.headers[:, 2].fill_(wire.step_id)
            torch.add(self.layer_ids, wire.step_id * 65536 + 1, out=self.tags)   # data_plane.partial_tag per layer
            self.flags.zero_()   # a layer run eagerly (sinks) leaves its flags unwritten
        # The NaN norms are not zeroed (a launch, 10-30 us on a GPU host): every attended layer writes its own entry,
        # replayed or eager (wire_select.post_layer), and they are read only once every layer was (step_run._finish).
        return True

    def run(self, layer: int, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        """One layer: out [T, Q, D], a fresh tensor (the graph's buffer is overwritten when the layer replays)."""
        fill_qkv(self.qkv, q_TQD, k_TKD, v_TKD)
        self.graphs[layer].replay()
        return self.outputs[layer].clone()

    def release(self) -> None:
        """Drop the graphs (and the NCCL work captured in them) and wait until none is running."""
        self.graphs, self.outputs, self.key = [], [], None
        gc.collect()
        torch.cuda.synchronize(self.gw.device)

    # Capture --------------------------------------------------------------------------------------
    def _layer(self, layer: int, wire) -> torch.Tensor:
        gw = self.gw
        if gw.plane is not None:
            self.message[:HEADER_BYTES].view(torch.int64).copy_(self.headers[layer])
        torch.linalg.vector_norm(self.qkv, float("inf"), dtype=torch.float32, out=self.norms[layer])
        if gw.plane is not None:
            gw.plane.broadcast(self.message)
        outs, lses = [], []
        for r, step in sorted(wire.local.items()):
            graphs = step.graphs
            graphs.qkv.copy_(self.qkv)
            out, lse = graphs._layer(layer)
            outs.append(out)
            lses.append(lse)
        for i, r in enumerate(gw.remote):
            if r not in wire.remote_rows:
                continue
            buf = self.recv[r]
            gw.plane._run(gw.plane.group.recv([buf], i + 1, 0))
            torch.ne(buf[-TAG_BYTES:].view(torch.int64)[0], self.tags[layer], out=self.flags[layer, i])
            outs.append(buf[:self.out_bytes].view(gw.config.torch_dtype).view(self.shape_TQD))
            lses.append(buf[self.out_bytes:-TAG_BYTES].view(self.lse_dtype).view(self.shape_TQD[:2]))
        if len(outs) == 1:
            return outs[0]
        return merge_partials(torch.stack(outs), torch.stack(lses))[0]

    def _capture(self, wire, key: tuple) -> None:
        self.graphs, self.outputs, self.key = [], [], None
        self.make_buffers(wire)
        self.graphs, self.outputs = capture_graphs(self.gw.device, self.gw.config.num_layers,
                                                   lambda layer: self._layer(layer, wire))
        self.key = key
        logger.info("captured %d client decode graphs for bucket %s", len(self.graphs), key)

    def make_buffers(self, wire) -> None:
        """The buffers the graphs of ``wire``'s bucket read and write (``_layer`` runs from them; so does a CPU
        test, without capture)."""
        gw, cfg = self.gw, self.gw.config
        from cpattn.cluster.layer_runner import lse_wire_dtype

        t, device, dtype = wire.num_tokens, gw.device, cfg.torch_dtype
        hq, hk, d, num_layers = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.num_layers
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.lse_dtype = lse_wire_dtype(dtype)
        self.shape_TQD = (t, hq, d)
        self.message = torch.zeros(HEADER_BYTES + t * (hq + 2 * hk) * d * itemsize, dtype=torch.uint8, device=device)
        self.qkv = self.message[HEADER_BYTES:].view(dtype).view(t, hq + 2 * hk, d)
        self.q, self.k, self.v = self.qkv.split([hq, hk, hk], dim=1)
        self.headers = torch.tensor([[CMD_ATTEND, layer, 0, t] for layer in range(num_layers)], dtype=torch.int64,
                                    device=device)
        self.layer_ids = torch.arange(num_layers, dtype=torch.int64, device=device)
        self.tags = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.norms = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.flags = torch.zeros(num_layers, max(1, len(gw.remote)), dtype=torch.bool, device=device)
        self.out_bytes = t * hq * d * itemsize
        lse_bytes = t * hq * torch.empty(0, dtype=self.lse_dtype).element_size()
        self.recv = {r: torch.zeros(self.out_bytes + lse_bytes + TAG_BYTES, dtype=torch.uint8, device=device)
                     for r in wire.remote_rows}


def use_client_graphs(graphs: ClientLayerGraphs | None, wire, norms: torch.Tensor | None) -> None:
    """Every layer of the step (its gateway.StepWire) replays the client's graph where ``graphs`` serves it (their
    own NaN norms then, where the step has ``norms``)."""
    if graphs is not None and graphs.prepare(wire):
        # Broken flags come with remote partials only: reading unwritten ones costs a sync per step for nothing.
        wire.graphs, wire.broken = graphs, [graphs.flags] if graphs.gw.plane is not None else []
        wire.norms = None if norms is None else graphs.norms
