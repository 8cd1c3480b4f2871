"""tests/background_fixtures.py: a scenario's result or error reaches the test that asks for it, whether it ran in
the background (at nice -10, which the processes it starts inherit, when its claims include time bounds) or, never started, in the asking test; an
abort ends a scenario that waits for it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import background_fixtures
from background_fixtures import BACKGROUND_NICE, Background


def test_a_scenario_never_started_runs_in_the_test_that_asks_and_its_error_is_raised_there():
    background = Background(join_timeout_s=30)
    calls = []
    background.register("/x/test_a.py", lambda scenario: calls.append(threading.current_thread()) or 41 + len(calls))
    background.register("/x/test_b.py", lambda scenario: 1 / 0)
    assert background.registered() == {"test_a.py", "test_b.py"}
    assert background.result("test_a.py") == 42 and calls == [threading.current_thread()]
    assert background.result("tests/test_a.py") == 42 and len(calls) == 1   # run once, then kept
    with pytest.raises(ZeroDivisionError):
        background.result("test_b.py")
    assert background.summary() == []   # nothing ran in the background


@pytest.mark.skipif(not background_fixtures.can_raise_priority(), reason="needs the privilege to raise a priority")
def test_background_scenarios_run_in_order_at_nice_minus_10_and_their_processes_inherit_it():
    background = Background(join_timeout_s=60)
    order = []

    def scenario(name):
        def run(_scenario):
            order.append(name)
            child = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"], capture_output=True,
                                   text=True, timeout=60)
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), int(child.stdout)
        return run

    for name in ("test_a.py", "test_b.py", "test_c.py"):
        background.register(name, scenario(name))
    background.register("test_d.py", scenario("test_d.py"), time_bounds=False)
    started = background.start(["test_b.py", "test_d.py", "test_a.py", "test_not_registered.py"])
    assert started == ["test_b.py", "test_d.py", "test_a.py"]
    assert background.start(["test_c.py"]) == []   # one background thread per session
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert background.result("test_a.py") == (BACKGROUND_NICE, BACKGROUND_NICE)
    assert background.result("test_b.py") == (BACKGROUND_NICE, BACKGROUND_NICE)
    assert background.result("test_d.py") == (mine, mine)   # no time bounds: the session's own priority
    assert order == ["test_b.py", "test_d.py", "test_a.py"]
    assert background.result("test_c.py") == (mine, mine)   # never started: run here, at this thread's priority
    assert [line.split(":")[0] for line in background.summary()] == ["test_a.py", "test_b.py", "test_d.py"]
    background.wait_all()
    assert not background.running()


@pytest.mark.skipif(not background_fixtures.can_raise_priority(), reason="needs the privilege to raise a priority")
def test_an_abort_ends_a_waiting_scenario_and_one_not_started_raises():
    background = Background(join_timeout_s=60)
    started = threading.Event()

    def waits_for_abort(scenario):
        started.set()
        if not scenario.aborted.wait(60):
            raise AssertionError("never aborted")
        raise RuntimeError("aborted at the session's end")

    background.register("test_waits.py", waits_for_abort)
    background.register("test_later.py", lambda scenario: "never run")
    background.start(["test_waits.py", "test_later.py"])
    assert started.wait(30) and background.running()
    background.abort_and_join()
    assert not background.running()
    with pytest.raises(RuntimeError, match="aborted at the session's end"):
        background.result("test_waits.py")
    with pytest.raises(RuntimeError, match="aborted before it started"):
        background.result("test_later.py")


def test_communicate_returns_the_output_times_out_with_its_limit_and_kills_on_abort():
    def sleeper(seconds: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import time; print('up', flush=True); time.sleep({seconds})"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    assert background_fixtures.communicate(sleeper(0), 60, threading.Event()) == ("up\n", "")
    slow = sleeper(60)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        background_fixtures.communicate(slow, 1.5, None)
    assert info.value.timeout == 1.5 and slow.poll() is None   # the caller decides what to do with it
    aborted = threading.Event()
    threading.Timer(0.5, aborted.set).start()
    with pytest.raises(RuntimeError, match="aborted at the session's end"):
        background_fixtures.communicate(slow, 60, aborted)
    assert slow.poll() is not None   # killed
