"""A step: one set of sequences advancing together, attended layer by layer.

The client's Gateway does the per-layer work (remote shards over the data plane, shards on the
client's GPU in-process, merge on the client's device); a Step holds the step's lifecycle: begin,
validation, commit or rollback, and recovery after a shard loss.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray
import torch

from cpattn.cluster.data_plane import CMD_ATTEND, WireError
from cpattn.cluster.rpc import call as _call
from cpattn.errors import CpattnError, IncompleteStepError, InvalidRequestError, ServiceError
from cpattn.step_inputs import check_layer, check_qkv, checked_sinks

if TYPE_CHECKING:
    from cpattn.cluster.client_run import BegunStep
    from cpattn.cluster.gateway import Gateway, PendingCommit, StepWire
    from cpattn.cluster.messages import EndStepReply

logger = logging.getLogger("cpattn")

MAX_RECOVERIES = 3


class Step:
    """One step of a set of sequences; commits when every layer was attended, else rolls back.

    With kv_replicas=2 a step survives a shard loss: the coordinator replaces and refills the shard,
    this client rebuilds its group, begins the step again and replays the layers already attended
    (their outputs are identical, since the restored KV is), so the caller sees only latency.
    """

    def __init__(self, gateway: Gateway, request: dict[str, int], sync_commit: bool = False, claimed: bool = False):
        self._gw = gateway
        self._claimed = claimed   # a replay run inside another step's claim (finish_deferred_commit)
        self._request = request
        self._info: BegunStep | None = None
        self._wire: StepWire | None = None
        self._attended: set[int] = set()
        self._state = "new"   # new -> open -> committed | rolled_back
        # A detached coordinator can restart between a step's end and its commit: its callers must know the
        # outcome when the step ends (StepFencedError means run it again), so they always wait.
        self._sync_commit = sync_commit or not gateway.config.async_commit or gateway.config.detached
        self._replay: list[tuple[int, torch.Tensor, torch.Tensor | None]] | None = (
            [] if gateway.config.kv_replicas == 2 else None)
        self.recoveries = 0
        self.timings = {"plan_s": 0.0, "data_plane_s": 0.0}
        """Seconds: plan_s (begin_step + the shards' planning), data_plane_s (host time in attend: wire,
        in-process shards, merge); attention_s (the slowest remote shard's kernel time; its launch time on
        CUDA) is added when the commit is read (at the next call of this client with async_commit)."""

    @property
    def num_tokens(self) -> int:
        return self._info.num_tokens if self._info else sum(self._request.values())

    @property
    def seq_ids(self) -> list[str]:
        return list(self._info.seq_ids) if self._info else list(self._request)

    def __enter__(self) -> "Step":
        if self._state != "new":
            raise InvalidRequestError(f"this step is {self._state}: start a new one with svc.step(...)")
        if not self._claimed:
            self._gw.claim(self)   # first: a second thread is refused before it touches anything
        try:
            if not self._claimed:
                self._gw.flush(continuing=self._request)   # the previous step's commit is settled first
            self._begin()
        except BaseException:
            self._gw.release(self)
            raise
        self._state = "open"
        self._thread = threading.get_ident()
        return self

    def _begin(self) -> None:
        for _ in range(MAX_RECOVERIES + 1):
            info = self._gw.begin(self._request)
            if info is not None:
                self._info, self._wire = info, info.wire
                self.timings["plan_s"] += info.plan_s
                return
            self._gw.rejoin()
        raise ServiceError("the service kept replacing shards while this step began; check `cpattn status`")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this step's tokens for one layer: q [T, Hq, D], k/v [T, Hk, D] -> out [T, Hq, D].

        ``sinks`` [Hq]: learned attention-sink logits (gpt-oss style) of this layer, one extra softmax term
        per head with no value; it enters once, in the client's merge (never once per shard).
        """
        if self._state != "open":
            raise InvalidRequestError(f"attend() needs an open step (this one is {self._state}): "
                                      "use it inside `with svc.step(...) as step:`")
        if threading.get_ident() != self._thread:   # a client (and its step) is one-thread
            raise InvalidRequestError("attend() from a thread other than the one that opened the step: a client "
                                      "serves one thread (give each thread its own cpattn.connect())")
        self._validate(layer, q, k, v)
        sinks = checked_sinks(self._gw.config, sinks, self._gw.device)
        for _ in range(MAX_RECOVERIES + 1):
            try:
                out = self._wire_attend(layer, q, k, v, sinks)
                break
            except WireError as exc:
                self._recover(str(exc))
        else:
            self._fail_closed(f"layer {layer} failed after {MAX_RECOVERIES} shard recoveries")
        if self._replay is not None:
            self._replay.append((layer, torch.cat([q, k, v], dim=1), sinks))
        self._attended.add(layer)
        return out.to(q.device, q.dtype)

    def _wire_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        try:
            t0 = time.perf_counter()
            out = self._gw.attend(self._wire, CMD_ATTEND, layer, q, k, v, sinks)
        except RuntimeError as exc:   # torch.distributed errors (DistBackendError, gloo/NCCL failures)
            self._gw.plane_broken = True   # the group is unusable after any collective failure
            raise WireError(f"data plane: {type(exc).__name__}: {exc}") from exc
        self.timings["data_plane_s"] += time.perf_counter() - t0
        return out

    def _replay_layers(self, replay: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> None:
        cfg = self._gw.config
        hq, hk = cfg.num_q_heads, cfg.num_kv_heads
        for layer, packed, sinks in replay:
            self.attend(layer, packed[:, :hq], packed[:, hq:hq + hk], packed[:, hq + hk:], sinks)

    def _recover(self, why: str) -> None:
        """Roll the broken step back; if the service recovered every sequence of it, begin again and replay."""
        try:
            self._end(False, why)
        except BaseException:
            self._close("rolled_back")
            raise
        self._restart(why)

    def _restart(self, why: str) -> None:
        """After the coordinator rolled this step back (and replaced a shard): rejoin, begin again, replay."""
        gw = self._gw
        if self._replay is None:
            self._close("rolled_back")
            gw.rejoin()
            raise ServiceError(f"step {self._info.step_id} was rolled back: {why}; the lost shard was replaced "
                               "and no sequence of this step lost KV: run the step again "
                               "(kv_replicas=2 replays it automatically)")
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            self._fail_closed(f"step gave up after {MAX_RECOVERIES} shard recoveries ({why})")
        logger.warning("step %s: %s; shard replaced, replaying %d layers", self._info.step_id, why,
                       len(self._replay))
        gw.rejoin()
        self._begin()
        for layer, packed, sinks in self._replay:
            hq, hk = gw.config.num_q_heads, gw.config.num_kv_heads
            try:
                self._wire_attend(layer, packed[:, :hq], packed[:, hq:hq + hk], packed[:, hq + hk:], sinks)
            except WireError as exc:
                self._recover(str(exc))   # bounded by MAX_RECOVERIES through self.recoveries
                return

    def _end(self, commit: bool, why: str | None) -> EndStepReply:
        return self._gw.end_step_of(self._info.step_id, commit, why,
                                    shards_waiting=len(self._attended) == self._gw.config.num_layers)

    def _fail_closed(self, why: str) -> None:
        self._close("rolled_back")
        try:
            self._end(False, why)
        except CpattnError:
            pass
        raise ServiceError(why)

    def _validate(self, layer, q, k, v) -> None:
        cfg = self._gw.config
        check_layer(cfg, layer, self._attended, in_order=self._gw.runs_ahead)
        # On a CUDA gateway the NaN/inf check is one reduction per layer, read once at the end of the step (a read
        # here would stall the GPU every layer); a step that had NaN/inf is rolled back there.
        check_qkv(cfg, self.num_tokens, q, k, v, check_finite=cfg.nan_policy == "reject" and self._wire.norms is None)

    def _close(self, state: str) -> None:
        self._state = state
        self._gw.release(self)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "open":
            return
        cfg = self._gw.config
        if exc_type is not None:   # the caller's error is the one to see: roll back silently
            self._abort(raise_errors=False)
            return
        if len(self._attended) != cfg.num_layers:
            missing = sorted(set(range(cfg.num_layers)) - self._attended)
            self._abort(raise_errors=True)
            raise IncompleteStepError(
                f"step {self._info.step_id} ended with layers {missing} never attended ({len(self._attended)} of "
                f"{cfg.num_layers}): it was rolled back and none of its tokens were committed; call step.attend() for "
                "every layer inside the `with` block, then run the step again", missing)
        try:
            self._gw.wait_for_device(self._wire)   # bounded: reading the flags below cannot hang
        except WireError as exc:
            self._fail_after_outputs(str(exc))
        if self._wire.saw_nonfinite():
            self._abort(raise_errors=True)
            raise InvalidRequestError("q, k or v held NaN or inf in this step: it was rolled back so they never "
                                      "reach the KV cache (set nan_policy='allow' to accept them)")
        if not self._sync_commit:
            self._gw.commit_async(self._info.step_id, self._request, self._replay, self.timings)
            self._close("committed")
            return
        while True:
            # The shards ended the step after the last layer; the coordinator commits it.
            try:
                report = self._end(True, None)
            except BaseException:
                self._close("rolled_back")
                raise
            if not report.recovered:
                break
            # A shard died after the last layer: the coordinator rolled the step back; do it again.
            self._restart(report.failure)
        self._close("committed")
        self._gw.committed(self.timings, report)

    def _fail_after_outputs(self, why: str) -> None:
        """The wire failed where the host could not see it (NCCL): outputs already handed out may be wrong,
        so nothing is replayed silently; the step rolls back and the caller runs it again."""
        self._close("rolled_back")
        try:
            report = self._end(False, why)
        finally:
            self._gw.rejoin()
        refilled = " and refilled from replicas" if report.recovered else ""
        raise ServiceError(f"step {self._info.step_id}: {why}; its outputs are not valid and nothing was "
                           f"committed (the lost shard was replaced{refilled}): run the step again")

    def _abort(self, raise_errors: bool) -> None:
        """Roll back: tell the shards, then the coordinator. Errors surface only if nothing else is raising."""
        gw = self._gw
        why = None
        try:
            # After the last layer the shards have already left the step: an ABORT then would be read
            # as the next step's first layer and desynchronise the group.
            if len(self._attended) < gw.config.num_layers:
                gw.abort_wire(self._wire, gw.config.num_layers - len(self._attended))
        except Exception as wire_exc:
            why = f"data plane: {type(wire_exc).__name__}: {wire_exc}"
        self._close("rolled_back")
        try:
            report = self._end(False, why)
            if report.recovered or why is not None:
                gw.rejoin()
        except CpattnError:
            if raise_errors:
                raise


def finish_deferred_commit(gw: Gateway, pending: PendingCommit) -> None:
    """Read a commit sent without waiting. A step the coordinator rolled back after all (a shard died
    between its last layer and the commit) is replayed with kv_replicas=2, else reported."""
    cfg = gw.config
    try:
        report = _call(pending.ref, cfg.rpc_timeout_s + cfg.start_timeout_s, "end_step")
    except ServiceError as exc:
        if not (cfg.detached and isinstance(exc.__cause__, ray.exceptions.RayActorError)):
            raise
        report = gw.end_step(pending.step_id, True, None)   # the coordinator restarted: ask the new one
    if not report.recovered:
        gw.committed(pending.timings, report, pending.earlier)
        return
    gw.rejoin()
    if pending.replay is None:
        raise ServiceError(f"step {pending.step_id} was rolled back after its last layer: {report.failure}; the "
                           "lost shard was replaced and no sequence lost KV, but that step's tokens were not added: "
                           "run it again (kv_replicas=2 replays it automatically)")
    logger.warning("step %s: %s; shard replaced, replaying its %d layers", pending.step_id, report.failure,
                   len(pending.replay))
    with Step(gw, pending.request, sync_commit=True, claimed=gw.open_step is not None) as again:
        again._replay_layers(pending.replay)
