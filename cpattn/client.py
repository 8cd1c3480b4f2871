"""The public face: ``start``, ``connect`` and ``Service`` (``Step`` lives in cpattn.step).

The client's Gateway (cluster.gateway) owns its coordinator handle, data-plane group and the shards
it computes in-process; everything per step (validation, allocation, planning) goes through the
coordinator once; nothing per layer goes through Ray.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import ray

from cpattn.cluster.authority import new_operator_credential
from cpattn.cluster.gateway import Gateway
from cpattn.cluster.ids import canonical_id, canonical_request
from cpattn.cluster.rpc import call as _call
from cpattn.cluster.service import ensure_ray, find_coordinator, launch_coordinator, ray_for, stop_coordinator
from cpattn.config import ServiceConfig
from cpattn.config_groups import MAX_SECONDS
from cpattn.errors import AccessDeniedError, CpattnError, InvalidRequestError, ShardLostError
from cpattn.step import Step

logger = logging.getLogger("cpattn")


def start(config: ServiceConfig) -> "Service":
    """Start a service (a local embedded Ray instance unless ``config.ray_address``) and return its client,
    which holds the service's operator credential (``Service.operator_credential``)."""
    with ray_for(config) as started_ray:
        operator_credential = new_operator_credential()
        coordinator = launch_coordinator(config, operator_credential)
        try:
            return Service(coordinator, config, owns_service=True, owns_ray=started_ray,
                           operator_credential=operator_credential)
        except BaseException:
            stop_coordinator(coordinator, config.rpc_timeout_s, operator_credential=operator_credential)
            raise


def connect(name: str = "cpattn", namespace: str = "cpattn", address: str | None = None,
            timeout_s: float = 60.0, on_lapse: str = "free", credential: str | None = None,
            operator_credential: str | None = None) -> "Service":
    """Attach to a running service; ``address`` defaults to the current Ray cluster ('auto').

    ``on_lapse``: what happens to this client's sequences if it dies without close() (its lease lapses after
    client_lease_s): "free" (default) or "keep". close() always keeps them. ``credential``: the
    ``Service.credential`` of a client that ended with sequences kept resumes that client (and its sequences).
    ``operator_credential``: the service's (printed by `cpattn serve`), for ``shutdown()`` and ``stats(admin=True)``.
    """
    _check_connect_args(name, namespace, timeout_s)
    started_ray = ensure_ray(address or "auto", namespace) if not ray.is_initialized() else False
    coordinator = find_coordinator(name, namespace)
    registered = _call(coordinator.register_client.remote(on_lapse, credential), timeout_s, "register_client")
    config = ServiceConfig(**registered["config"])
    return Service(coordinator, config, owns_service=False, owns_ray=started_ray, on_lapse=on_lapse,
                   credential=credential, operator_credential=operator_credential, registered=registered)


def _check_connect_args(name, namespace, timeout_s) -> None:
    for what, value in (("name", name), ("namespace", namespace)):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"connect(): {what} {value!r} must be the service's {what}, a non-empty str "
                                      "(`cpattn list` shows every service on the cluster)")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s)
            or not 0 < timeout_s <= MAX_SECONDS):
        raise InvalidRequestError(f"connect(): timeout_s {timeout_s!r} must be a number of seconds in "
                                  f"(0, {MAX_SECONDS:g}]")


class Service:
    """A client of one cpattn service, used by one thread: one open step at a time. A second thread opening
    a step (or attending another thread's) is refused with InvalidRequestError; give each thread its own
    ``cpattn.connect()``."""

    def __init__(self, coordinator, config: ServiceConfig, owns_service: bool, owns_ray: bool,
                 on_lapse: str = "free", credential: str | None = None, operator_credential: str | None = None,
                 registered: dict | None = None):
        self.config = config
        self._owns_service = owns_service
        self._owns_ray = owns_ray
        self._closed = False
        self.operator_credential = operator_credential
        """The service's operator credential when this process started it (or passed it to connect()): stops the
        service and reads admin stats. Never share it."""
        self.gateway = Gateway(coordinator, config, on_lapse, credential, registered)
        self.client_id: str = self.gateway.client_id
        self.shard_infos: list[dict] = self.info()["shards"]

    @property
    def credential(self) -> str:
        """This client's secret: every call proves it; ``connect(credential=...)`` resumes the client after it
        ended with sequences kept (close(), or on_lapse='keep'). Never share it."""
        return self.gateway.credential

    @property
    def last_step_timings(self) -> dict[str, float]:
        """Timings (seconds) of the last step whose commit was confirmed: plan_s, data_plane_s, attention_s."""
        return self.gateway.last_step_timings

    # Sequences ------------------------------------------------------------------------------------
    def add_sequence(self) -> str:
        self._check_open()
        return self.gateway.call("add_sequence")

    def free(self, seq_id: str) -> None:
        self._check_open()
        self.gateway.call("free", canonical_id(seq_id))
        self.gateway.pages.forget(canonical_id(seq_id))

    def fork(self, seq_id: str, num_tokens: int | None = None) -> str:
        """A new sequence whose first ``num_tokens`` tokens (default: all) are ``seq_id``'s, sharing its KV pages on
        every shard: no prefill, no copy. Either may go on independently (a write into a shared page copies that
        page first) and freeing one leaves the other intact."""
        self._check_open()
        return self.gateway.call("fork", canonical_id(seq_id), num_tokens)

    def share(self, seq_id: str, num_tokens: int | None = None, ttl_s: float = 3600.0) -> str:
        """A token that lets another client of this service ``fork_shared`` the first ``num_tokens`` (default: its
        length now) of this client's ``seq_id``, for ``ttl_s`` seconds or until ``seq_id`` is freed. Nothing of
        the sequence is visible to other clients without it."""
        self._check_open()
        return self.gateway.call("share", canonical_id(seq_id), num_tokens, ttl_s)

    def fork_shared(self, token: str) -> str:
        """A new sequence of this client holding the prefix another client granted with ``share``."""
        self._check_open()
        return self.gateway.call("fork_shared", token)

    def sequences(self) -> dict[str, int]:
        """This client's sequences and their lengths."""
        return self.gateway.call("list_sequences")

    def sequence_length(self, seq_id: str) -> int:
        return self.gateway.call("sequence_length", canonical_id(seq_id))

    def fill_synthetic(self, seq_id: str, num_tokens: int, seed: int = 0) -> int:
        """Append seeded random KV without attention (benchmarks and load tests); returns the new length.

        The KV written is ``cpattn.cluster.shard_kv.synthetic_kv(seed, layer, 0, num_tokens, Hk, D, device)`` (the
        fill's tokens in order, drawn on the shards' device). Where every layer is windowed, the pages before the
        window go back when a fill commits, not during it: fill a prefix longer than the cache in pieces that fit
        (examples/long_context_job.py fills in chunks).
        """
        self._check_open()
        return self.gateway.call("fill_synthetic", canonical_id(seq_id), num_tokens, seed)

    # Steps ----------------------------------------------------------------------------------------
    def step(self, request: dict[str, int]) -> "Step":
        """``with svc.step({seq_id: num_new_tokens}) as step: step.attend(layer, q, k, v)`` for every layer."""
        self._check_open()
        self.gateway.check_no_open_step()
        return Step(self.gateway, canonical_request(request) if isinstance(request, dict) else request)

    def decode_graph(self, seq_ids: list[str], forward, allow_eager: bool = False):
        """A decode batch (every sequence of ``seq_ids`` one new token per step) whose ``forward(step)`` (the model's
        whole decode forward, ``step.attend(layer, q, k, v)`` per layer) is captured in one CUDA graph and replayed
        per ``graph.step()`` (cpattn/decode_graph.py). BackendUnavailableError, with every reason, where this
        service's steps cannot be captured (unless ``allow_eager``: then they run eagerly); eager on a CPU client."""
        from cpattn.decode_graph import DecodeGraph

        self._check_open()
        return DecodeGraph(self, seq_ids, forward, allow_eager=allow_eager)

    # Introspection and lifecycle -----------------------------------------------------------------
    def stats(self, admin: bool = False) -> dict[str, Any]:
        """Usage: ``clients`` lists this client only, others are counted in ``other_clients``; ``admin=True``
        lists every client by its public id (an operator's view: needs ``operator_credential``)."""
        if not admin:
            return self.gateway.call("stats", admin)
        self._check_operator("stats(admin=True) lists every client")
        self.gateway.flush(end_run=True)
        return self._admin_stats("stats(admin=True)")

    def info(self) -> dict[str, Any]:
        self.gateway.flush()
        return _call(self.gateway.coordinator.describe.remote(self.gateway.credential), self.config.rpc_timeout_s,
                     "describe")

    def close(self) -> None:
        """Leave the service running; drop this client's data-plane group (after its last commit)."""
        if self._closed:
            return
        self._closed = self.gateway.ended = True
        self.gateway.close()
        if self._owns_ray and not self._owns_service:
            ray.shutdown()

    def shutdown(self) -> None:
        """Stop the whole service (shards, placement group, coordinator); leaves nothing running. The operator
        only: a client without ``operator_credential`` is refused (AccessDeniedError) and stays connected."""
        self._check_operator("shutdown() stops the whole service", "close() ends just this client")
        if not self._closed:   # a refused credential must leave this client as it was: asked before anything ends
            try:
                self._admin_stats("shutdown()")
            except AccessDeniedError:
                raise
            except CpattnError:   # a dead or hung coordinator: stopped below all the same
                pass
        was_closed = self._closed
        self._closed = self.gateway.ended = True
        if not was_closed:
            try:
                self.gateway.flush(end_run=True)
            except CpattnError as exc:
                logger.warning("shutting down: %s", exc)
        self.gateway.stop_threads()
        self.gateway.leave()
        stop_coordinator(self.gateway.coordinator, self.config.rpc_timeout_s, self.config, self.operator_credential)
        if self._owns_ray and ray.is_initialized() and not was_closed:
            ray.shutdown()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        if self._owns_service:
            self.shutdown()
        else:
            self.close()

    def _check_operator(self, what: str, instead: str = "") -> None:
        if self.operator_credential is None:
            raise AccessDeniedError(f"{what}: only the operator may (this client was not started by cpattn.start; "
                                    "pass operator_credential= to connect(), or use `cpattn stop` / `cpattn status`)"
                                    + (f", {instead}" if instead else ""))

    def _admin_stats(self, what: str) -> dict[str, Any]:
        try:
            return _call(self.gateway.coordinator.stats.remote(self.operator_credential, True),
                         self.config.rpc_timeout_s, "stats")
        except AccessDeniedError:
            raise AccessDeniedError(f"{what} refused: operator_credential is not this service's operator "
                                    "credential (printed by `cpattn serve`; Service.operator_credential of "
                                    "cpattn.start)") from None

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequestError("this client was closed or shut down: connect again with cpattn.connect()")


__all__ = ["Service", "Step", "start", "connect", "ShardLostError"]
