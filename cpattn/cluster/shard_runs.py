"""A shard's live decode runs: the steps a run's thread serves, and the extensions the coordinator adds to them.

A remote shard serves a decode run in one run_step call, a step after each run header of its client. An
extension (coordinator_runs.extend_run) comes as a second call while that thread serves: its steps are queued
behind the run's, in the order the coordinator hands them (one extension at a time per run). After its last step
a run's thread reads one more header: END (the run is over) or NEXT into the extension its client took; the
client takes one only once the coordinator said every remote shard holds it, so a NEXT never waits for steps.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator

from cpattn.cluster.data_plane import CMD_END, CMD_NEXT, DataPlane
from cpattn.cluster.decode_run_plans import RunSteps
from cpattn.cluster.messages import ShardStepReport
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.errors import CpattnError


class RunQueue:
    """The steps of one run on this shard: its own, then each extension's, read by its thread only."""

    def __init__(self, first_step_id: int, steps: Iterator):
        self.first_step_id = first_step_id
        self._steps = steps
        self._more: deque = deque()
        self._lock = threading.Lock()
        self._over = False

    def next(self):
        """The next step's plan, None when neither the run nor an extension taken so far has one."""
        step = next(self._steps, None)
        while step is None:
            with self._lock:
                if not self._more:
                    return None
                self._steps = iter(self._more.popleft())
            step = next(self._steps, None)
        return step

    def add(self, steps: RunSteps) -> bool:
        """Queue an extension's steps; False once the run's thread has ended it."""
        with self._lock:
            if self._over:
                return False
            self._more.append(steps)
            return True

    def end(self) -> None:
        with self._lock:
            self._over = True


class LiveRuns:
    """Per data-plane group, the run its thread serves (a client runs one step, or run, at a time)."""

    def __init__(self):
        self._runs: dict[str, RunQueue] = {}
        self._lock = threading.Lock()

    def start(self, group_name: str, first_step_id: int, steps: Iterator) -> RunQueue:
        run = RunQueue(first_step_id, steps)
        with self._lock:
            self._runs[group_name] = run
        return run

    def finish(self, group_name: str, run: RunQueue) -> None:
        run.end()
        with self._lock:
            if self._runs.get(group_name) is run:
                del self._runs[group_name]

    def extend(self, group_name: str, first_step_id: int, steps) -> bool:
        """extend_run's effect: True when the group's live run is ``first_step_id``'s and took ``steps``."""
        if not isinstance(steps, RunSteps) or isinstance(first_step_id, bool):
            return False
        with self._lock:
            run = self._runs.get(group_name)
        return run is not None and run.first_step_id == first_step_id and run.add(steps)


class ShardRunMethods:
    """cluster.shard.ShardWorker's loop over a step or a run's steps, and extend_run (a mixin: it uses the worker's
    groups' graphs, runner, fence and layer serving)."""

    def extend_run(self, group_name: str, step_id: int, plan: RunSteps) -> bool:
        """The coordinator's: ``plan`` (a RunSteps carrying the shard secret) follows the steps of the run
        ``step_id`` (its first step's id) this group's thread serves; False when no such run is being served."""
        return self._live_runs.extend(group_name, step_id, plan)

    def _serve_run(self, plane: DataPlane, group_name: str, run: RunQueue | None, steps: Iterator
                   ) -> ShardStepReport:
        """Every step of a plain step (``run`` None: ``steps`` holds one) or of a run (its RunQueue)."""
        graphs, step_graphs = self._graphs[group_name], self._step_graphs.get(group_name)
        timings = {"plan_s": 0.0, "attention_s": 0.0, "wire_s": 0.0, "layers": 0, "steps": 0}
        for index in itertools.count():
            t0 = time.perf_counter()
            step_plan = run.next() if run is not None else next(steps, None)
            header = None
            if step_plan is None and run is not None:   # the run's steps are served: END, or NEXT into more
                try:
                    header = plane.recv_run_header(self.device)
                except RuntimeError as exc:   # the client died or its group broke after the run's last step
                    return ShardStepReport(**dict(timings, outcome="broken", error=f"{type(exc).__name__}: {exc}"))
                step_plan = None if header[0] == CMD_END else run.next()
                if step_plan is None and header[0] != CMD_END:
                    raise CpattnError(f"shard {self.bundle_index}: run header {tuple(header)} past the run's last "
                                      "step, and no extension of the run came")
            if step_plan is None:
                break
            if not self._fence.admits(step_plan.incarnation):   # not fenced by a restarted coordinator
                return ShardStepReport.of(self._refuse_fenced(plane, step_plan, timings))
            planned = self.runner.plan(step_plan, graphs, compact=step_plan.selected)
            timings["plan_s"] += time.perf_counter() - t0
            try:
                if index and not self._next_in_run(plane, index, step_plan, header):
                    return ShardStepReport(**dict(timings, outcome="ended"))
                timings = self._serve_layers(plane, planned, timings, step_graphs)
            except RuntimeError as exc:
                # The group broke (a peer died or timed out): report it as data, the coordinator decides.
                return ShardStepReport(**dict(timings, outcome="broken", error=f"{type(exc).__name__}: {exc}"))
            finally:
                self._fence.leave()   # fencing: this thread writes no more
            if timings["outcome"] != "served":
                return ShardStepReport.of(timings)
            timings["steps"] += 1
        return ShardStepReport.of(timings)

    def _next_in_run(self, plane: DataPlane, index: int, plan: ShardStepPlan, header=None) -> bool:
        """The run header before a run's step ``index`` (``header`` when already read): True for NEXT, False for
        END."""
        command, got_index, step_id, num_tokens = header or plane.recv_run_header(self.device)
        if command == CMD_END:
            return False
        if command != CMD_NEXT or (got_index, step_id, num_tokens) != (index, plan.step_id, plan.num_tokens):
            raise CpattnError(f"shard {self.bundle_index}: unexpected run header {(command, got_index, step_id, num_tokens)}"
                              f" before step {plan.step_id} ({index} of its run, {plan.num_tokens} tokens)")
        return True
