"""The TRITON kernels' CPU tests (Triton's interpreter) in a pytest process of their own, beside the suite.

Those tests need triton and TRITON_INTERPRET=1, which the suite's own process must not have (it is the CPU machine a
user has: no triton). scripts/setup.sh installs triton into .venv/triton-interpret, and this runs INTERPRETER_TESTS
there: that directory on PYTHONPATH, TRITON_INTERPRET=1, one JUnit XML. It is pure CPU work (~170 s alone on a
2-core box, no Ray), so it runs from the session's start under SCHED_IDLE (and nice 19): it takes what the suite
leaves idle (a service start's waits, a lease or a timeout running out) and yields the CPU to everything else at
once, so no time bound of the suite's is touched. tests/test_triton_interpreter_run.py asserts its results, one test
per module, last in the session (conftest.py), so the run has the whole suite to finish in. Measured on CI's kind
of box (2026-12-07): at nice 19 alone, 489 s beside the suite and the suite 1-2 minutes longer; under SCHED_IDLE,
530 s beside it and the suite 15m09s in pytest, within its spread without it (14m41s-16m00s).

Run alone (`pytest tests/test_triton_interpreter_run.py`, xdist, CPATTN_TEST_BACKGROUND=0), the fixture runs it
in the foreground. Without .venv/triton-interpret (not Linux x86_64, a CUDA torch), its tests skip and say why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRITON_DIR = ROOT / ".venv" / "triton-interpret"
MODULE = "test_triton_interpreter_run.py"
INTERPRETER_TESTS = (
    "tests/test_triton_interpret.py", "tests/test_triton_decode_heads_interpret.py",
    "tests/test_triton_decode_fp8_mma_interpret.py", "tests/test_triton_decode_variants_interpret.py",
    "tests/test_fp8_graphs_interpret.py", "tests/test_cascade_graphs_interpret.py",
    "tests/test_prefix_into_rows_interpret.py", "tests/test_kernel_sweeps_interpret.py",
    "tests/test_steady_run.py", "tests/test_decode_host_refill.py",
    "tests/test_prefix_pass_kept.py::test_triton_builder_plans_without_reading_device_slots",
    "tests/test_prefill_backend.py::test_triton_and_torch_paired_in_the_interpreter",
)
NICE = 19
TIMEOUT_S = 1500   # alone it takes ~3 minutes; beside a busy suite it gets what the suite leaves idle


def unavailable() -> str | None:
    """Why the interpreter run cannot happen here, or None."""
    import torch

    if torch.cuda.is_available():
        return "a machine with CUDA runs the TRITON kernels themselves (tests/gpu), not the interpreter"
    if not (TRITON_DIR / "triton").is_dir():
        return f"no {TRITON_DIR.relative_to(ROOT)}: scripts/setup.sh installs triton there on Linux x86_64 with a CPU torch"
    return None


def triton_env() -> dict:
    """This process's environment with the triton set aside first on the path (then the checkout) and
    TRITON_INTERPRET=1: what a process that runs the TRITON kernels on the CPU needs."""
    path = os.pathsep.join(p for p in (str(TRITON_DIR), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1")


def importorskip_triton() -> None:
    """At a module's top: pytest.importorskip("triton"), its reason naming where the suite runs the module."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("no triton in the suite's own process: scripts/test.sh runs this module beside it, with triton "
                    f"(tests/interpreter_run.py; its results: tests/{MODULE})", allow_module_level=True)


def module_of(test: str) -> str:
    return test.split("::", 1)[0].rsplit("/", 1)[-1]


class InterpreterRun:
    """One pytest process over INTERPRETER_TESTS: started once, waited for, its JUnit cases by module."""

    def __init__(self) -> None:
        self._dir: Path | None = None   # made at start (every session imports this module)
        self._proc: subprocess.Popen | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.returncode: int | None = None
        self.took_s: float | None = None
        self.nice: int | None = None

    def start(self, nice: int = NICE) -> None:
        self.nice = nice
        self._dir = Path(tempfile.mkdtemp(prefix="cpattn-interpret-"))
        env = dict(triton_env(), CPATTN_TEST_BACKGROUND="0")
        argv = ["nice", "-n", str(nice), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-o", "addopts=", f"--junitxml={self._dir / 'junit.xml'}", *INTERPRETER_TESTS]
        out = open(self._dir / "output.log", "w")
        # Its own process group (killing it at the end ends any subprocess a sweep smoke started), in this session:
        # a new session would be a scheduler autogroup of its own, which Linux weighs equal to the suite's whatever
        # its nice value (CI, 2026-12-07: the suite took 19m48s in pytest beside it, not ~14m45s).
        self._proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
        out.close()
        if nice > 0:
            with contextlib.suppress(OSError):   # SCHED_IDLE: CPU only when nothing else wants it (children inherit)
                os.sched_setscheduler(self._proc.pid, os.SCHED_IDLE, os.sched_param(0))
        self._thread = threading.Thread(target=self._wait, name="interpreter-run", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        started = time.monotonic()
        try:
            self.returncode = self._proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
        finally:
            self.took_s = time.monotonic() - started
            self._done.set()

    def started(self) -> bool:
        return self._proc is not None

    def stop(self) -> None:
        """Kill its process group if it still runs (the session ended first, or it ran past TIMEOUT_S)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def cases(self) -> dict[str, list[dict]]:
        """Each module's cases once the run ended: name, outcome (passed/failed/error/skipped) and message."""
        if not self._done.wait(TIMEOUT_S + 60):
            raise TimeoutError(f"the Triton interpreter run did not end within {TIMEOUT_S} s")
        path = self._dir / "junit.xml"
        if not path.exists():
            raise RuntimeError(f"the Triton interpreter run wrote no report (exit status {self.returncode}): "
                               f"{self.output_tail()}")
        by_module: dict[str, list[dict]] = {}
        for case in ET.parse(path).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
                    message = child.get("message") or (child.text or "")[-2000:]
                    break
            module = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
            by_module.setdefault(module, []).append({"name": case.get("name"), "outcome": outcome,
                                                     "message": message})
        return by_module

    def output_tail(self, chars: int = 3000) -> str:
        path = None if self._dir is None else self._dir / "output.log"
        return path.read_text(errors="replace")[-chars:] if path is not None and path.exists() else "(no output)"

    def summary(self) -> str | None:
        """One line for the terminal summary, once it ran."""
        if self.took_s is None:
            return None
        where = f"beside the suite (SCHED_IDLE, nice {self.nice})" if self.nice else "in the foreground"
        return f"{MODULE}: the Triton interpreter's tests ran {where} for {self.took_s:.1f} s (exit {self.returncode})"

    def cleanup(self) -> None:
        import shutil

        self.stop()
        if self._thread is not None:
            self._thread.join(TIMEOUT_S + 60)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


SESSION = InterpreterRun()
