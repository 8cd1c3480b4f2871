"""The public face: ``start``, ``connect``, ``Service`` and ``Step``.

The client process is the data-plane gateway (rank 0 of its own group with the shards): per
layer it validates q/k/v, broadcasts them, gathers each shard's partial (out, natural-log LSE)
and merges them. Everything per step (validation, allocation, planning) goes through the
coordinator once; nothing per layer goes through Ray.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch

from cpattn.attention.merge import LseBase, merge_attn_states
from cpattn.cluster.data_plane import CMD_ABORT, CMD_ATTEND, DataPlane, create_group, make_store
from cpattn.cluster.service import ensure_ray, find_coordinator, launch_coordinator, stop_coordinator
from cpattn.config import ServiceConfig
from cpattn.errors import CpattnError, InvalidRequestError, ServiceError, ShardLostError

logger = logging.getLogger("cpattn")


def _call(ref, timeout_s: float, what: str):
    """ray.get with a timeout; our own errors come back as themselves, Ray's as ServiceError."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, CpattnError):
            raise cause from None
        raise ServiceError(f"{what} failed: {exc}") from exc
    except ray.exceptions.GetTimeoutError:
        raise ServiceError(f"{what} did not answer within {timeout_s}s (rpc_timeout_s): is the service overloaded "
                           "or hung? check `cpattn status`") from None
    except ray.exceptions.ActorUnavailableError as exc:
        raise ServiceError(f"{what}: the service is restarting an actor ({exc}); retry shortly") from exc
    except ray.exceptions.RayActorError as exc:
        raise ServiceError(f"{what}: the coordinator is gone ({type(exc).__name__}); restart the service") from exc


def start(config: ServiceConfig) -> "Service":
    """Start a service (a local embedded Ray instance unless ``config.ray_address``) and return its client."""
    started_ray = ensure_ray(config.ray_address, config.namespace,
                             num_cpus_hint=config.num_shards * config.num_cpus_per_shard)
    try:
        coordinator = launch_coordinator(config)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    try:
        return Service(coordinator, config, owns_service=True, owns_ray=started_ray)
    except BaseException:
        stop_coordinator(coordinator, config.rpc_timeout_s)
        if started_ray:
            ray.shutdown()
        raise


def connect(name: str = "cpattn", namespace: str = "cpattn", address: str | None = None,
            timeout_s: float = 60.0) -> "Service":
    """Attach to a running service; ``address`` defaults to the current Ray cluster ('auto')."""
    started_ray = ensure_ray(address or "auto", namespace) if not ray.is_initialized() else False
    coordinator = find_coordinator(name, namespace)
    described = _call(coordinator.describe.remote(), timeout_s, "coordinator.describe")
    config = ServiceConfig(**described["config"])
    return Service(coordinator, config, owns_service=False, owns_ray=started_ray)


MAX_RECOVERIES = 3


class _WireError(Exception):
    """A data-plane collective failed (a peer died, hung past the timeout, or the group broke)."""


class Service:
    """A client of one cpattn service. Not thread-safe: one open step at a time per client."""

    def __init__(self, coordinator, config: ServiceConfig, owns_service: bool, owns_ray: bool):
        self.config = config
        self._coordinator = coordinator
        self._owns_service = owns_service
        self._owns_ray = owns_ray
        self._step: Step | None = None
        self._closed = False
        self._plane: DataPlane | None = None
        self.last_step_timings: dict[str, float] = {}
        timeout = config.rpc_timeout_s
        self.client_id: str = _call(coordinator.register_client.remote(), timeout, "register_client")
        described = _call(coordinator.describe.remote(), timeout, "coordinator.describe")
        self.shard_infos: list[dict] = described["shards"]
        self._join_data_plane()

    @property
    def group_name(self) -> str:
        return f"{self.client_id}-e{self._epoch}"

    def _join_data_plane(self) -> None:
        """(Re)build this client's group with the current shards; rank 0 is this process."""
        cfg = self.config
        current = _call(self._coordinator.get_shards.remote(), cfg.rpc_timeout_s, "get_shards")
        self._epoch, self._shards = current["epoch"], current["shards"]
        world = cfg.num_shards + 1
        backend = cfg.resolved_data_plane()
        host = ray.util.get_node_ip_address()
        store = make_store(host, 0, world, True, cfg.collective_timeout_s)
        joins = [h.join_group.remote(self.group_name, host, store.port, rank + 1, world, backend)
                 for rank, h in enumerate(self._shards)]
        group = create_group(store, self.group_name, 0, world, backend, cfg.collective_timeout_s)
        _call(joins, cfg.rpc_timeout_s, "shards joining the data plane")
        self._store = store   # the store must outlive the group
        self._plane = DataPlane(group, 0, world, backend)

    def _rejoin(self) -> None:
        """After a shard was replaced: drop the broken group and join a new one."""
        old = self.group_name
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        for h in self._shards:
            try:
                h.leave_group.remote(old)
            except Exception:
                pass
        self._join_data_plane()

    # Sequences ------------------------------------------------------------------------------------
    def add_sequence(self) -> str:
        self._check_open()
        return _call(self._coordinator.add_sequence.remote(self.client_id), self.config.rpc_timeout_s, "add_sequence")

    def free(self, seq_id: str) -> None:
        self._check_open()
        _call(self._coordinator.free.remote(self.client_id, seq_id), self.config.rpc_timeout_s, "free")

    def sequences(self) -> dict[str, int]:
        """This client's sequences and their lengths."""
        return _call(self._coordinator.list_sequences.remote(self.client_id), self.config.rpc_timeout_s,
                     "list_sequences")

    def sequence_length(self, seq_id: str) -> int:
        return _call(self._coordinator.sequence_length.remote(seq_id), self.config.rpc_timeout_s, "sequence_length")

    def fill_synthetic(self, seq_id: str, num_tokens: int, seed: int = 0) -> int:
        """Append seeded random KV without attention (benchmarks and load tests); returns the new length.

        The KV written is ``cpattn.cluster.shard.synthetic_kv(seed, layer, 0, num_tokens, Hk, D, device)`` (the
        fill's tokens in order, drawn on the shards' device).
        """
        self._check_open()
        return _call(self._coordinator.fill_synthetic.remote(self.client_id, seq_id, num_tokens, seed),
                     self.config.rpc_timeout_s, "fill_synthetic")

    # Steps ----------------------------------------------------------------------------------------
    def step(self, request: dict[str, int]) -> "Step":
        """``with svc.step({seq_id: num_new_tokens}) as step: step.attend(layer, q, k, v)`` for every layer."""
        self._check_open()
        if self._step is not None:
            raise InvalidRequestError("a step is already open on this client: finish it before starting another "
                                      "(use a second client for concurrent steps)")
        return Step(self, dict(request) if isinstance(request, dict) else request)

    # Introspection and lifecycle -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return _call(self._coordinator.stats.remote(), self.config.rpc_timeout_s, "stats")

    def info(self) -> dict[str, Any]:
        return _call(self._coordinator.describe.remote(), self.config.rpc_timeout_s, "describe")

    def close(self) -> None:
        """Leave the service running; drop this client's data-plane group."""
        if self._closed:
            return
        self._closed = True
        for h in self._shards:
            try:
                h.leave_group.remote(self.group_name)
            except Exception:
                pass
        try:
            self._coordinator.unregister_client.remote(self.client_id)
        except Exception:
            pass
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        if self._owns_ray and not self._owns_service:
            ray.shutdown()

    def shutdown(self) -> None:
        """Stop the whole service (shards, placement group, coordinator); leaves nothing running."""
        was_closed = self._closed
        self._closed = True
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        stop_coordinator(self._coordinator, self.config.rpc_timeout_s, self.config)
        if self._owns_ray and ray.is_initialized() and not was_closed:
            ray.shutdown()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        if self._owns_service:
            self.shutdown()
        else:
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this client was closed or shut down: connect again with cpattn.connect()")


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
        if self._svc._step is not None:
            raise InvalidRequestError("a step is already open on this client: steps cannot nest")
        self._begin()
        self._state = "open"
        self._svc._step = self
        return self

    def _begin(self) -> None:
        svc = self._svc
        for _ in range(MAX_RECOVERIES + 1):
            info = _call(svc._coordinator.begin_step.remote(svc.client_id, svc.group_name, self._request, svc._epoch),
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
            raise _WireError(f"data plane: {type(exc).__name__}: {exc}") from exc
        partials = torch.stack(parts[1:]).to(packed.device)
        out, _ = _merge(partials[..., :d], partials[..., d], packed.device)
        self.timings["data_plane_s"] += t1 - t0
        self.timings["merge_s"] += time.perf_counter() - t1
        return out

    def _recover(self, why: str) -> None:
        """Roll the broken step back; if the service recovered every sequence of it, begin again and replay."""
        svc = self._svc
        try:
            _call(svc._coordinator.end_step.remote(self._info["step_id"], False, why),
                  svc.config.rpc_timeout_s + svc.config.start_timeout_s, "end_step")
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
                report = _call(svc._coordinator.end_step.remote(self._info["step_id"], True, None), timeout, "end_step")
            except BaseException:
                self._close("rolled_back")
                raise
            if not report.get("recovered"):
                break
            # A shard died after the last layer: the coordinator rolled the step back; do it again.
            self._restart(report["failure"])
        self._close("committed")
        self.timings["plan_s"] += report["plan_s"]
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
            report = _call(svc._coordinator.end_step.remote(self._info["step_id"], False, why),
                           svc.config.rpc_timeout_s + svc.config.start_timeout_s, "end_step")
            if report.get("recovered") or why is not None:
                svc._rejoin()
        except CpattnError:
            if raise_errors:
                raise


def _merge(outs_NTHD: torch.Tensor, lses_NTH: torch.Tensor, device: torch.device):
    if device.type == "cuda":
        try:
            from cpattn.attention.merge_triton import merge_partials

            return merge_partials(outs_NTHD, lses_NTH, LseBase.E)
        except ImportError:
            pass
    return merge_attn_states(outs_NTHD, lses_NTH, LseBase.E)


__all__ = ["Service", "Step", "start", "connect", "ShardLostError"]
