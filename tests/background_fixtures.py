"""Module fixtures that mostly wait, run while other tests run: the multi-host netns scenario (~60 s, most of it
partitions and timeouts running out), the local multi-node scenarios (~30 s), the long-context job pair (~30 s)
and the README's client snippet (~15 s). Each runs its whole scenario in processes of its own and hands its test
module a result to assert on, so it can start at the session's start.

A module registers its scenario at import (``register``); conftest.py starts the registered scenarios of the
selected modules, one after another in one background thread, once collection is done (``start``), and its
fixture picks the result up (``result``: waits for it, re-raises its error). The netns and multi-node scenarios'
claims include time bounds (tests/suite_lanes.py puts them in the ``alone`` lane), so:

- the background thread runs such a scenario at nice -10 (a Linux nice value is per thread, and the processes it
  starts inherit it): on CI's 2 cores the scenario's processes take the CPU they ask for first, and the foreground
  test gets what they leave idle (scheduler weight 9548 against 1024). A scenario without time bounds (the
  long-context job pair, the README snippet) runs at the session's own priority: it shares the CPU as an equal
  and starves nothing;
- every test of a module with an alone test waits for every background scenario to end before it starts, and
  conftest.py orders those modules after the others, so that the scenarios overlap heavy and light tests
  (generous timeouts only) and none with a time bound of its own;
- without the privilege to raise the priority (not root), in an xdist run, or with CPATTN_TEST_BACKGROUND=0,
  nothing runs in the background: the fixture runs its scenario itself, as before.

A scenario started and never picked up (a run stopped by -x or Ctrl-C) is aborted and joined at the session's end:
each scenario cleans up its own processes in its ``finally`` (killing them by PID), so ``abort`` only ends its
driver early.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

BACKGROUND_NICE = -10
JOIN_TIMEOUT_S = 900   # the scenarios' own timeouts (300 s at most each, plus cleanup) end them before this


@dataclass
class Scenario:
    module: str                                   # the test module's file name (test_x.py)
    run: Callable[["Scenario"], Any]              # the scenario; returns what the module's fixture yields
    time_bounds: bool = True                      # its claims include time bounds: it runs at BACKGROUND_NICE
    aborted: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    started_s: float | None = None
    took_s: float | None = None
    in_background: bool = False

    def execute(self) -> None:
        self.started_s = time.monotonic()
        try:
            self.value = self.run(self)
        except BaseException as exc:   # re-raised in the test that asks for the result
            self.error = exc
        finally:
            self.took_s = time.monotonic() - self.started_s
            self.done.set()


def can_raise_priority() -> bool:
    """Whether a thread of this process may take BACKGROUND_NICE (root with CAP_SYS_NICE): tried in a thread.
    CPATTN_TEST_BACKGROUND=0 says no (every fixture then runs its scenario itself: to compare, or to debug)."""
    if os.environ.get("CPATTN_TEST_BACKGROUND") == "0":
        return False
    allowed = []

    def probe() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            allowed.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="nice-probe")
    thread.start()
    thread.join()
    return bool(allowed)


class Background:
    """The registered scenarios and the one thread that runs the started ones, one after another."""

    def __init__(self, join_timeout_s: float = JOIN_TIMEOUT_S):
        self._registered: dict[str, Scenario] = {}
        self._thread: threading.Thread | None = None
        self._join_timeout_s = join_timeout_s

    def register(self, module_file: str, run: Callable[[Scenario], Any], time_bounds: bool = True) -> None:
        """``run(scenario)`` is ``module_file``'s scenario; it should end early once ``scenario.aborted`` is set.
        ``time_bounds=False``: nothing it asserts is a time bound, so it runs at this process's priority, sharing
        the CPU with the foreground test as an equal (it only takes what the foreground leaves idle, more or less)."""
        name = Path(module_file).name
        self._registered.setdefault(name, Scenario(name, run, time_bounds))

    def registered(self) -> set[str]:
        return set(self._registered)

    def untimed(self) -> set[str]:
        """The modules whose scenario asserts no time bound (conftest.py runs their tests late, so that the
        scenario has had the suite so far to finish beside it)."""
        return {name for name, s in self._registered.items() if not s.time_bounds}

    def start(self, modules: list[str]) -> list[str]:
        """Start the registered scenarios of ``modules`` in the background, in that order; returns those started."""
        chosen = [self._registered[m] for m in modules if m in self._registered and not self._registered[m].done.is_set()]
        if not chosen or self._thread is not None or not can_raise_priority():
            return []
        for scenario in chosen:
            scenario.in_background = True
        own_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        def run_all() -> None:
            for scenario in chosen:
                nice = BACKGROUND_NICE if scenario.time_bounds else own_nice
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)   # this thread only
                if scenario.aborted.is_set():
                    scenario.error = RuntimeError("aborted before it started")
                    scenario.done.set()
                else:
                    scenario.execute()

        self._thread = threading.Thread(target=run_all, name="background-scenarios", daemon=True)
        self._thread.start()
        return [s.module for s in chosen]

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_all(self) -> None:
        """Until no background scenario runs (before a test with a time bound of its own)."""
        if self._thread is not None:
            self._thread.join(self._join_timeout_s)

    def result(self, module_file: str) -> Any:
        """The scenario's result: waited for when it runs in the background, run here when it was never started."""
        scenario = self._registered[Path(module_file).name]
        if not scenario.in_background and not scenario.done.is_set():
            scenario.execute()
        if not scenario.done.wait(self._join_timeout_s):
            raise TimeoutError(f"the background scenario of {scenario.module} did not end within "
                               f"{self._join_timeout_s} s")
        if scenario.error is not None:
            raise scenario.error
        return scenario.value

    def abort_and_join(self) -> None:
        """At the session's end: scenarios never picked up end early and clean up; returns once the thread ended."""
        for scenario in self._registered.values():
            scenario.aborted.set()
        self.wait_all()

    def summary(self) -> list[str]:
        """One line per scenario that ran in the background, for the terminal summary (durations show ~0 s)."""
        return [f"{s.module}: scenario ran in the background for {s.took_s:.1f} s" for s in self._registered.values()
                if s.in_background and s.took_s is not None]


@contextlib.contextmanager
def result_in_dir(module_file: str):
    """A module fixture's body for a scenario whose result is a dict with its files in ``["dir"]``: the result,
    then the directory removed."""
    finished = result(module_file)
    try:
        yield finished
    finally:
        shutil.rmtree(finished["dir"], ignore_errors=True)


def communicate(proc, timeout_s: float, aborted: threading.Event | None) -> tuple[str, str]:
    """``proc.communicate(timeout=timeout_s)`` (a subprocess.Popen with pipes), except that once ``aborted`` is set
    the process is killed and RuntimeError raised: a scenario's driver ends early at the session's end."""
    import subprocess

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            if aborted is not None and aborted.is_set():
                proc.kill()
                proc.communicate()
                raise RuntimeError("aborted at the session's end") from None
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout_s) from None


# The session's scenarios (test modules register at import; conftest.py starts, waits and aborts).
SESSION = Background()
register, registered, untimed = SESSION.register, SESSION.registered, SESSION.untimed
start, running = SESSION.start, SESSION.running
wait_all, result, abort_and_join, summary = SESSION.wait_all, SESSION.result, SESSION.abort_and_join, SESSION.summary
