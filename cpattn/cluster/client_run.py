"""Decode runs, the client's side: the steps one begin_step planned, run without asking the coordinator.

A run (cluster/decode_run.py) is granted to a decode-only step; its next steps are the client's as long as it
asks for the same thing (same sequences, in the same order, one token each). Each step of the run is
committed as any step is (its answer read later); before each step after the first the remote shards get a
run header (NEXT), and a run the client leaves early (another request, freeing one of its sequences, close)
gets END, then a waited ``end_step(done=n)`` that keeps the n steps run and gives back the other pages.

A remote shard waits for the next run header between steps, holding a thread; so a run left idle ends by
itself (RunReaper) well before that wait could reach the data plane's timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

FIRST_RUN_STEPS = 4
"""A decode loop's first run; each run it finishes doubles the next (up to decode_run_steps), each run it
leaves early (the batch changed) starts over here: long runs amortise the plan, short ones waste few plans."""

RUN_IDLE_S = 1.0
"""A run whose client started no step for this long ends (at most a quarter of collective_timeout_s)."""


@dataclass
class DecodeRun:
    request: dict[str, int]
    """The request every step of the run answers (compared in order: rows follow it)."""
    steps: list[dict]
    """Per step: step_id, local_plans, remote_rows (the first is the begin_step reply itself)."""
    num_tokens: int
    index: int = 0
    """Steps begun so far."""
    commits: list = field(default_factory=list)
    """Refs of this run's end_step(done=n) sent without waiting (read at the latest when the run ends)."""
    idle_since: float | None = None
    """When its last step ended; None while one of its steps is open (the RunReaper leaves it alone)."""

    @property
    def first_step_id(self) -> int:
        return self.steps[0]["step_id"]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def continues(self, request) -> bool:
        return self.index < self.num_steps and list(request.items()) == list(self.request.items())

    def next_step(self) -> dict:
        step = self.steps[self.index]
        self.index += 1
        self.idle_since = None
        return step

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
