"""scripts/gpu_sweep.sh on a machine without CUDA: it runs scripts/test_gpu.sh's parts in order, writes three files
to $OUT whatever the number of parts (a device call brings back at most 8: the table, every part's counts and cases
in one JSON, the logs' tails) and each part's JUnit XML and log to $SWEEP_RAW, does not start a part whose usual
time no longer fits its budget (so a device call ends cleanly, saying what is left), and refuses an unknown part
before running anything. test_gpu.sh narrows a part's own -k with the caller's. A part cut before pytest's report
still says what ran and where it was cut (tests/case_log.py), and RESUME_FROM runs again only what did not pass.
The GPU cases themselves skip here; on the device the same scripts run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sweep(tmp_path: Path, budget_s: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path), BUDGET_S=str(budget_s), PYTHON=sys.executable,
               SWEEP_RAW=str(tmp_path.parent / f"{tmp_path.name}_raw"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", "scripts/gpu_sweep.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_sweep_runs_what_fits_and_lists_what_did_not(tmp_path):
    # usergraph (usually 90 s) fits 100 s; kernels (240 s) then does not and is listed, not started. The -k
    # selects no case, so this takes seconds on a GPU machine too.
    proc = _sweep(tmp_path, 100, "usergraph", "kernels", "--", "-k", "no_case_is_named_this")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "sweep_summary.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): line for line in summary[2:]}
    assert set(rows) == {"usergraph", "kernels"}, summary
    assert "not started" in rows["kernels"] and "it usually takes 240 s" in proc.stdout
    assert "not started" not in rows["usergraph"] and "nothing ran" in rows["usergraph"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json", "sweep_summary.md", "sweep_tails.log"]
    raw = tmp_path.parent / f"{tmp_path.name}_raw"
    assert (raw / "sweep_usergraph.xml").exists() and not (raw / "sweep_kernels.xml").exists()
    parts = json.loads((tmp_path / "sweep.json").read_text())
    assert set(parts) == {"usergraph"} and parts["usergraph"]["failures"] == parts["usergraph"]["errors"] == 0
    assert "== usergraph (rc 5" in (tmp_path / "sweep_tails.log").read_text()


def test_sweep_refuses_an_unknown_part_before_running_anything(tmp_path):
    proc = _sweep(tmp_path, 600, "kernels", "kernals")
    assert proc.returncode == 2 and "unknown part 'kernals'" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_callers_k_narrows_a_parts_own_filter():
    """pytest keeps only the last -k: `flashinfer -k release` ran every backend's release cases before."""
    env = dict(os.environ, PYTHON="echo")   # test_gpu.sh then prints the pytest command it would run
    run = lambda *a: subprocess.run(["bash", "scripts/test_gpu.sh", *a], cwd=ROOT, env=env, capture_output=True,
                                    text=True, timeout=60).stdout
    assert "tests/gpu -k (FLASHINFER) and (release) -x" in run("flashinfer", "-k", "release", "-x")
    assert "-k not FLASHINFER --maxfail 2" in run("kernels", "--maxfail", "2")
    assert "test_decode_graph_gpu.py -k two_gpus" in run("usergraph", "-k", "two_gpus")


CUT_RUN = '''
import time, pytest
def test_passes(): pass
def test_skips(): pytest.skip("needs 2 GPUs")
def test_fails(): assert 1 == 2, "the one that failed"
def test_runs_past_the_cut(): time.sleep(60)
'''


def test_a_run_cut_before_its_report_still_says_what_ran_and_where_it_was_cut(tmp_path):
    """tests/case_log.py writes each phase as it ends; junit_json reads that when pytest never wrote its XML."""
    (tmp_path / "test_cut.py").write_text(CUT_RUN)
    log, xml, summary = tmp_path / "cases.jsonl", tmp_path / "never_written.xml", tmp_path / "summary.json"
    env = dict(os.environ, CPATTN_CASE_LOG=str(log), PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "case_log", "-p", "no:cacheprovider",
                             "-o", "addopts=", f"--rootdir={tmp_path}", f"--junitxml={xml}",
                             str(tmp_path / "test_cut.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:   # killed inside the last case, as a part cut at its budget is
        deadline = time.monotonic() + 60
        while "test_runs_past_the_cut" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its last case"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not xml.exists()
    subprocess.run([sys.executable, "benchmarks/junit_json.py", str(xml), str(summary), str(log)], cwd=ROOT,
                   check=True, timeout=60)
    result = json.loads(summary.read_text())
    outcomes = {c["name"].split("::")[-1]: c["outcome"] for c in result["cases"]}
    assert outcomes == {"test_passes": "passed", "test_skips": "skipped", "test_fails": "failure"}, result
    assert (result["tests"], result["failures"], result["errors"], result["skipped"]) == (3, 1, 0, 1)
    assert result["complete"] is False and [c.split("::")[-1] for c in result["cut_in"]] == ["test_runs_past_the_cut"]
    failed = next(c for c in result["cases"] if c["outcome"] == "failure")
    assert "the one that failed" in failed["message"]


def test_resume_from_an_earlier_sweep_runs_again_only_what_did_not_pass(tmp_path):
    earlier = tmp_path.parent / f"{tmp_path.name}_earlier.json"
    passed = ["tests/gpu/test_decode_graph_gpu.py::test_a[1]", "tests/gpu/test_decode_graph_gpu.py::test_b"]
    earlier.write_text(json.dumps({"usergraph": {"cases": [
        *({"name": n, "outcome": "passed"} for n in passed),
        {"name": "tests/gpu/test_decode_graph_gpu.py::test_c", "outcome": "failure"},
        {"name": "tests.gpu.test_decode_graph_gpu::test_d", "outcome": "passed"}]}}))   # JUnit's name: no node id
    env_resume = dict(os.environ, RESUME_FROM=str(earlier))
    proc = subprocess.run(["bash", "scripts/gpu_sweep.sh", "usergraph", "kernels", "--", "-k", "no_case_is_named_this"],
                          cwd=ROOT, env=dict(env_resume, OUT=str(tmp_path), BUDGET_S="100", PYTHON=sys.executable,
                                             SWEEP_RAW=str(tmp_path.parent / f"{tmp_path.name}_raw")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("|")[1].strip(): line for line in (tmp_path / "sweep_summary.md").read_text().splitlines()[2:]}
    assert "2 cases passed before (RESUME_FROM), not run again" in rows["usergraph"], rows
    cases = json.loads((tmp_path / "sweep.json").read_text())["usergraph"]["cases"]
    assert [(c["name"], c.get("earlier")) for c in cases] == [(n, True) for n in passed]   # a third call resumes here
