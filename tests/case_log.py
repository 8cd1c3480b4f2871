"""Each test's phases written the moment they end (CPATTN_CASE_LOG=path: one JSON line each, appended), so a run cut
by a timeout before pytest writes its JUnit XML still says what ran, what each case took and which case it was in.
scripts/gpu_sweep.sh sets it: device calls end at a hard limit, and on 2026-12-07 (session 33) FlashInfer's part was
cut twice with nothing to show but a line of dots. benchmarks/junit_json.py reads the log back (from_case_log), and
a later sweep skips what passed (RESUME_FROM)."""

from __future__ import annotations

import json
import os

ENV = "CPATTN_CASE_LOG"
# Taken out of the environment when pytest loads this: a test that starts a pytest of its own must not log that
# run's cases as the part's.
PATH = os.environ.pop(ENV, None)


def _write(record: dict) -> None:
    if PATH:
        with open(PATH, "a") as f:   # one write a line
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"started": nodeid})


def pytest_runtest_logreport(report):
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "s": round(report.duration, 3)}
    if report.outcome != "passed":
        longrepr = report.longrepr   # a skip's is (file, line, reason); a failure's its traceback (the end says why)
        record["message"] = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr or ""))[-300:]
    _write(record)
