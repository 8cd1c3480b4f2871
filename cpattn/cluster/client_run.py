"""Decode runs, the client's side: the steps one begin_step planned, run without asking the coordinator.

A run (cluster/decode_run.py) is granted to a decode-only step; its next steps are the client's as long as it
asks for the same thing (same sequences, in the same order, one token each). Each step of the run is
committed as any step is (its answer read later); before each step after the first the remote shards get a
run header (NEXT), and a run the client leaves early (another request, freeing one of its sequences, close)
gets END, then a waited ``end_step(done=n)`` that keeps the n steps run and gives back the other pages. At its
second step, a run asks for its next steps (cluster/run_extension.py); after its last step the shards get NEXT into
them, or END when none came.

A remote shard waits for the next run header between steps, holding a thread; so a run left idle ends by
itself (RunReaper) well before that wait could reach the data plane's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import ray

from cpattn.cluster.client_graphs import use_client_graphs
from cpattn.cluster.data_plane import CMD_END, CMD_NEXT
from cpattn.cluster.messages import EndStepReply, StepPlans
from cpattn.cluster.rpc import call
from cpattn.cluster.run_extension import ask_extension, take_extension
from cpattn.cluster.steady_run import SteadyRun
from cpattn.errors import InvalidRequestError, ServiceError, ShardLostError

if TYPE_CHECKING:
    from cpattn.cluster.step_run import Replay

logger = logging.getLogger("cpattn")

FIRST_RUN_STEPS = 4
"""A decode loop's first run; each run it finishes doubles the next (up to decode_run_steps), each run it
leaves early (the batch changed) starts over here: long runs amortise the plan, short ones waste few plans."""

RUN_IDLE_S = 1.0
"""A run whose client started no step for this long ends (at most a quarter of collective_timeout_s)."""

_REAPING = object()   # the Gateway's open_step while the RunReaper ends an idle run


@dataclass
class BegunStep:
    """A step this client began: planned by begin_step, or the next step of its decode run."""

    step_id: int
    num_tokens: int
    seq_ids: list[str]
    plan_s: float
    """Seconds begin_step took at the coordinator (0 for a run's later steps: planned with its first)."""
    wire: Any
    """Its gateway.StepWire: what each layer needs (local plans, the rows each remote shard returns)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of beginning it by phase (StepRun.timings["begin_parts"]; benchmarks/profile_begin.py)."""


class Phases(dict):
    """Seconds by phase of one call: ``mark(name)`` charges the time since the previous mark to ``name``."""

    def __init__(self):
        super().__init__()
        self._last = time.perf_counter()

    def mark(self, name: str, result=None):
        """Returns ``result``, so a phase's call can be marked where it is made."""
        now = time.perf_counter()
        self[name] = self.get(name, 0.0) + now - self._last
        self._last = now
        return result


@dataclass
class PendingCommit:
    """A committed step whose coordinator answer has not been read yet."""

    step_id: int
    request: dict[str, int]
    replay: Replay | None
    """(layer, its q|k|v message, sinks) of every attended layer (kv_replicas=2)."""
    timings: dict[str, float]
    """The Step's own timings dict: completed in place when the answer is read."""
    ref: Any
    earlier: list[dict] = field(default_factory=list)
    """The timings of the decode run's earlier steps (this is its last): completed with it."""


@dataclass
class DecodeRun:
    request: dict[str, int]
    """The request every step of the run answers (compared in order: rows follow it)."""
    first: StepPlans
    """The begin_step reply itself."""
    later: Sequence[StepPlans]
    """Its later steps (built as they are reached: decode_run_plans.RunSteps)."""
    num_tokens: int
    index: int = 0
    """Steps begun so far."""
    commits: list = field(default_factory=list)
    """Refs of this run's end_step(done=n) sent without waiting (read at the latest when the run ends)."""
    timings: list[dict] = field(default_factory=list)
    """The timings dicts of its committed steps: the shards report once per run (Gateway.committed)."""
    idle_since: float | None = None
    """When its last step ended; None while one of its steps is open (the RunReaper leaves it alone)."""
    steady: Any = None
    """cluster/steady_run.SteadyRun once its segment's second step was opened: the later steps it opens without
    planning."""
    steady_template: Any = None
    """The StepWire the previous segment's SteadyRun opened its steps from: an extension's steps open steady from
    their second (from their first one's plan, the graphs hold the extension's table), none planned as a template."""
    segment_start: int = 0
    """The index of the current segment's first step: 0, or where the run's latest extension began."""
    segment: Any = None
    """The latest extension's steps (decode_run_plans.RunSteps, step segment_start on); None before one."""
    extension: Any = None
    """The ref of the extend_run asked for this segment, read at its last step (cluster/run_extension.py)."""
    asked: bool = False
    """This segment's extension was asked for (once per segment)."""

    @property
    def first_step_id(self) -> int:
        return self.first.step_id

    @property
    def num_steps(self) -> int:
        return self.segment_start + len(self.segment) if self.segment is not None else 1 + len(self.later)

    @property
    def segment_steps(self):
        """The current segment's steps as begin_step or extend_run gave them (what a SteadyRun is made of)."""
        return self.later if self.segment is None else self.segment

    def continues(self, request) -> bool:
        return self.index < self.num_steps and list(request.items()) == list(self.request.items())

    def next_step(self) -> StepPlans:
        if self.segment is not None:
            step = self.segment[self.index - self.segment_start]
        else:
            step = self.later[self.index - 1] if self.index else self.first
        self.step_begun()
        return step

    def extend(self, steps) -> None:
        """The run goes on with ``steps`` (an extension's RunSteps) after its last planned step."""
        self.segment_start, self.segment = self.num_steps, steps
        self.steady_template = None if self.steady is None else self.steady.template
        self.steady, self.extension, self.asked = None, None, False

    def step_begun(self) -> None:
        """The next step was begun (its plans read, or opened by the steady run)."""
        self.index += 1
        self.idle_since = None

    def step_ended(self) -> None:
        self.idle_since = time.monotonic()

    def idle_for(self, seconds: float) -> bool:
        return self.idle_since is not None and time.monotonic() - self.idle_since >= seconds

    def position(self, step_id: int) -> int | None:
        """Index of ``step_id`` in this run, None when it is not one of its steps."""
        index = step_id - self.first_step_id
        return index if 0 <= index < self.num_steps else None


class RunReaper(threading.Thread):
    """Ends a client's run left idle (no step for ``idle_s``): calls ``end_idle(idle_s)`` every idle_s / 4."""

    def __init__(self, end_idle: Callable[[float], None], idle_s: float):
        super().__init__(daemon=True, name="cpattn-run-reaper")
        self._end_idle = end_idle
        self._idle_s = idle_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._idle_s / 4):
            try:
                self._end_idle(self._idle_s)
            except Exception:   # the client's next call meets the same error and reports it
                pass

    def stop(self) -> None:
        self._stop_event.set()


class RunControl:
    """The Gateway's decode-run methods and its one-open-step guard, which an idle run's RunReaper shares (a mixin:
    they use its run, locks, plane, device and coordinator calls)."""

    def end_run(self) -> None:
        """Leave the decode run: its commits read, its shards told END, the steps not run given back."""
        with self._run_lock:
            run, self.run = self.run, None
            if run is None:
                return
            self.run_length = FIRST_RUN_STEPS
            call(run.commits, self.config.rpc_timeout_s, "end_step")
            why = None
            if self.plane is not None and not self.plane_broken:
                step_id = run.first_step_id + run.index
                try:
                    self.plane.send_run_header(CMD_END, run.index, step_id, run.num_tokens, self.device)
                except RuntimeError as exc:   # gloo: a shard died since the run's last step
                    self.plane_broken, why = True, f"data plane: {type(exc).__name__}: {exc}"
            try:
                report = self.end_step(run.first_step_id, True, why, done=run.index, ends_run=True)
            except ServiceError as exc:
                if isinstance(exc, ShardLostError):
                    raise
                # The run's finished steps stay committed and none was in flight: nothing to run again.
                logger.warning("decode run ended after a shard failure (its %d steps are kept): %s", run.index, exc)
                self.plane_broken = True
                return
            if run.timings:
                self.committed(run.timings[-1], report, run.timings[:-1])
            if report.recovered:   # a shard was lost between the run's steps (none of them lost KV)
                self.rejoin()

    def _next_in_run(self, run: DecodeRun, seq_ids: list[str], phases: Phases) -> BegunStep | None:
        """The decode run's next step: opened from the run's rows on the device where its SteadyRun serves it, else
        from its plans (built when first read); None when its remote shards could not be told (the run ended).
        At a segment's second step its extension is asked for (cluster/run_extension.py)."""
        j = run.index - run.segment_start   # the step's index in its segment (a SteadyRun's rows are per segment)
        wire = phases.mark("steady", run.steady.open(j, self.local_graphs)) if run.steady is not None else None
        if wire is not None:
            run.step_begun()
            if not phases.mark("announce", self._announce(run, wire.step_id)):
                return None
            use_client_graphs(self.client_graphs, wire, wire.norms)
            phases.mark("client_graphs")
            begun = BegunStep(wire.step_id, run.num_tokens, seq_ids, 0.0, wire, phases)
        else:
            step = phases.mark("run_next", run.next_step())
            if not phases.mark("announce", self._announce(run, step.step_id)):
                return None
            begun = self._open(step, run.num_tokens, seq_ids, 0.0, phases)
            # An extension's first step: its later steps from the previous segment's template (SteadyRun.of checks it
            # still serves); else the segment's second step is the template of the later ones.
            template = begun.wire if j == 1 else run.steady_template if j == 0 else None
            if run.steady is None and template is not None:
                run.steady = phases.mark("steady_rows", SteadyRun.of(run.segment_steps, template, self.local_graphs))
        phases.mark("extend", ask_extension(self, run))
        return begun

    def _announce(self, run: DecodeRun, step_id: int) -> bool:
        """Tell the run's remote shards its next step follows. A group that broke since (a shard died) ends the
        run as failed: the coordinator's answer is raised (nothing of this step happened: run it again) unless
        it recovered every sequence, then False (begin afresh, after a rejoin)."""
        if self.plane is None:
            return True
        try:
            self.plane.send_run_header(CMD_NEXT, run.index - 1, step_id, run.num_tokens, self.device)
            return True
        except RuntimeError as exc:   # gloo: the peer is gone
            self.plane_broken, self.run, self.run_length = True, None, FIRST_RUN_STEPS
            call(run.commits, self.config.rpc_timeout_s, "end_step")
            self.end_step(run.first_step_id, False, f"data plane: {type(exc).__name__}: {exc}", run.index - 1)
            return False

    def end_idle_run(self, idle_s: float) -> None:
        """The RunReaper's call: end a run no step used for ``idle_s`` (the caller's next step waits meanwhile)."""
        with self._guard:
            run = self.run
            if run is None or self.open_step is not None or not run.idle_for(idle_s):
                return
            self.open_step = _REAPING
        try:
            self.end_run()
        finally:
            with self._guard:
                self.open_step = None
                self._reaped.notify_all()

    def commit_async(self, step_id: int, request: dict, replay, timings: dict) -> None:
        """A step's commit, sent without waiting; a run's steps before its last only advance its lengths."""
        run = self.run
        index = run.position(step_id) if run is not None else None
        if index is not None and index + 1 == run.num_steps:
            take_extension(self, run)   # its last planned step: it goes on when its extension came
        if index is not None and index + 1 < run.num_steps:
            run.commits.append(self.end_step_async(run.first_step_id, index + 1))
            run.timings.append(timings)
            run.step_ended()
            return
        earlier, done = [], None
        if index is not None:
            self.run = None   # its last step: the commit ends it (and reads the shards' reports)
            self.run_length = 2 * run.num_steps
            step_id, done, earlier = run.first_step_id, run.num_steps, run.timings
            self._send_end(run, done)
        self.pending = PendingCommit(step_id, request, replay, timings,
                                     self.end_step_async(step_id, done, ends_run=index is not None), earlier)

    def read_commit(self, pending: PendingCommit) -> EndStepReply:
        """The answer to a commit sent without waiting; a detached coordinator that restarted meanwhile is asked
        again (its journal knows whether the step committed)."""
        cfg = self.config
        try:
            return call(pending.ref, cfg.rpc_timeout_s + cfg.start_timeout_s, "end_step")
        except ServiceError as exc:
            if not (cfg.detached and isinstance(exc.__cause__, ray.exceptions.RayActorError)):
                raise
            return self.end_step(pending.step_id, True, None)   # the coordinator restarted: ask the new one

    def end_step_of(self, step_id: int, commit: bool, why: str | None, shards_waiting: bool = False
                    ) -> EndStepReply:
        """end_step for one step, of a run or not. ``shards_waiting``: every layer was attended, so a run's
        remote shards wait for its next run header: told END first."""
        with self._run_lock:
            run = self.run
            index = run.position(step_id) if run is not None else None
            if index is None:
                return self.end_step(step_id, commit, why)
            if commit and index + 1 == run.num_steps:
                take_extension(self, run)
            if commit and index + 1 < run.num_steps:
                run.step_ended()
                return self.end_step(run.first_step_id, True, why, index + 1)   # the run goes on
            self.run = None
            self.run_length = 2 * run.num_steps if commit else FIRST_RUN_STEPS
            call(run.commits, self.config.rpc_timeout_s, "end_step")
            done = index + 1 if commit else index
            if shards_waiting:   # after its last step too: they wait for END or NEXT into an extension
                self._send_end(run, index + 1)
            return self.end_step(run.first_step_id, commit, why, done, ends_run=True)

    def _send_end(self, run: DecodeRun, index: int) -> None:
        """END to the run's remote shards, which wait for a run header before its step ``index``. A group broken
        since (a shard died after the step's last layer) is left to the commit: the coordinator finds the shard's
        report broken or its actor gone and answers as for any step that failed."""
        if self.plane is not None and not self.plane_broken:
            try:
                self.plane.send_run_header(CMD_END, index, run.first_step_id + index, run.num_tokens, self.device)
            except RuntimeError as exc:   # gloo: the peer is gone
                logger.warning("decode run %d: END not sent (%s)", run.first_step_id, exc)
                self.plane_broken = True

    # One open step per client (the RunReaper's mark is none) ----------------------------------------------------
    def claim(self, step) -> None:
        """One open step per client, atomically: a second thread or a nested step is rejected."""
        with self._guard:
            if not self._reaped.wait_for(lambda: self.open_step is not _REAPING, self.config.rpc_timeout_s):
                raise ServiceError(f"this client's idle decode run did not finish ending within rpc_timeout_s="
                                   f"{self.config.rpc_timeout_s:g}s (its shards are slow or gone): retry the step")
            self.check_no_open_step()
            self.open_step = step

    def check_no_open_step(self) -> None:
        # The RunReaper ending an idle run is not a step: claim() waits for it.
        if self.open_step is not None and self.open_step is not _REAPING:
            raise InvalidRequestError("a step is already open on this client: finish it first; a client serves one "
                                      "thread and one step at a time (use a second client for concurrent steps)")

    def release(self, step) -> None:
        with self._guard:
            if self.open_step is step:
                self.open_step = None
