"""Test modules that run in a pytest process of their own, beside the rest of the suite, and report here.

The suite is one serial pytest process on CI's 2 cores, and it mostly waits: a service's start is two worker
processes' imports one after the other (the coordinator's, then its shards'), a lease or a timeout runs out, a
subprocess starts. The background scenarios (background_fixtures.py) end within the first ~300 s of the ~500 s the
modules without time bounds take, which leaves a core idle for most of them. The modules in BESIDE_MODULES
(services on CPU, generous timeouts only, no `--address auto`, nothing written into the checkout) therefore run
in a second pytest process from the session's start, with an embedded Ray of their own under a private RAY_TMPDIR.

Each of their tests is still an item of this session, in its usual place in the count: when its turn comes
(conftest.py orders them after every other module without an alone test, so the second process has that long),
this session waits for the second process and replays the test's own reports (setup, call, teardown: outcome,
failure text, skip reason, duration), as pytest-xdist does for its workers. A test the second process never
reported (it crashed, or ran past CHILD_TIMEOUT_S) fails here with the process's last output.

Only a run of one process with the privilege for background scenarios (root, as on CI) delegates, and only when it
selected other modules too (`pytest tests/test_service_e2e.py` runs it here, as before); CPATTN_TEST_BACKGROUND=0
turns it off; CPATTN_TEST_BESIDE=a.py,b.py names other modules (tests/test_beside_suite.py uses it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BESIDE_MODULES = frozenset({
    "test_long_context_job_models.py", "test_reliability_hostile.py", "test_reliability_hostile_calls.py",
    "test_service_e2e.py", "test_service_window_release.py", "test_service_window_release_random.py",
})
CHILD_TIMEOUT_S = 900
REPORT_ENV = "CPATTN_BESIDE_REPORT"   # set in the second process: where its reports go (one JSON line each)
OUTPUT_TAIL = 4000


def beside_modules() -> frozenset[str]:
    named = os.environ.get("CPATTN_TEST_BESIDE")
    return frozenset(m for m in named.split(",") if m) if named is not None else BESIDE_MODULES


class Beside:
    """The second pytest process: started once, waited for, and its reports by node id."""

    def __init__(self, rootdir: Path, nodeids: list[str]):
        self.nodeids = set(nodeids)
        self._argv = nodeids
        self._rootdir = rootdir
        self._dir = Path(tempfile.mkdtemp(prefix="cpattn-beside-"))   # short: Ray's socket paths live under it
        self._done = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._reports: dict[str, list[dict]] = {}
        self.returncode: int | None = None
        self.took_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="beside-suite", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        report = self._dir / "reports.jsonl"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update({REPORT_ENV: str(report), "CPATTN_TEST_BACKGROUND": "0", "RAY_TMPDIR": str(self._dir)})
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *self._argv]
        try:
            with open(self._dir / "output.log", "w") as out:
                self._proc = subprocess.Popen(argv, cwd=self._rootdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)   # its Ray's processes go with its group
                try:
                    self.returncode = self._proc.wait(CHILD_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.stop()
            if report.exists():
                for line in report.read_text().splitlines():
                    entry = json.loads(line)
                    self._reports.setdefault(entry["nodeid"], []).append(entry)
        finally:
            self.took_s = time.monotonic() - started
            self._done.set()

    def stop(self) -> None:
        """Kill the second process's group (its pytest, its Ray), if it still runs."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        self._done.wait(CHILD_TIMEOUT_S + 60)

    def reports(self, nodeid: str) -> list[dict]:
        """The test's serialized reports (setup, call, teardown), once the second process ended; [] if none."""
        self.wait()
        return self._reports.get(nodeid, [])

    def output_tail(self) -> str:
        path = self._dir / "output.log"
        return path.read_text(errors="replace")[-OUTPUT_TAIL:] if path.exists() else "(no output)"

    def missing_why(self) -> str:
        if self.returncode is None:
            return f"did not end within {CHILD_TIMEOUT_S} s and was killed"
        return f"ended with exit status {self.returncode} before this test reported"

    def cleanup(self) -> None:
        self.stop()
        self._thread.join(CHILD_TIMEOUT_S + 60)
        shutil.rmtree(self._dir, ignore_errors=True)

    def summary(self) -> str:
        took = "" if self.took_s is None else f" for {self.took_s:.1f} s"
        return f"{len(self.nodeids)} tests of {', '.join(sorted({n.split('::')[0].rsplit('/', 1)[-1] for n in self.nodeids}))} ran in a pytest process beside the suite{took}"


def record(config, report) -> None:
    """In the second process (REPORT_ENV set): append one report, serialized as pytest-xdist does."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "report": data}) + "\n")
