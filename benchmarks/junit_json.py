"""A pytest JUnit XML report as a short JSON summary (counts, each case's outcome and time, failure messages), for
the device runs that bring back JSON under $OUT (benchmarks/run_gpu_decode.sh fp8-tests).

    python benchmarks/junit_json.py REPORT.xml OUT.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

OUTCOMES = ("failure", "error", "skipped")


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


if __name__ == "__main__":
    try:
        result = summary(sys.argv[1])
    except (OSError, ET.ParseError) as exc:   # a run cut by its timeout before pytest wrote the report
        result = {"error": f"no JUnit XML: {exc}"}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
