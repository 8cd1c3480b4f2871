"""The TRITON kernels' CPU tests, run through Triton's interpreter beside the suite (tests/interpreter_run.py): each
module's cases all passed, none failed, errored or skipped (a skip there means the interpreter run lacked what it
needs, which this suite provides). One test per module, so a failure names the module and each failing case."""

from __future__ import annotations

import pytest

import interpreter_run

WHY_NOT = interpreter_run.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def interpreted():
    """The run's cases by module: started at the session's start by conftest.py, else here in the foreground."""
    run = interpreter_run.SESSION
    if run.started():
        return run.cases()   # conftest.py cleans up at the session's end
    run.start(nice=0)
    try:
        return run.cases()
    finally:
        run.cleanup()


@pytest.mark.parametrize("module", sorted(dict.fromkeys(interpreter_run.module_of(t)
                                                         for t in interpreter_run.INTERPRETER_TESTS)))
def test_every_interpreted_case_passed(interpreted, module):
    cases = interpreted.get(module, [])
    assert cases, f"{module}: the interpreter run reported no case of it: {interpreter_run.SESSION.output_tail()}"
    bad = [f"{c['name']}: {c['outcome']}: {c['message']}" for c in cases if c["outcome"] != "passed"]
    assert not bad, f"{module}: {len(bad)} of {len(cases)} cases did not pass:\n" + "\n".join(bad)
