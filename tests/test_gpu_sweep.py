"""scripts/gpu_sweep.sh on a machine without CUDA: it runs scripts/test_gpu.sh's parts in order, writes each part's
JUnit XML and JSON and one summary table, does not start a part whose usual time no longer fits its budget (so a
device call ends cleanly, saying what is left), and refuses an unknown part before running anything. The GPU
cases themselves skip here; on the device the same script runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sweep(tmp_path: Path, budget_s: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path), BUDGET_S=str(budget_s), PYTHON=sys.executable,
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
    assert (tmp_path / "sweep_usergraph.xml").exists() and not (tmp_path / "sweep_kernels.xml").exists()
    counts = json.loads((tmp_path / "sweep_usergraph.json").read_text())
    assert counts["failures"] == counts["errors"] == 0, counts


def test_sweep_refuses_an_unknown_part_before_running_anything(tmp_path):
    proc = _sweep(tmp_path, 600, "kernels", "kernals")
    assert proc.returncode == 2 and "unknown part 'kernals'" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
