"""The benchmarks run as printed: ``cp_scaling.py --smoke`` end to end on the CPU, so a change that breaks
the benchmark (as max_tokens_per_step once did) fails the suite instead of the next GPU session.

Every ``--smoke`` run is a process of its own that asserts no time bound, so they all run one after another as this
module's background scenario (tests/background_fixtures.py, ``time_bounds=False``): from the session's start,
beside other tests, instead of ~3 minutes of the suite waiting on them one at a time. Each test asserts on its run's
JSON once the scenario has finished."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import background_fixtures
import cpattn
import interpreter_run

ROOT = Path(__file__).resolve().parents[1]
SMOKES = {"cp_scaling.py": 600, "shared_prefix.py": 600, "profile_begin.py": 600, "op_cost.py": 300,
          "plan_cost.py": 300, "shared_prefix_host.py": 300, "shared_prefix_begin.py": 300, "steady_rows_cost.py": 300}
"""Each benchmark's --smoke run and its timeout (s)."""
NEEDS_TRITON = {"steady_rows_cost.py"}   # TRITON's builder under the Triton interpreter


def _triton_env() -> dict | None:
    """The environment a NEEDS_TRITON script runs in: this one where triton imports, else with the triton that
    scripts/test.sh's setup put aside (tests/interpreter_run.py) on its path; None: no triton here."""
    if importlib.util.find_spec("triton") is not None:
        return dict(os.environ)
    return None if interpreter_run.unavailable() is not None else interpreter_run.triton_env()


def _run_smokes(scenario) -> dict:
    """``python benchmarks/<script> --smoke --json ...`` for every script, as printed: {script: (exit status, the
    output's tails, the JSON file)}; the files live in ``["dir"]`` until the module ends."""
    out = Path(tempfile.mkdtemp(prefix="cpattn-smokes-"))
    runs = {"dir": out}
    try:
        for script, timeout_s in SMOKES.items():
            env = _triton_env() if script in NEEDS_TRITON else None
            if script in NEEDS_TRITON and env is None:
                continue
            json_path = out / f"{Path(script).stem}.json"
            proc = subprocess.Popen([sys.executable, f"benchmarks/{script}", "--smoke", "--json", str(json_path)],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            try:
                stdout, stderr = background_fixtures.communicate(proc, timeout_s, scenario.aborted)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                stderr += f"\n(killed after its {timeout_s} s timeout)"
            runs[script] = (proc.returncode, stdout[-3000:] + stderr[-3000:], json_path)
        return runs
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


background_fixtures.register(__file__, _run_smokes, time_bounds=False)


@pytest.fixture(scope="module")
def smokes():
    with background_fixtures.result_in_dir(__file__) as finished:
        yield finished


def _smoke_json(smokes: dict, script: str) -> dict:
    """The JSON ``benchmarks/<script> --smoke`` wrote, once it exited 0."""
    code, tails, json_path = smokes[script]
    assert code == 0, tails
    return json.loads(json_path.read_text())


def _smoke_rows(smokes: dict, script: str) -> list[dict]:
    return _smoke_json(smokes, script)["rows"]


def test_cp_scaling_smoke_runs_every_case(smokes):
    rows = _smoke_rows(smokes, "cp_scaling.py")
    got = {(r["case"], r["gpus"]) for r in rows}
    cases = {"decode_smoke", "decode_b4_smoke", "prefill_smoke", "chunked_smoke", "decode_fp8_w64_smoke",
             "chunked_fp8_w64_smoke", "chunked_alt64_smoke"}
    assert got == {(c, g) for c in cases for g in (1, 2)}
    alt = [r for r in rows if r["case"] == "chunked_alt64_smoke"]   # full and windowed layers, the prefill named
    assert all(r["window_every"] == 2 and r["prefill_backend"] == "TORCH" for r in alt), alt
    for r in rows:
        assert r["ms_per_layer"] > 0 and math.isfinite(r["kernel_ms"]) and r["plan_ms_per_step"] > 0, r
        assert 0 < r["begin_ms_per_step"] < r["step_ms"] and math.isnan(r["kernel_graph_ms"]), r   # no graphs on CPU
        assert r["begin_ms_per_step"] <= r["begin_ms_max"] < r["step_ms_max"] and r["step_ms"] <= r["step_ms_max"], r
        assert 0 < r["attend_ms_per_layer"] < r["ms_per_layer"], r
        parts = r["begin_parts_ms"]   # phases, some within others ("begin" holds "begin_rpc"): each within begin
        assert "begin" in parts and all(0 <= v <= r["begin_ms_per_step"] * 1.01 + 1e-3 for v in parts.values()), r
        assert r["data_plane"] == "gloo", r       # CPU shards are reached over gloo
        if r["case"].startswith("decode"):   # whole segments of one extended run: no begin_step while measured
            n = r["decode_run_steps"]
            assert n == 8 and r["measured_steps"] % n == 0 and r["measured_begin_step_calls"] == 0, r
            assert r["decode_run_extend"] is True, r


def test_shared_prefix_smoke_forks_hold_one_copy(smokes):
    rows = {r["way"]: r for r in _smoke_rows(smokes, "shared_prefix.py")}
    assert set(rows) == {"one", "shared", "separate"} and rows["shared"]["batch"] == rows["separate"]["batch"] == 4
    # 250 tokens over 2 shards (125 each) in pages of 4: 32 + 32 pages per copy of the document.
    assert rows["one"]["kv_blocks"] == rows["shared"]["kv_blocks"] == 64
    assert rows["separate"]["kv_blocks"] == 4 * 64
    assert all(r["step_ms"] > 0 and r["backend"] == "TORCH" for r in rows.values())


def test_plan_cost_smoke_measures_every_part(smokes):
    """benchmarks/plan_cost.py (the coordinator's planning and its messages, no Ray) runs as printed."""
    rows = {r["case"]: r for r in _smoke_rows(smokes, "plan_cost.py")}
    assert set(rows) == {"decode_smoke", "decode_b4_smoke", "prefill_smoke", "decode_b4_w_smoke"}
    # The same runs with a window on every layer: the commits gave back the pages before it.
    assert rows["decode_b4_w_smoke"]["blocks_used"] < rows["decode_b4_smoke"]["blocks_used"] / 4
    assert rows["decode_smoke"]["steps_per_begin"] == cpattn.ServiceConfig.model_fields["decode_run_steps"].default and rows["prefill_smoke"]["steps_per_begin"] == 1
    for r in rows.values():
        assert r["plan_ms_per_step"] > 0 and r["messages_ms_per_step"] > 0 and r["kb_sent"] > 0, r


def test_steady_rows_cost_smoke_times_every_part(smokes):
    """benchmarks/steady_rows_cost.py (SteadyRun.of on the CPU, TRITON's builder under the Triton interpreter)."""
    if _triton_env() is None:
        pytest.skip(f"no triton here, and {interpreter_run.unavailable()}")
    rows = {r["case"]: r for r in _smoke_rows(smokes, "steady_rows_cost.py")}
    assert set(rows) == {"b4_smoke", "b4_fp8_w64_smoke"}
    for r in rows.values():
        assert 0 < r["of_ms_median"] <= r["of_ms_max"] and r["keys_ms"] > 0 and r["pack_ms"] > 0, r
    assert rows["b4_fp8_w64_smoke"]["written_ms"] > 0 and rows["b4_smoke"]["written_ms"] == 0   # fp8 scales only
    assert rows["b4_fp8_w64_smoke"]["bytes_per_step"] > rows["b4_smoke"]["bytes_per_step"]


def test_shared_prefix_host_smoke_splits_every_fork_step(smokes):
    """benchmarks/shared_prefix_host.py (a decode step's host work for forks vs copies, no Ray, no GPU) runs as
    printed; every step of the forks' runs takes the cascade split, no step of the others does."""
    result = _smoke_json(smokes, "shared_prefix_host.py")
    rows = {r["way"]: r for r in result["rows"]}
    assert set(rows) == {"one", "shared", "separate"} and rows["shared"]["batch"] == 4
    assert rows["shared"]["split_steps"] == 3 * rows["shared"]["steps_per_run"]   # every step on each of 3 shards
    assert rows["one"]["split_steps"] == rows["separate"]["split_steps"] == 0
    for r in rows.values():
        assert r["coordinator_ms_per_step"] > 0 and r["shard_ms_per_step"] > 0, r


def test_shared_prefix_begin_smoke_opens_a_fork_step_with_one_questions_device_ops(smokes):
    """benchmarks/shared_prefix_begin.py (a decode run's step opened on the client, forks vs one question, no GPU)
    runs as printed; forks' steps move and launch no more on the device than one question's (issue 24: the prefix
    pass is planned once per prefix), a run's first step included once the prefix was planned by a run before."""
    result = _smoke_json(smokes, "shared_prefix_begin.py")
    rows = {r["way"]: r for r in result["rows"]}
    assert set(rows) == {"one", "shared"} and rows["shared"]["batch"] == 4
    assert rows["shared"]["device_ops"] == rows["one"]["device_ops"] > 0
    assert rows["shared"]["first_device_ops"] == rows["one"]["first_device_ops"] > 0
    assert rows["shared"]["host_ms"] > 0 and rows["one"]["first_host_ms"] > 0


def test_cp_scaling_sizes_every_gpu_case_within_its_budget():
    """Every published GPU case, at 1 and 2 GPUs and the README's repeat counts, allocates no more KV per GPU
    than --kv-budget-gb (a prefill once charged every repeat's tokens: 214 GB asked of a 140 GB H200)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cp_scaling as cs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    budget = 96.0
    for case in cs.CASES.values():
        for gpus in (1, 2, 8):
            for repeats in (10, 40):
                layers = cs.layers_that_fit(case, gpus, 32, budget, repeats)
                blocks = cs._blocks_per_shard(case, gpus, repeats)
                per_gpu = layers * blocks * cs.BLOCK * cs._kv_bytes_per_token_layer(case)
                tokens = case.batch * (case.context + case.new * (repeats + 2 if case.context else 1))
                assert blocks * cs.BLOCK * gpus >= tokens, (case, gpus, repeats)          # every step's tokens fit
                assert layers == 1 or per_gpu <= budget * 2**30, (case, gpus, repeats, per_gpu / 2**30)
    prefill = cs.CASES["prefill_32k"]
    assert cs._blocks_per_shard(prefill, 1, 40) == cs._blocks_per_shard(prefill, 1, 10)   # freed every step


def test_profile_begin_smoke_splits_opening_by_phase(smokes):
    """benchmarks/profile_begin.py (issue 18: where opening a decode step spends the caller's time) runs as
    printed: the service's measured steps are whole segments of one extended run (none asks the coordinator; each
    segment asks for its extension), their phases add up to begin_s, and the client part times a run's later steps
    without Ray."""
    result = _smoke_json(smokes, "profile_begin.py")
    cases = {"decode_smoke", "decode_b4_smoke", "decode_fp8_w64_smoke"}
    assert {r["case"] for r in result["service"]} == {r["case"] for r in result["client"]} == cases
    for r in result["service"]:
        assert r["steps"] == 8 and r["run_starts"] == 0 and r["decode_run_extend"], r   # two segments of 4, one run
        assert r["begin_ms_run_start"] is None and 0 < r["begin_ms_later"] < r["step_ms"], r
        assert r["begin_ms_per_step"] <= r["begin_ms_max"], r
        assert 0 < r["attend_ms_per_layer"] * r["layers"] < r["step_ms"], r
        # no graphs on the CPU: every later step is planned, each segment's first two as the rest
        assert r["planned_steps"] == 8 and r["steady_steps"] == 0 and r["begin_ms_planned"] > 0, r
        phases = r["phases_ms_per_step"]
        assert math.isclose(phases["claim"] + phases["flush"] + phases["begin"], r["begin_ms_per_step"],
                            rel_tol=0.05, abs_tol=0.01), r
        host = sum(v for k, v in phases.items() if k not in ("claim", "flush", "begin"))
        assert 0 < host <= phases["begin"] * 1.001 + 0.001, r   # the host's parts lie within its begin
        assert "begin_rpc" not in r["phases_ms_later"] and "extend" in r["phases_ms_later"], r
        assert "run_next" in r["phases_ms_later"] and r["cprofile_open"] and r["end_ms_per_step"] > 0, r
        assert set(r["gc_ms_per_open"]) == {"0", "1", "2"} and r["torch_profile_open"], r
    for r in result["client"]:
        assert r["later_step_ms"] > 0 and r["run_start_ms"] > 0 and r["cprofile_later"] and r["backend"] == "TORCH", r


def test_op_cost_smoke_times_every_call_at_every_stage(smokes):
    """benchmarks/op_cost.py (issue 18: what a small torch call costs the client's thread on an H200 host) runs as
    printed: every call timed before Ray, while the GPU is busy, with Ray, with the service up and inside a run."""
    result = _smoke_json(smokes, "op_cost.py")
    rows = result["us_per_call"]
    assert list(rows) == ["bare", "busy", "ray", "service", "run"]
    assert {"q|k|v: 3 copy_", "q|k|v: cat", "out clone"} <= set(rows["bare"]), rows
    assert all(set(r) == set(rows["bare"]) and all(0 < us < 1e5 for us in r.values()) for r in rows.values()), rows
