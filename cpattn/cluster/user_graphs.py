"""A decode step's client work recorded into the user's own CUDA graph (cpattn.decode_graph.DecodeGraph).

Runs in: the client. Legend: T tokens (= sequences: a decode-only step), L layers.
A model that captures its whole decode forward in one graph (as vLLM does) records each layer's attend here:
the very operations the service's own graphs replay, on their buffers: the client's layer
(cluster.client_graphs.ClientLayerGraphs._layer: header and q|k|v broadcast where shards are remote, NaN norm,
in-process shards' KV write and attention, the remote partials' receives, the merge). Nothing new runs on the
device; only the q|k|v copies move from outside the graph (ClientLayerGraphs.run) into it.

Per step everything the recorded work reads is refilled by the step's begin, outside the graph: the in-process
shards' slots, block tables and key counts (DecodeGraphs.prepare), the headers' step id, the partials'
expected tags and flags (ClientLayerGraphs.prepare); the remote shards replay their own step
graph (cluster.shard_graphs) or serve the layers eagerly, with the same NCCL operations in the same order.
A recorded step is valid while those buffers are the same objects: ``matches`` checks that at each replay
(a new bucket, a rejoin or a recapture of the service's graphs replaces them, and the user's graph is
captured again). The recorded buffers are held here, so their addresses are never reused under the graph.
"""

from __future__ import annotations

import torch

from cpattn.attention import AttentionCGSupport
from cpattn.attention.selector import chosen_backend_class
from cpattn.kvstore.fp8 import is_fp8

NEEDED = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
"""A declared decode batch (every sequence one new token) is the seed's uniform single-token decode."""
GRAPH_HOOKS = ("graph_key", "make_static", "refill")


def capture_refusals(config, device: torch.device, backend_names: list[str | None], plane_backend: str | None,
                     local_graphs: dict | None = None) -> dict[str, list[str]]:
    """Every reason this client's decode steps cannot be recorded in a user's CUDA graph ({} when they can):
    ``backend_names`` are the shards' backends (describe()["shards"]), ``plane_backend`` the data plane to the
    remote shards (None when every shard is computed in this process), ``local_graphs`` the decode graphs of the
    shards computed in this process (Gateway.local_graphs: None where DecodeGraphs.supported said no)."""
    reasons: dict[str, list[str]] = {}
    service = reasons.setdefault("service", [])
    if device.type != "cuda":
        service.append(f"the client's device is {device}: CUDA graphs need a CUDA device")
    if config.cuda_graphs != "auto":
        service.append("cuda_graphs is 'off': set cuda_graphs='auto'")
    off = sorted(r for r, g in (local_graphs or {}).items() if g is None)
    if off and not service:
        fp8 = f" (kv_cache_dtype {config.kv_cache_format})" if is_fp8(config.kv_cache_format) else ""
        service.append(f"the shards computed in this process ({off}) have no decode graphs for this "
                       f"configuration{fp8}: cluster/decode_graphs.DecodeGraphs.supported")
    if plane_backend is not None and plane_backend != "nccl":
        service.append(f"remote shards are reached over {plane_backend} (they read a header per layer on the host): "
                       "give each shard a GPU of its own so the data plane is NCCL, or place them on this GPU")
    for name in sorted({n for n in backend_names if n is not None}):
        cls = chosen_backend_class(name)
        level = cls.cudagraph_support
        why = []
        if level < NEEDED:
            why.append(f"declares CUDA-graph support {level.name}; a decode step needs {NEEDED.name} or higher: "
                       "choose backend='TRITON'")
        else:
            builder = cls.get_builder_cls()
            missing = [h for h in GRAPH_HOOKS if not hasattr(builder, h)]
            if missing:
                why.append(f"declares {level.name} but its builder lacks {', '.join(missing)} (refilling a step's "
                           "metadata at fixed addresses): choose backend='TRITON'")
        if why:
            reasons[name] = why
    return {k: v for k, v in reasons.items() if v}


def capturable(gateway, wire) -> bool:
    """Whether this begun step's client work is the service's graphed decode layer (else it runs eagerly:
    the first step of a bucket, copy on write, shared-prefix passes, row subsets)."""
    return gateway.device.type == "cuda" and wire.graphs is not None   # ClientLayerGraphs.prepare checked them


class CapturedLayers:
    """The buffers one recording reads; ``record`` per layer inside the capture, ``matches`` per replayed step,
    outside it."""

    def __init__(self, gateway, wire):
        self.gw = gateway
        self.wire = wire            # the capture step's: ClientLayerGraphs._layer walks its shards
        self.client = wire.graphs   # its ClientLayerGraphs (every recorded layer writes its NaN norm there)
        self.held = self._buffers(wire)

    @staticmethod
    def _buffers(wire) -> list:
        """Every object whose addresses the recorded work reads, with the keys that fixed their shapes."""
        c = wire.graphs
        held = [c, c.key, c.message, c.headers, c.tags, c.norms, c.flags]
        for r, buf in sorted(c.recv.items()):
            held += [r, buf]
        for r, s in sorted(wire.local.items()):
            g = s.graphs
            held += [r, g, g.key, g.static, g.qkv, g.replica, getattr(g, "written", None)]
        return held

    def matches(self, wire) -> bool:
        """The step's buffers are the recorded ones (identity; keys and ranks by value)."""
        now = self._buffers(wire)
        return len(now) == len(self.held) and all(
            a is b or (type(a) is type(b) and isinstance(a, (int, tuple)) and a == b) for a, b in zip(self.held, now))

    def record(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's client work, inside the user's capture: out [T, Q, D] in the graph's memory pool."""
        c = self.client
        c.q.copy_(q)
        c.k.copy_(k)
        c.v.copy_(v)
        return c._layer(layer, self.wire)

