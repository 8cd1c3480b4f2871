"""A pytest run as a short JSON summary (counts, each case's outcome and time, failure messages), for the device runs
that bring back JSON under $OUT (scripts/gpu_sweep.sh, benchmarks/run_gpu_decode.sh fp8-tests).

    python benchmarks/junit_json.py REPORT.xml OUT.json [CASES.jsonl]

From the JUnit XML pytest writes at the end; or, given one, from the case log tests/case_log.py writes as the run
goes, which a run cut by its timeout still has: then the summary has `cut_in`, the cases started and not ended,
and `complete` says whether pytest got to write its report.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

OUTCOMES = ("failure", "error", "skipped")
# A case's phases (setup, call, teardown) as one outcome, in JUnit's words: the worst phase wins.
RANK = {"passed": 0, "skipped": 1, "error": 2, "failure": 3}


def summary(xml_path: str) -> dict:
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root[0]
    cases = []
    for case in suite.iter("testcase"):
        marks = [x for x in case if x.tag in OUTCOMES]
        cases.append(dict(name=f"{case.get('classname')}::{case.get('name')}", s=float(case.get("time", 0)),
                          outcome=marks[0].tag if marks else "passed",
                          message=(marks[0].get("message") or "")[:300] if marks else ""))
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return dict(counts, cases=cases)


def _phase_outcome(record: dict) -> str:
    if record["outcome"] == "failed":
        return "failure" if record["when"] == "call" else "error"
    return record["outcome"]


def from_case_log(log_path: str) -> dict:
    """Cases by node id (what `--deselect` takes), in the order they started."""
    cases: dict[str, dict] = {}
    case = lambda nodeid: cases.setdefault(nodeid, dict(name=nodeid, s=0.0, outcome="passed", message="", ended=False))
    with open(log_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:   # the last line of a process killed mid-write
                continue
            if "started" in record:
                case(record["started"])
                continue
            entry, outcome = case(record["nodeid"]), _phase_outcome(record)
            entry["s"] = round(entry["s"] + record["s"], 3)
            if RANK[outcome] > RANK[entry["outcome"]]:
                entry["outcome"], entry["message"] = outcome, record.get("message", "")
            entry["ended"] = entry["ended"] or record["when"] == "teardown"
    cut = [c["name"] for c in cases.values() if not c["ended"]]
    ended = [dict((k, v) for k, v in c.items() if k != "ended") for c in cases.values() if c["ended"]]
    count = lambda outcome: sum(c["outcome"] == outcome for c in ended)
    result = dict(tests=len(ended), failures=count("failure"), errors=count("error"), skipped=count("skipped"),
                  cases=ended)
    if cut:
        result["cut_in"] = cut   # the case each killed process was in
    return result


def main(xml_path: str, out_path: str, log_path: str | None = None) -> None:
    complete = os.path.exists(xml_path)
    if log_path and os.path.exists(log_path):
        result = dict(from_case_log(log_path), complete=complete)
    else:
        try:
            result = summary(xml_path)
        except (OSError, ET.ParseError) as exc:   # a run cut by its timeout before pytest wrote the report
            result = {"error": f"no JUnit XML: {exc}"}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
