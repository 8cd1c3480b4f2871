"""The next GPU session's sweep commands run: ``triton_decode_sweep.py --fp8-sweep`` and ``prefix_pass_sweep.py`` with
``--smoke`` (tiny shapes, the CPU, Triton's interpreter) end to end: data, float64 references, candidates, winner,
the line to paste, JSON; and ``fp8_mma_probe.py --smoke``. A change that breaks a sweep fails here, not in the GPU session's scarce minutes.

    TRITON_INTERPRET=1 PYTHONPATH=. <python with torch, triton> -m pytest tests/test_kernel_sweeps_interpret.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import interpreter_run

interpreter_run.importorskip_triton()
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton interpreter on the CPU: set TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "sweep.json"
    # The checkout first, then the caller's path (where triton may come from: tests/interpreter_run.py).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *extra, "--smoke", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("script, extra, entry, bound", [
    ("triton_decode_sweep.py", ("--fp8-sweep",), "fp8", 1e-1),
    ("prefix_pass_sweep.py", (), "query_groups", 1e-2)])
def test_sweep_smoke_prints_a_checked_winner_and_its_line(script, extra, entry, bound, tmp_path):
    result, stdout = _smoke(script, tmp_path, *extra)
    today = result["rows"][0]
    assert today["cfg"] == result["base"] and today["valid"] and "error" not in today
    assert all(v < bound for k, v in today.items() if k.endswith("rel"))
    assert result["winner"]["valid"] and result["adopt_line"].startswith(f'    "{entry}": {{')
    assert result["adopt_line"] in stdout
    line = result["adopt_line"].strip().rstrip(",")
    overrides = eval("{" + line + "}")   # the pasted line is a valid CONFIG_OVERRIDES entry
    assert set(overrides[entry]) <= set(result["base"])


def test_fp8_mma_probe_smoke_times_and_checks_each_tiling(tmp_path):
    """benchmarks/fp8_mma_probe.py (triton_decode_fp8_mma.py's kernel against bf16 and today's fp8) runs as printed:
    today's fp8 and the fp8-dot kernel at two lengths, each checked against float64, no NaN."""
    result, stdout = _smoke("fp8_mma_probe.py", tmp_path)
    rows = result["rows"]
    assert [r["keys"] for r in rows] == [256, 256, 512, 512] and "error" not in str(rows)
    assert all(r["rel"] < 1e-1 and r["ms"] > 0 for r in rows), rows
    assert all(r["nans"] == 0 for r in rows if r["cfg"] != "today's fp8"), rows
