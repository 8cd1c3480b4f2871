"""A model's whole decode forward in one CUDA graph, cpattn's attend calls included (``svc.decode_graph``).

    graph = svc.decode_graph(seq_ids, forward)   # forward(step) -> tensor(s); step.attend(layer, q, k, v) per layer
    for token in range(n):
        static_ids.copy_(next_ids)               # the model's inputs: tensors forward reads, refilled per token
        logits = graph.step()                    # one decode step: every sequence + 1 token; the same tensors back

A declared uniform decode batch (every sequence of ``seq_ids`` one new token per step, in that order) has a fixed
shape, so its forward can be captured once and replayed per token, as vLLM's full CUDA graphs are (its
CUDAGraphWrapper wraps a runnable the same way: eager warm-up, capture, replay per batch-size bucket).
Each ``step()`` is one cpattn step, with a step's usual life: begun outside the graph (a decode run's next step,
or a plan from the coordinator), which refills every buffer the recorded attend work reads (slots, block tables,
key counts, the step id of the headers; cluster/user_graphs.py); committed when it ends, rolled back when it
fails (NaN/inf in q|k|v, a lost shard, a fenced or lapsed client: the documented errors; nothing of the step
reaches the KV cache). Inside the graph attend does no host sync, no Ray call, no allocation outside the graph's
pool; remote shards replay their own step graph (or serve eagerly) with the same NCCL operations in order.

Which step does what: the first ``step()`` runs ``forward`` eagerly (the model's warm-up; the public ``Step``);
a step whose client work is the service's graphed decode layer (CUDA, a backend declaring at least
UNIFORM_SINGLE_TOKEN_DECODE with graph hooks, the in-process shards' decode graphs on, NCCL to remote shards; not the
first step of a bucket)
captures ``forward`` and replays it once; later steps replay. A step the recording does not fit (the batch's
bucket moved as the context grew: a power of two of its block table or its KV splits; a rejoin after a shard
loss) runs eagerly or captures again. ``forward``'s outputs are copied into tensors made at the first step, so
every ``step()`` returns the same tensors (valid until the next step). On a CPU client nothing is captured:
every step runs ``forward`` eagerly with the same contract (``mode == "eager"``), so the same code runs anywhere.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

import torch

from cpattn.cluster.graph_capture import capture_graphs
from cpattn.cluster.ids import canonical_request
from cpattn.cluster.user_graphs import CapturedLayers, capturable, capture_refusals
from cpattn.errors import BackendUnavailableError, IncompleteStepError, InvalidRequestError
from cpattn.step_inputs import check_layer, check_qkv

logger = logging.getLogger("cpattn")

Outputs = "torch.Tensor | tuple[torch.Tensor, ...]"


class CapturingStep:
    """What ``forward`` gets while its step is recorded: ``attend`` records the layer's client work into the graph
    (nothing runs until the replay) and returns its output, a tensor of the graph's pool."""

    def __init__(self, step, layers: CapturedLayers):
        self._step = step
        self._layers = layers
        self.attended: set[int] = set()

    @property
    def seq_ids(self) -> list[str]:
        return self._step.seq_ids

    @property
    def num_tokens(self) -> int:
        return self._step.num_tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        gw = self._layers.gw
        if sinks is not None:
            raise InvalidRequestError("sinks are not supported in a captured decode step: run such a model with "
                                      "svc.step(...) (eagerly)")
        check_layer(gw.config, layer, self.attended, in_order=True)   # a graph replays its layers in order
        # NaN/inf: checked on the device (norms recorded in the graph), read once when the step ends.
        check_qkv(gw.config, self.num_tokens, q, k, v, check_finite=False)
        if q.device != gw.device:
            raise InvalidRequestError(f"q is on {q.device}, the service's client on {gw.device}: run the model there")
        out = self._layers.record(layer, q, k, v)
        self.attended.add(layer)
        return out


class _CaptureFailed(Exception):
    """Raised out of a step whose capture failed, so the step rolls back before an eager one runs."""


class DecodeGraph:
    """One declared decode batch whose forward is captured in a CUDA graph; ``step()`` per token."""

    def __init__(self, service, seq_ids: list[str], forward: Callable[[Any], Any], allow_eager: bool = False):
        if isinstance(seq_ids, str) or not isinstance(seq_ids, (list, tuple)) or not seq_ids:
            raise InvalidRequestError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
        if not callable(forward):
            raise InvalidRequestError(f"forward must be callable as forward(step), got {type(forward).__name__}")
        if not all(isinstance(sid, str) for sid in seq_ids) or len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequestError(f"seq_ids must be distinct sequence ids (str), got {list(seq_ids)!r}")
        self.request = canonical_request({sid: 1 for sid in seq_ids})
        self.svc = service
        self.forward = forward
        gw = service.gateway
        self.reasons = capture_refusals(service.config, gw.device, [i.get("backend") for i in service.shard_infos],
                                        gw.plane.backend if gw.plane is not None else None, gw.local_graphs)
        """Why steps are not captured ({} when they are); on a CPU client they always run eagerly."""
        if self.reasons and gw.device.type == "cuda" and not allow_eager:
            raise BackendUnavailableError("this service's decode steps cannot be captured in a CUDA graph (pass "
                                          "allow_eager=True to run them eagerly with the same contract)",
                                          self.reasons)
        if self.reasons:
            logger.info("decode graph runs eagerly: %s", self.reasons)
        self.mode = "eager" if self.reasons else "cuda_graph"
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}
        """Committed steps by how they ran (``captured``: recorded, then replayed once)."""
        self.last: str | None = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._single = True
        self.graph: torch.cuda.CUDAGraph | None = None
        self.layers: CapturedLayers | None = None
        self.disabled = False
        self.closed = False
        gw.user_graphs.add(self)   # released before the data-plane group they hold NCCL work of is left

    # Per token ---------------------------------------------------------------------------------------------------
    def step(self) -> Outputs:
        """One decode step of the declared batch; forward's outputs, in the same tensors at every step."""
        if self.closed:
            raise InvalidRequestError("this decode graph was closed: make a new one with svc.decode_graph(...)")
        try:
            how = self._step()
        except _CaptureFailed:   # rolled back; this step runs again, eagerly
            how = self._step()
        self.counts[how] += 1
        self.last = how
        return self.outputs[0] if self._single else self.outputs

    def _step(self) -> str:
        gw = self.svc.gateway
        with self.svc.step(self.request) as step:
            wire = step._run.wire
            if self.mode != "cuda_graph" or self.disabled or not self.counts["eager"] or not capturable(gw, wire):
                self._keep(self.forward(step))
                return "eager"
            if self.graph is not None and self.layers.matches(wire):
                self._replay(step)
                return "replayed"
            self._capture(step)
            return "captured"

    def _replay(self, step) -> None:
        self.graph.replay()
        step._run.graph_replayed()

    def _capture(self, step) -> None:
        gw = self.svc.gateway
        self.release()
        layers = CapturedLayers(gw, step._run.wire)
        capturing = CapturingStep(step, layers)
        try:
            graphs, _ = capture_graphs(gw.device, 1, lambda _: self._keep(self.forward(capturing)))
        except RuntimeError as exc:   # an operation of the model or ours that cannot be captured: stay eager
            logger.warning("decode graph capture failed (%s); decode steps run eagerly", exc)
            self.disabled = True
            raise _CaptureFailed() from exc
        if len(capturing.attended) != gw.config.num_layers:
            missing = sorted(set(range(gw.config.num_layers)) - capturing.attended)
            raise IncompleteStepError(f"the captured forward attended {len(capturing.attended)} of "
                                      f"{gw.config.num_layers} layers (never {missing}): call step.attend for every "
                                      "layer; the step was rolled back", missing)
        self.graph, self.layers = graphs[0], layers
        logger.info("captured a decode graph of %d sequences", len(self.request))
        self._replay(step)

    def _keep(self, outs) -> None:
        """forward's outputs into the static ones (made at the first step; inside a capture the copies are
        recorded, so each replay refreshes them)."""
        single = isinstance(outs, torch.Tensor)
        flat = (outs,) if single else tuple(outs) if isinstance(outs, (tuple, list)) else None
        if flat is None or not flat or not all(isinstance(o, torch.Tensor) for o in flat):
            raise InvalidRequestError(f"forward must return a tensor or a tuple of tensors, got {type(outs).__name__}")
        if self.outputs is None:
            self.outputs, self._single = tuple(o.detach().clone() for o in flat), single
            return
        if [(o.shape, o.dtype) for o in flat] != [(s.shape, s.dtype) for s in self.outputs]:
            raise InvalidRequestError("forward returned outputs of other shapes or dtypes than at the first step "
                                      f"({[tuple(o.shape) for o in flat]} vs {[tuple(s.shape) for s in self.outputs]}): "
                                      "a decode graph's outputs keep one shape")
        for static, o in zip(self.outputs, flat):
            static.copy_(o)

    # Lifecycle ---------------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the captured graph (and the NCCL work recorded in it) and wait until none runs; the next step
        that fits captures again."""
        if self.graph is None:
            return
        self.graph, self.layers = None, None
        gc.collect()
        gw = self.svc.gateway
        if gw.device.type == "cuda":
            torch.cuda.synchronize(gw.device)

    def close(self) -> None:
        self.release()
        self.closed = True
        self.svc.gateway.user_graphs.discard(self)

