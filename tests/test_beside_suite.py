"""tests/beside_suite.py: the modules it names run in a pytest process beside the suite and report in it, each test
in its place, with its own outcome, failure text and skip reason; a test the process never reported fails with why.
Run on copies of the suite's conftest.py and helpers in a directory of their own, with two small modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import background_fixtures
import beside_suite
import suite_lanes

HERE = Path(__file__).resolve().parent

PLAIN = '''
import os

def test_one():
    open(os.environ["PID_FILE"], "a").write(f"here {os.getpid()}\\n")

def test_two():
    assert 1 + 1 == 2
'''

THERE = '''
import os
import pytest

def test_where():
    open(os.environ["PID_FILE"], "a").write(f"there {os.getpid()}\\n")

def test_fails():
    assert "the value" == "boom-123"

def test_skips():
    pytest.skip("no such thing here")

@pytest.mark.parametrize("n", [1, 2])
def test_params(n):
    assert n in (1, 2)
'''

CRASHES = '''
import os

def test_before():
    pass

def test_crashes():
    if "CPATTN_BESIDE_REPORT" in os.environ:
        os._exit(3)

def test_after():
    pass
'''


def _suite_dir(tmp_path: Path, modules: dict[str, str]) -> Path:
    for helper in ("conftest.py", "background_fixtures.py", "beside_suite.py", "suite_lanes.py"):
        shutil.copy(HERE / helper, tmp_path / helper)
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _pytest(where: Path, beside: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    env = dict(os.environ, CPATTN_TEST_BESIDE=beside, PID_FILE=str(where / "pids.txt"))
    env.pop("CPATTN_BESIDE_REPORT", None)
    env.pop("CPATTN_TEST_BACKGROUND", None)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfs",
                             "--rootdir", str(where), *args], cwd=where, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out), proc.pid


needs_background = pytest.mark.skipif(not background_fixtures.can_raise_priority(),
                                      reason="runs beside only as root (where background scenarios run)")


@needs_background
def test_a_module_beside_reports_each_test_in_its_place(tmp_path):
    where = _suite_dir(tmp_path, {"test_plain.py": PLAIN, "test_there.py": THERE})
    done, pid = _pytest(where, "test_there.py", "-vv")   # -q -vv: one line a test
    out = done.stdout
    assert done.returncode == 1, out
    assert "1 failed, 5 passed, 1 skipped" in out, out
    assert "assert 'the value' == 'boom-123'" in out and "FAILED test_there.py::test_fails" in out, out
    assert "no such thing here" in out, out
    assert "5 tests of test_there.py ran in a pytest process beside the suite" in out, out
    # Each test's own line, in the session's order: the plain module first, then the module run beside.
    lines = [line for line in out.splitlines() if "::test_" in line and ("PASSED" in line or "FAILED" in line
                                                                          or "SKIPPED" in line)]
    assert [line.split()[0] for line in lines][:7] == [
        "test_plain.py::test_one", "test_plain.py::test_two", "test_there.py::test_where", "test_there.py::test_fails",
        "test_there.py::test_skips", "test_there.py::test_params[1]", "test_there.py::test_params[2]"], out
    pids = dict(line.split() for line in (where / "pids.txt").read_text().splitlines())
    assert int(pids["here"]) == pid and int(pids["there"]) != pid


@needs_background
def test_tests_the_process_never_reported_fail_with_why(tmp_path):
    where = _suite_dir(tmp_path, {"test_plain.py": PLAIN, "test_crashes.py": CRASHES})
    done, _ = _pytest(where, "test_crashes.py")
    out = done.stdout
    assert done.returncode == 1 and "2 failed, 3 passed" in out, out
    assert "FAILED test_crashes.py::test_crashes" in out and "FAILED test_crashes.py::test_after" in out, out
    assert "the pytest process beside the suite ended with exit status 3 before this test reported" in out, out


@needs_background
def test_only_modules_beside_selected_run_here(tmp_path):
    """Nothing else to overlap: they run in this process, as before."""
    where = _suite_dir(tmp_path, {"test_there.py": THERE})
    done, pid = _pytest(where, "test_there.py", "test_there.py")
    assert "1 failed, 3 passed, 1 skipped" in done.stdout and "beside the suite" not in done.stdout, done.stdout
    assert (where / "pids.txt").read_text().split() == ["there", str(pid)]


def test_modules_beside_have_no_time_bounds_and_no_scenario():
    """A module beside runs while other tests do: none of its tests may be alone (a time bound, a short timeout),
    and a module with a background scenario is already beside the suite."""
    for module in beside_suite.BESIDE_MODULES:
        assert (HERE / module).exists(), module
        assert module not in suite_lanes.ALONE_MODULES and module not in suite_lanes.LIGHT_MODULES, module
        assert not any(t.startswith(module + "::") for t in suite_lanes.ALONE_TESTS), module
        assert "background_fixtures.register" not in (HERE / module).read_text(), module
        assert "--address" not in (HERE / module).read_text(), module   # `auto` with two clusters here: see test_cli
