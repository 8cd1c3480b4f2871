"""A step's life on the client, in one owner: its states, its recoveries and every way it ends.

    new --open()--> open --end()--> ending --> committed    (commit waited for, or sent without waiting)
     |               |                    \\--> rolled_back  (layers missing, NaN/inf seen on the device, the wire
     |               |                                       failed after outputs were handed out, the service
     |               |                                       refused: fenced, shard lost, lease lapsed)
     |               |--the wire failed (in attend, or a shard lost after the last layer while ending)-->
     |               |     the coordinator rolls back; kv_replicas=2: rejoin, begin again, replay the layers
     |               |     attended (at most MAX_RECOVERIES times); kv_replicas=1: rolled_back
     |               |--this process's own work failed in attend (LocalWorkError: out of memory, a kernel)-->
     |               |     rolled_back with a ServiceError saying what to change (replaying cannot help)
     |               \\--end(caller_failed)--> rolled_back (silently: the caller's error is the one to see)
     \\--begin refused--> new (the claim released; nothing began)

Its collaborators (the coordinator's calls, the data plane, the group) are the ``StepHost`` protocol
(cluster/step_host.py): the Gateway in the service, fakes in tests/test_step_run.py. The public
``cpattn.step.Step`` is a facade over it that checks the caller's inputs (cpattn/step_inputs.py) first.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from cpattn.cluster.data_plane import LocalWorkError, WireError
from cpattn.cluster.wire_messages import LayerMessage
from cpattn.errors import (AccessDeniedError, CpattnError, IncompleteStepError, InvalidRequestError, ServiceError,
                           ShardLostError, StepFencedError)

if TYPE_CHECKING:
    from cpattn.cluster.client_run import PendingCommit
    from cpattn.cluster.messages import EndStepReply
    from cpattn.cluster.step_host import StepHost

logger = logging.getLogger("cpattn")

MAX_RECOVERIES = 3
NEW, OPEN, ENDING, COMMITTED, ROLLED_BACK = "new", "open", "ending", "committed", "rolled_back"

Replay = list[tuple[int, LayerMessage, "torch.Tensor | None"]]
"""(layer, its q|k|v message, sinks) of every layer attended so far (kv_replicas=2)."""


class StepRun:
    """One step of a set of sequences; commits when every layer was attended, else rolls back.

    With kv_replicas=2 a step survives a shard loss: the coordinator replaces and refills the shard, the
    client rebuilds its group, begins the step again and replays the layers already attended (their outputs
    are identical, since the restored KV is), so the caller sees only latency.
    """

    def __init__(self, host: StepHost, request: dict[str, int], sync_commit: bool = False, claimed: bool = False):
        cfg = host.config
        self.host = host
        self.request = request
        self.claimed = claimed   # a replay run inside another step's claim (finish_deferred_commit)
        self.info = None         # client_run.BegunStep once begun
        self.wire = None         # its gateway.StepWire
        self.attended: set[int] = set()
        self.state = NEW
        self.ending: str | None = None
        """How it ended: committed, commit_sent (async), rolled_back (the caller's error), incomplete, nonfinite,
        wire_after_outputs, gave_up (MAX_RECOVERIES), not_replayable (kv_replicas=1), fenced (a coordinator
        restart), shard_lost (KV lost: ShardLostError), lease_lapsed, refused (the service raised anything else),
        failed (an unexpected error while ending), failed_here (this process's own work failed in attend)."""
        # A detached coordinator can restart between a step's end and its commit: its callers must know the
        # outcome when the step ends (StepFencedError means run it again), so they always wait.
        self.sync_commit = sync_commit or not cfg.async_commit or cfg.detached
        self.replay: Replay | None = [] if cfg.kv_replicas == 2 else None
        self.recoveries = 0
        self.timings = {"plan_s": 0.0, "begin_s": 0.0, "data_plane_s": 0.0, "sent_bytes": 0, "begin_parts": {}}
        """Seconds; ``begin_parts``: begin_s by phase (claim, flush, begin, and the host's parts of begin); ``end_s``
        (once ended): the caller's wall time in end() (the device waited for, the commit sent or waited for);
        ``sent_bytes``: wire bytes; ``commit_replays``: times a commit read later (async) found a shard loss and
        replayed this step (a count kept here because that commit holds this dict, not this StepRun)."""

    # Opening ----------------------------------------------------------------------------------------------------
    def open(self) -> None:
        if self.state != NEW:
            raise InvalidRequestError(f"this step is {self.state}: start a new one with svc.step(...)")
        host = self.host
        t0 = time.perf_counter()
        if not self.claimed:
            host.claim(self)   # first: a second thread is refused before it touches anything
        t1 = time.perf_counter()
        try:
            if not self.claimed:
                host.flush(continuing=self.request)   # the previous step's commit is settled first
            t2 = time.perf_counter()
            self._begin()
        except BaseException:
            host.release(self)
            raise
        self.state = OPEN
        t3 = time.perf_counter()
        self.timings["begin_s"] += t3 - t0
        # Where opening spent its time (benchmarks/profile_begin.py): the host's own parts are within "begin".
        parts = self.timings["begin_parts"]
        for name, seconds in (("claim", t1 - t0), ("flush", t2 - t1), ("begin", t3 - t2),
                              *getattr(self.info, "parts", {}).items()):
            parts[name] = parts.get(name, 0.0) + seconds

    def _begin(self) -> None:
        for _ in range(MAX_RECOVERIES + 1):
            info = self.host.begin(self.request)
            if info is not None:
                self.info, self.wire = info, info.wire
                self.timings["plan_s"] += info.plan_s
                return
            self.host.rejoin()
        raise ServiceError("the service kept replacing shards while this step began; check `cpattn status`")

    # Attending --------------------------------------------------------------------------------------------------
    def require_open(self) -> None:
        if self.state != OPEN:
            raise InvalidRequestError(f"attend() needs an open step (this one is {self.state}): "
                                      "use it inside `with svc.step(...) as step:`")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of checked inputs (cpattn.step_inputs): out [T, Hq, D] on q's device, in q's dtype."""
        t0 = time.perf_counter()
        message = LayerMessage(q, k, v, self.host.device)   # onto the gateway's device: data-plane time too
        self.timings["data_plane_s"] += time.perf_counter() - t0
        return _like(self.attend_message(layer, message, sinks), q)

    def attend_message(self, layer: int, message: LayerMessage, sinks: torch.Tensor | None) -> torch.Tensor:
        """One layer whose q|k|v are ``message``: the same message goes on the wire and into the replay."""
        self.require_open()
        for _ in range(MAX_RECOVERIES + 1):
            try:
                out = self._send(layer, message, sinks)
                break
            except WireError as exc:
                self._recover(str(exc))
        else:
            self._fail_closed(f"layer {layer} failed after {MAX_RECOVERIES} shard recoveries")
        if self.replay is not None:
            self.replay.append((layer, message.keep(), sinks))
        self.attended.add(layer)
        return out

    def graph_replayed(self) -> None:
        """Every layer ran in the caller's CUDA graph, replayed in this step (cpattn.decode_graph). Its q|k|v stayed
        in the graph's buffers, so nothing can be replayed after a shard loss: the step then rolls back and says
        to run it again (ServiceError), with kv_replicas=2 too."""
        self.require_open()
        self.attended = set(range(self.host.config.num_layers))
        self.replay = None

    def _send(self, layer: int, message: LayerMessage, sinks: torch.Tensor | None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out = self.host.attend(self.wire, layer, message, sinks)
        except LocalWorkError as exc:   # a replay would fail the same way: roll back, say what to change
            self._fail_closed(f"layer {layer}: {exc}", "failed_here", _failed_here(self.info.step_id, layer, exc))
        self.timings["data_plane_s"] += time.perf_counter() - t0
        self.timings["sent_bytes"] = self.wire.sent_bytes   # to remote shards, so far (a replay's wire: its own)
        return out

    # Recovering -------------------------------------------------------------------------------------------------
    def _recover(self, why: str) -> None:
        """Roll the broken step back; if the service recovered every sequence of it, begin again and replay."""
        try:
            self._end(False, why)
        except BaseException as exc:
            self._close(ROLLED_BACK, _refusal(exc))
            raise
        self._restart(why)

    def _restart(self, why: str) -> None:
        """After the coordinator rolled this step back (and replaced a shard): rejoin, begin again, replay."""
        host = self.host
        if self.replay is None:
            self._close(ROLLED_BACK, "not_replayable")
            host.rejoin()
            raise ServiceError(f"step {self.info.step_id} was rolled back: {why}; the lost shard was replaced "
                               "and no sequence of this step lost KV: run the step again "
                               "(kv_replicas=2 replays it automatically)")
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            self._fail_closed(f"step gave up after {MAX_RECOVERIES} shard recoveries ({why})")
        logger.warning("step %s: %s; shard replaced, replaying %d layers", self.info.step_id, why,
                       len(self.replay))
        host.rejoin()
        self._begin()
        for layer, message, sinks in self.replay:
            try:
                self._send(layer, message, sinks)
            except WireError as exc:
                self._recover(str(exc))   # bounded by MAX_RECOVERIES through self.recoveries
                return

    def _fail_closed(self, why: str, ending: str = "gave_up", error: CpattnError | None = None) -> None:
        self._close(ROLLED_BACK, ending)
        try:
            self._end(False, why)
        except CpattnError:
            pass
        raise error or ServiceError(why)

    # Ending -----------------------------------------------------------------------------------------------------
    def end(self, caller_failed: bool = False) -> None:
        """Commit (every layer attended, nothing non-finite, the wire whole), else roll back and say why.
        ``caller_failed``: the caller's own error is the one to see, so this rolls back silently."""
        if self.state != OPEN:
            return
        if caller_failed:
            self._abort(raise_errors=False, ending="rolled_back")
            return
        self.state = ENDING
        t0 = time.perf_counter()
        try:
            self._finish()
        except BaseException:
            if self.state == ENDING:   # an error no ending expected (a rejoin that failed, a CUDA error): the
                self._abort(raise_errors=False, ending="failed")   # client must not stay claimed by this step
            raise
        finally:
            self.timings["end_s"] = self.timings.get("end_s", 0.0) + time.perf_counter() - t0

    def _finish(self) -> None:
        cfg = self.host.config
        if len(self.attended) != cfg.num_layers:
            missing = sorted(set(range(cfg.num_layers)) - self.attended)
            self._abort(raise_errors=True, ending="incomplete")
            raise _incomplete(self.info.step_id, missing, cfg.num_layers)
        try:
            self.host.wait_for_device(self.wire)   # bounded: reading the flags below cannot hang
        except WireError as exc:
            self._fail_after_outputs(str(exc))
        if self.wire.saw_nonfinite():
            self._abort(raise_errors=True, ending="nonfinite")
            raise InvalidRequestError("q, k or v held NaN or inf in this step: it was rolled back so they never "
                                      "reach the KV cache (set nan_policy='allow' to accept them)")
        if not self.sync_commit:
            self.host.commit_async(self.info.step_id, self.request, self.replay, self.timings)
            self._close(COMMITTED, "commit_sent")
            return
        while True:
            # The shards ended the step after the last layer; the coordinator commits it.
            try:
                report = self._end(True, None)
            except BaseException as exc:
                self._close(ROLLED_BACK, _refusal(exc))
                raise
            if not report.recovered:
                break
            # A shard died after the last layer: the coordinator rolled the step back; do it again.
            self._restart(report.failure)
        self._close(COMMITTED, "committed")
        self.host.committed(self.timings, report)

    def _end(self, commit: bool, why: str | None) -> EndStepReply:
        return self.host.end_step_of(self.info.step_id, commit, why,
                                     shards_waiting=len(self.attended) == self.host.config.num_layers)

    def _close(self, state: str, ending: str) -> None:
        self.state = state
        self.ending = self.ending or ending   # the first reason stays (a failed recovery closes twice)
        self.host.release(self)

    def _fail_after_outputs(self, why: str) -> None:
        """The wire failed where the host could not see it (NCCL): outputs already handed out may be wrong,
        so nothing is replayed silently; the step rolls back and the caller runs it again."""
        self._close(ROLLED_BACK, "wire_after_outputs")
        try:
            report = self._end(False, why)
        finally:
            self.host.rejoin()
        refilled = " and refilled from replicas" if report.recovered else ""
        raise ServiceError(f"step {self.info.step_id}: {why}; its outputs are not valid and nothing was "
                           f"committed (the lost shard was replaced{refilled}): run the step again")

    def _abort(self, raise_errors: bool, ending: str) -> None:
        """Roll back: tell the shards, then the coordinator. Errors surface only if nothing else is raising."""
        host, num_layers = self.host, self.host.config.num_layers
        why = None
        try:
            # After the last layer the shards have already left the step: an ABORT then would be read
            # as the next step's first layer and desynchronise the group.
            if len(self.attended) < num_layers:
                host.abort_wire(self.wire, num_layers - len(self.attended))
        except Exception as wire_exc:
            why = f"data plane: {type(wire_exc).__name__}: {wire_exc}"
        self._close(ROLLED_BACK, ending)
        try:
            report = self._end(False, why)
            if report.recovered or why is not None:
                host.rejoin()
        except CpattnError:
            if raise_errors:
                raise


def _incomplete(step_id: int, missing: list[int], num_layers: int) -> IncompleteStepError:
    return IncompleteStepError(
        f"step {step_id} ended with layers {missing} never attended ({num_layers - len(missing)} of {num_layers}): "
        "it was rolled back and none of its tokens were committed; call step.attend() for every layer inside the "
        "`with` block, then run the step again", missing)


def _failed_here(step_id: int, layer: int, exc: LocalWorkError) -> ServiceError:
    """The error of a step whose own process's work failed (no shard was lost), caused by that work's error."""
    oom = isinstance(exc.__cause__, torch.OutOfMemoryError)
    advice = ("free memory on that device or attend fewer tokens per step (max_tokens_per_step)" if oom else
              "the shards and the service are intact; fix the cause and run the step again")
    error = ServiceError(f"step {step_id}, layer {layer}: {exc}. The step was rolled back and none of its tokens "
                         f"were committed: {advice}")
    error.__cause__, error.__suppress_context__ = exc.__cause__, True
    return error


def _refusal(exc: BaseException) -> str:
    """The ending of a step whose rollback or commit the service refused with ``exc``."""
    if isinstance(exc, StepFencedError):
        return "fenced"
    if isinstance(exc, ShardLostError):
        return "shard_lost"
    return "lease_lapsed" if isinstance(exc, AccessDeniedError) and "lease lapsed" in str(exc) else "refused"


def finish_deferred_commit(host: StepHost, pending: PendingCommit) -> None:
    """Read a commit sent without waiting. A step the coordinator rolled back after all (a shard died
    between its last layer and the commit) is replayed with kv_replicas=2, else reported."""
    report = host.read_commit(pending)
    if not report.recovered:
        host.committed(pending.timings, report, pending.earlier)
        return
    host.rejoin()
    if pending.replay is None:
        raise ServiceError(f"step {pending.step_id} was rolled back after its last layer: {report.failure}; the "
                           "lost shard was replaced and no sequence lost KV, but that step's tokens were not added: "
                           "run it again (kv_replicas=2 replays it automatically)")
    logger.warning("step %s: %s; shard replaced, replaying its %d layers", pending.step_id, report.failure,
                   len(pending.replay))
    # the step that sent the commit has ended: its Step counts this recovery through its own timings dict
    pending.timings["commit_replays"] = pending.timings.get("commit_replays", 0) + 1
    again = StepRun(host, pending.request, sync_commit=True, claimed=host.open_step is not None)
    again.open()
    try:
        for layer, message, sinks in pending.replay:
            again.attend_message(layer, message, sinks)
    except BaseException:
        again.end(caller_failed=True)
        raise
    again.end()


def _like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` on q's device in q's dtype, without a .to() call where it is already (~2 us even as a no-op)."""
    return out if out.device == q.device and out.dtype == q.dtype else out.to(q.device, q.dtype)
