"""A step: one set of sequences advancing together, attended layer by layer over the data plane.

The client process is rank 0 of its data-plane group: per layer it validates q/k/v, broadcasts them
with a small header, gathers every shard's partial (out | natural-log LSE) and merges them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from cpattn.attention.merge import LseBase
from cpattn.attention.merge_triton import merge_partials
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND
from cpattn.cluster.rpc import call as _call
from cpattn.cluster.rpc import call_across_restart
from cpattn.errors import CpattnError, InvalidRequestError, ServiceError

if TYPE_CHECKING:
    from cpattn.client import Service

logger = logging.getLogger("cpattn")

MAX_RECOVERIES = 3


class _WireError(Exception):
    """A data-plane collective failed (a peer died, hung past the timeout, or the group broke)."""


class Step:
    """One step of a set of sequences; commits when every layer was attended, else rolls back.

    With kv_replicas=2 a step survives a shard loss: the coordinator replaces and refills the shard,
    this client rebuilds its group, begins the step again and replays the layers already attended
    (their outputs are identical, since the restored KV is), so the caller sees only latency.
    """

    def __init__(self, service: Service, request: dict[str, int]):
        self._svc = service
        self._request = request
        self._info: dict | None = None
        self._attended: set[int] = set()
        self._state = "new"   # new -> open -> committed | rolled_back
        self._replay: list[tuple[int, torch.Tensor]] | None = [] if service.config.kv_replicas == 2 else None
        self.recoveries = 0
        self.timings = {"plan_s": 0.0, "data_plane_s": 0.0, "attention_s": 0.0, "merge_s": 0.0}

    @property
    def num_tokens(self) -> int:
        return self._info["num_tokens"] if self._info else sum(self._request.values())

    @property
    def seq_ids(self) -> list[str]:
        return list(self._info["seq_ids"]) if self._info else list(self._request)

    def __enter__(self) -> "Step":
        if self._state != "new":
            raise InvalidRequestError(f"this step is {self._state}: start a new one with svc.step(...)")
        svc = self._svc
        with svc._step_guard:   # issue 12: check-and-claim atomically; a second thread is refused here
            if svc._step is not None:
                raise InvalidRequestError("a step is already open on this client: steps cannot nest, and a client "
                                          "serves one thread (give each thread its own cpattn.connect())")
            svc._step = self
        try:
            if svc._plane_broken:   # issue 12: a collective failed earlier; rebuild the group first
                svc._rejoin()
            self._begin()
        except BaseException:
            svc._step = None
            raise
        self._state = "open"
        self._thread = threading.get_ident()
        return self

    def _begin(self) -> None:
        svc = self._svc
        for _ in range(MAX_RECOVERIES + 1):
            info = _call(svc._coordinator.begin_step.remote(svc._credential, svc.group_name, self._request, svc._epoch),
                         svc.config.rpc_timeout_s + svc.config.start_timeout_s, "begin_step")
            if "rejoin" not in info:
                self._info = info
                self.timings["plan_s"] += info["plan_s"]
                return
            svc._rejoin()
        raise ServiceError("the service kept replacing shards while this step began; check `cpattn status`")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of this step's tokens for one layer: q [T, Hq, D], k/v [T, Hk, D] -> out [T, Hq, D]."""
        if self._state != "open":
            raise InvalidRequestError(f"attend() needs an open step (this one is {self._state}): "
                                      "use it inside `with svc.step(...) as step:`")
        if threading.get_ident() != self._thread:   # issue 12: a client (and its step) is one-thread
            raise InvalidRequestError("attend() from a thread other than the one that opened the step: a client "
                                      "serves one thread (give each thread its own cpattn.connect())")
        self._validate(layer, q, k, v)
        packed = torch.cat([q, k, v], dim=1)
        for _ in range(MAX_RECOVERIES + 1):
            try:
                out = self._wire_attend(layer, packed)
                break
            except _WireError as exc:
                self._recover(str(exc))
        else:
            self._fail_closed(f"layer {layer} failed after {MAX_RECOVERIES} shard recoveries")
        if self._replay is not None:
            self._replay.append((layer, packed))
        self._attended.add(layer)
        return out.to(q.dtype)

    def _wire_attend(self, layer: int, packed: torch.Tensor) -> torch.Tensor:
        cfg = self._svc.config
        plane = self._svc._plane
        t, hq, d = self.num_tokens, cfg.num_q_heads, cfg.head_size
        wire_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        try:
            t0 = time.perf_counter()
            plane.send_layer(CMD_ATTEND, layer, self._info["step_id"], packed)
            parts = plane.gather(torch.zeros(t, hq, d + 1, dtype=wire_dtype, device=packed.device))
            t1 = time.perf_counter()
        except Exception as exc:
            self._svc._plane_broken = True   # issue 12: the group is unusable after any collective failure
            raise _WireError(f"data plane: {type(exc).__name__}: {exc}") from exc
        partials = torch.stack(parts[1:]).to(packed.device)
        out, _ = merge_partials(partials[..., :d], partials[..., d], LseBase.E)
        self.timings["data_plane_s"] += t1 - t0
        self.timings["merge_s"] += time.perf_counter() - t1
        return out

    def _recover(self, why: str) -> None:
        """Roll the broken step back; if the service recovered every sequence of it, begin again and replay."""
        svc = self._svc
        try:
            self._end_step(False, why, svc.config.rpc_timeout_s + svc.config.start_timeout_s)
        except BaseException:
            self._close("rolled_back")
            raise
        self._restart(why)

    def _restart(self, why: str) -> None:
        """After the coordinator rolled this step back and replaced a shard: rejoin, begin again, replay."""
        svc = self._svc
        if self._replay is None:
            self._close("rolled_back")
            svc._rejoin()
            raise ServiceError(f"step {self._info['step_id']} was rolled back: {why}; the lost shard was replaced "
                               "and no sequence of this step lost KV: run the step again "
                               "(kv_replicas=2 replays it automatically)")
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            self._fail_closed(f"step gave up after {MAX_RECOVERIES} shard recoveries ({why})")
        logger.warning("step %s: %s; shard replaced, replaying %d layers", self._info["step_id"], why,
                       len(self._replay))
        svc._rejoin()
        self._begin()
        for layer, packed in self._replay:
            try:
                self._wire_attend(layer, packed)
            except _WireError as exc:
                self._recover(str(exc))   # bounded by MAX_RECOVERIES through self.recoveries
                return

    def _fail_closed(self, why: str) -> None:
        svc = self._svc
        self._close("rolled_back")
        try:
            _call(svc._coordinator.end_step.remote(self._info["step_id"], False, why), svc.config.rpc_timeout_s,
                  "end_step")
        except CpattnError:
            pass
        raise ServiceError(why)

    def _end_step(self, commit: bool, why: str | None, timeout: float) -> dict:
        """end_step, asked again across a detached coordinator's restart (issue 12): the restarted one knows
        from its journal whether the step committed, else raises StepFencedError (run the step again)."""
        svc = self._svc
        step_id = self._info["step_id"]
        return call_across_restart(lambda: svc._coordinator.end_step.remote(step_id, commit, why, svc._credential),
                                   timeout, "end_step",
                                   svc.config.rpc_timeout_s if svc.config.detached else 0.0)

    def _validate(self, layer, q, k, v) -> None:
        cfg = self._svc.config
        t, hq, hk, d = self.num_tokens, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_layers:
            raise InvalidRequestError(f"layer {layer!r} out of range: use an int in 0..{cfg.num_layers - 1}")
        if layer in self._attended:
            raise InvalidRequestError(f"layer {layer} was already attended in this step: each layer once per step")
        for name, x, heads in (("q", q, hq), ("k", k, hk), ("v", v, hk)):
            if not isinstance(x, torch.Tensor):
                raise InvalidRequestError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.layout != torch.strided:   # issue 12: sparse tensors failed later with NotImplementedError
                raise InvalidRequestError(f"{name} is a {x.layout} tensor: pass a dense one ({name}.to_dense())")
            if tuple(x.shape) != (t, heads, d):
                raise InvalidRequestError(f"{name} has shape {tuple(x.shape)}, expected {(t, heads, d)} "
                                          f"(T = {t} new tokens in this step, heads, head_size)")
            if x.dtype != cfg.torch_dtype:
                raise InvalidRequestError(f"{name} has dtype {x.dtype}, the service runs {cfg.dtype}: "
                                          f"convert with .to(torch.{cfg.dtype})")
            if x.device != q.device:
                raise InvalidRequestError(f"{name} is on {x.device} but q is on {q.device}: put q, k, v on one device")
            if x.device.type not in ("cpu", "cuda"):
                # meta/other devices hold no data to send: they would fail deep inside the data plane.
                raise InvalidRequestError(f"{name} is on {x.device}: q, k and v must be CPU or CUDA tensors")
            if cfg.nan_policy == "reject" and not bool(torch.isfinite(x).all()):
                raise InvalidRequestError(f"{name} holds NaN or inf; they would poison the KV cache "
                                          "(set nan_policy='allow' to accept them)")

    def _close(self, state: str) -> None:
        self._state = state
        self._svc._step = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "open":
            return
        svc = self._svc
        timeout = svc.config.rpc_timeout_s + svc.config.start_timeout_s
        if exc_type is not None or len(self._attended) != svc.config.num_layers:
            if exc_type is None:
                logger.warning("step %s rolled back: %d of %d layers attended (a step commits only when every "
                               "layer was)", self._info["step_id"], len(self._attended), svc.config.num_layers)
            self._abort(raise_errors=exc_type is None)
            return
        while True:
            # The shards ended the step after the last layer; the coordinator commits it.
            try:
                report = self._end_step(True, None, timeout)
            except BaseException:
                self._close("rolled_back")
                raise
            if not report.get("recovered"):
                break
            # A shard died after the last layer: the coordinator rolled the step back; do it again.
            self._restart(report["failure"])
        self._close("committed")
        self.timings["plan_s"] += report["shard_plan_s"]   # the coordinator's share came with begin_step
        self.timings["attention_s"] = report["attention_s"]
        svc.last_step_timings = dict(self.timings)

    def _abort(self, raise_errors: bool) -> None:
        """Roll back: tell the shards, then the coordinator. Errors surface only if nothing else is raising."""
        svc = self._svc
        why = None
        cfg = svc.config
        try:
            # After the last layer the shards have already left the step: an ABORT then would be read
            # as the next step's first layer and desynchronise the group.
            if len(self._attended) < cfg.num_layers:
                unused = torch.empty(self.num_tokens, cfg.num_q_heads + 2 * cfg.num_kv_heads, cfg.head_size,
                                     dtype=cfg.torch_dtype)
                svc._plane.send_layer(CMD_ABORT, -1, self._info["step_id"], unused)
        except Exception as wire_exc:
            why = f"data plane: {type(wire_exc).__name__}: {wire_exc}"
        self._close("rolled_back")
        try:
            report = self._end_step(False, why, svc.config.rpc_timeout_s + svc.config.start_timeout_s)
            if report.get("recovered") or why is not None:
                svc._rejoin()
        except CpattnError:
            if raise_errors:
                raise
