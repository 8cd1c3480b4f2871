"""Where a decode step's opening spends the caller's time (issue 18: "plan per decode step <= 0.3 ms on the
client's path"), by phase, for cp_scaling's decode cases with the one shard computed in the client's process.

Two parts, both printed and written to ``--json``:

- service: the cases through the real service (``cpattn.start``, ``svc.step``), as cp_scaling measures them,
  after warm-up steps that bring decode runs to their steady length (runs start at FIRST_RUN_STEPS steps and
  double up to decode_run_steps: measured steps after only a few warm-ups would hold run starts a long decode loop
  does not pay). Per case: begin_s per step (mean over every measured step, as a decode loop pays
  it), split into the steps that start a run (begin_step's round trip) and the run's later steps, each by phase
  (StepRun.timings["begin_parts"]: claim, flush, steady (a steady run's step: its rows into the graphs), run_next,
  announce, end_run, begin_rpc, tables, local_plans, wire, steady_rows (a run's rows to the device), client_graphs,
  extend (asking for the run's next steps, once per segment)); the whole step's wall time too (a cost moved from opening to attending shows there);
  and a cProfile top-N of ``step.open`` over the measured steps (``--torch-profile``: torch.profiler's too).
- client: the client's work for a decode run's later steps without Ray (plan_cost's coordinator state owners,
  its begin_step reply pickled as Ray carries it): per step, building the step's plans (decode_run_plans
  client_step) and the in-process shard's plan (ShardLayerRunner.plan: the backend's metadata, device copies,
  CUDA graph refill on a GPU), with a cProfile top-N. Runs on the CPU too (TORCH there, or TRITON's builder under
  the Triton interpreter's venv).

    python benchmarks/profile_begin.py [--cases decode_128k,decode_1m,...] [--json PATH]     # one H200
    python benchmarks/profile_begin.py --smoke     # tiny shapes on the CPU (TORCH, gloo): the test suite runs it
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pickle
import platform
import pstats
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_scaling as cp  # noqa: E402  (its cases, shapes and service sizing)

CASES = ("decode_128k", "decode_1m", "decode_b64_32k", "decode_1m_fp8", "decode_1m_w4096")
SMOKE_CASES = ("decode_smoke", "decode_b4_smoke", "decode_fp8_w64_smoke")
PHASES = ("claim", "flush", "end_run", "begin_rpc", "tables", "steady", "run_next", "announce", "local_plans", "wire",
          "steady_rows", "client_graphs", "extend")


def _top(profile: cProfile.Profile, n: int) -> list[dict]:
    """cProfile's top ``n`` functions by cumulative time, as rows."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls, "tottime_ms": 1e3 * tottime,
                     "cumtime_ms": 1e3 * cumtime})
    return sorted(rows, key=lambda r: -r["cumtime_ms"])[:n]


def _phase_means(samples: list[dict]) -> dict[str, float]:
    """ms per step of each phase over ``samples`` (a phase a step did not go through counts 0 for it)."""
    names = [p for p in PHASES if any(p in s for s in samples)] + sorted({p for s in samples for p in s} - set(PHASES))
    return {p: 1e3 * sum(s.get(p, 0.0) for s in samples) / len(samples) for p in names} if samples else {}


# The service ---------------------------------------------------------------------------------------------------------
class GcPauses:
    """Seconds the garbage collector ran (by generation) while counting: a collection landing in a step's opening
    costs that step milliseconds a profile by function does not show."""

    def __init__(self):
        self.counting, self.seconds, self._start = False, {0: 0.0, 1: 0.0, 2: 0.0}, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.counting:
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def _inside_openings(tracer, steps: int, top: int) -> list[dict]:
    """torch.profiler's events inside the openings (the "cpattn.open" ranges), by self CPU time per step."""
    totals: dict[str, list] = {}

    def walk(event) -> None:
        for child in event.cpu_children:
            entry = totals.setdefault(child.name, [0, 0.0])
            entry[0] += 1
            entry[1] += child.self_cpu_time_total
            walk(child)

    for event in tracer.events():
        if event.name == "cpattn.open":
            walk(event)
    rows = [{"name": name, "calls_per_step": n / steps, "self_cpu_ms_per_step": us / 1e3 / steps}
            for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r["self_cpu_ms_per_step"])[:top]


def _step(svc, request: dict, layers: int, q, k, v, profile: cProfile.Profile | None = None,
          pauses: GcPauses | None = None):
    """One whole step as cp_scaling runs it (``profile``: around its opening only); returns (step, wall s)."""
    sync = torch.cuda.synchronize if cp.DEVICE == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    step = svc.step(request)
    if profile is not None:
        profile.enable()
    if pauses is not None:
        pauses.counting = True
    try:
        with torch.profiler.record_function("cpattn.open"):   # a no-op unless a profiler runs (--torch-profile)
            step.__enter__()
    finally:
        if pauses is not None:
            pauses.counting = False
        if profile is not None:
            profile.disable()
    try:
        for layer in range(layers):
            step.attend(layer, q, k, v)
    except BaseException as exc:
        step.__exit__(type(exc), exc, exc.__traceback__)
        raise
    step.__exit__(None, None, None)
    sync()
    return step, time.perf_counter() - t0


def _at_full_run_boundary(gw, full: int) -> bool:
    """Between two runs of ``full`` steps, or (decode_run_extend) two segments of one extended run."""
    run = gw.run
    if run is None:
        return gw.run_length >= full
    return run.segment_start > 0 and run.index == run.segment_start and run.num_steps - run.segment_start >= full


def _split_later(begins: list[float], parts: list[dict], starts: list[bool]) -> dict:
    steady = [b for b, p, s in zip(begins, parts, starts) if not s and "steady" in p and "run_next" not in p]
    planned = [b for b, p, s in zip(begins, parts, starts) if not s and "run_next" in p]
    planned_parts = [p for p, s in zip(parts, starts) if not s and "run_next" in p]
    slowest = max(range(len(begins)), key=begins.__getitem__)
    return {"steady_steps": len(steady), "planned_steps": len(planned),
            "begin_ms_steady": 1e3 * statistics.fmean(steady) if steady else None,
            "begin_ms_planned": 1e3 * statistics.fmean(planned) if planned else None,
            # what a planned step and the slowest opening spend their time on (session 12's 4.3 ms at B=64)
            "phases_ms_planned": _phase_means(planned_parts),
            "phases_ms_slowest": {k: 1e3 * v for k, v in parts[slowest].items()}}


def measure_service(svc, case, layers: int, warmup: int, steps: int, top: int, torch_profile: bool) -> dict:
    """``warmup`` steps at least, then until a run of decode_run_steps steps has just ended (so the measured steps
    are the steady state a long decode loop reaches: whole runs of the full length), then ``steps`` measured."""
    q, k, v = (torch.randn(case.batch * case.new, h, cp.D, device=cp.DEVICE, dtype=cp.DTYPE)
               for h in (cp.HQ, cp.HK, cp.HK))
    seqs = [svc.add_sequence() for _ in range(case.batch)]
    for i, s in enumerate(seqs):
        svc.fill_synthetic(s, case.context, seed=i)
    request = {s: case.new for s in seqs}
    gw, full = svc.gateway, svc.config.decode_run_steps
    warmed = 0
    while warmed < warmup or not _at_full_run_boundary(gw, full):
        if warmed >= warmup + 4 * full:
            raise RuntimeError(f"{case.name}: decode runs never reached {full} steps (run_length {gw.run_length})")
        _step(svc, request, layers, q, k, v)
        warmed += 1
    # Timed without any profiler (cProfile and torch.profiler tripled the phases of session 9's first run), then
    # as many steps again under the profilers, for their tops only.
    walls, begins, ends, parts, starts, attends = [], [], [], [], [], []
    with GcPauses() as pauses:
        measured = [_step(svc, request, layers, q, k, v, None, pauses) for _ in range(steps)]
    profile = cProfile.Profile()
    tracer = None
    if torch_profile:   # on a GPU the CUDA runtime calls too (cudaStreamSynchronize, cudaMemcpyAsync, launches)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cp.DEVICE == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        tracer = torch.profiler.profile(activities=activities)
        tracer.__enter__()
    for _ in range(steps):
        _step(svc, request, layers, q, k, v, profile)
    for step, wall in measured:
        walls.append(wall)
        begins.append(step.timings["begin_s"])
        ends.append(step.timings.get("end_s", 0.0))
        attends.append(step.timings["data_plane_s"])
        parts.append(dict(step.timings["begin_parts"]))
        starts.append("begin_rpc" in step.timings["begin_parts"])   # this step asked the coordinator
    if tracer is not None:
        tracer.__exit__(None, None, None)
    firsts = [p for p, s in zip(parts, starts) if s]
    later = [p for p, s in zip(parts, starts) if not s]
    row = {"case": case.name, "batch": case.batch, "context": case.context, "kv_cache_dtype": case.kv,
           "window": case.window, "layers": layers, "warmup_steps": warmed, "steps": steps,
           "run_starts": len(firsts),
           "decode_run_steps": svc.config.decode_run_steps, "decode_run_extend": svc.config.decode_run_extend,
           "begin_ms_per_step": 1e3 * statistics.fmean(begins), "begin_ms_max": 1e3 * max(begins),
           "begin_ms_run_start": 1e3 * statistics.fmean(b for b, s in zip(begins, starts) if s) if firsts else None,
           "begin_ms_later": 1e3 * statistics.fmean(b for b, s in zip(begins, starts) if not s) if later else None,
           # the later steps opened from the run's rows (steady_run.py) and those planned (a run's first two, an
           # extension's first, a step of another bucket or with partial rows): what each kind costs, how many of each
           **_split_later(begins, parts, starts),
           "step_ms": 1e3 * statistics.fmean(walls), "step_ms_median": 1e3 * statistics.median(walls),
           # the end of the step (the device waited for, the commit sent): a cost moved out of opening shows here
           "end_ms_per_step": 1e3 * statistics.fmean(ends),
           # the caller's time inside one attend call (q|k|v in, the layer launched, its output): above the kernel's
           # time per layer, the host sets the pace
           "attend_ms_per_layer": 1e3 * statistics.fmean(attends) / layers,
           # the garbage collector's pauses inside the openings, per step (by generation)
           "gc_ms_per_open": {str(g): 1e3 * t / steps for g, t in pauses.seconds.items()},
           "phases_ms_per_step": _phase_means(parts), "phases_ms_run_start": _phase_means(firsts),
           "phases_ms_later": _phase_means(later), "cprofile_open": _top(profile, top)}
    if tracer is not None:
        row["torch_profile_open"] = _inside_openings(tracer, steps, top)
    return row


def service_rows(args, case_names: list[str]):
    import cpattn
    from cpattn.cluster.service import ensure_ray
    from cpattn.config import ServiceConfig

    gpu = cp.DEVICE == "cuda"
    ensure_ray(None, "cpattn", num_cpus_hint=1 if gpu else 0.25)
    cases = [cp.CASES[c] for c in case_names]
    # --smoke: one service per KV format and window, as cp_scaling --smoke (a start is most of its time)
    planned = cp.plan_services(1, cases, args.layers, args.warmup + 2 * args.steps + 4 * args.run_steps,
                               args.kv_budget_gb,
                               one_service=args.smoke)
    for p in planned:
        svc = cpattn.start(ServiceConfig(**{**p.config.model_dump(), "decode_run_steps": args.run_steps,
                                            "decode_run_extend": not args.no_extend}))
        try:
            for case in p.cases:
                row = measure_service(svc, case, p.layers, args.warmup, args.steps, args.top, args.torch_profile)
                row["local_shards"] = sorted(svc.gateway.local)
                row["backend"] = p.backends[case.name]
                print(_fmt_service(row), flush=True)
                yield row
        finally:
            svc.shutdown()


# The client's per-step work, without Ray ------------------------------------------------------------------------------
def client_row(case, run_steps: int, runs: int, top: int) -> dict:
    """A 1-shard coordinator (plan_cost's), the shard local to the client; the client's work per later step of
    ``runs`` runs, as Gateway.begin does it (page tables once a run; per step client_step and runner.plan)."""
    import plan_cost
    from cpattn.attention.selector import select_backend
    from cpattn.cluster.decode_run_plans import use_block_tables
    from cpattn.cluster.layer_runner import ShardLayerRunner
    from cpattn.cluster.page_delta import PageCache
    from cpattn.config import ServiceConfig

    pc_case = plan_cost.Case(case.name, case.batch, case.context, 1, shards=1)
    coordinator, client_id = plan_cost._coordinator(pc_case, run_steps, runs)
    seqs = plan_cost._filled(coordinator, client_id, pc_case)
    cfg = ServiceConfig(**{**coordinator.config.model_dump(), "num_q_heads": cp.HQ, "num_kv_heads": cp.HK,
                           "head_size": cp.D, "backend": cp.usable_backend(case.backend, case), "device": cp.DEVICE,
                           "dtype": str(cp.DTYPE).removeprefix("torch."), "kv_cache_dtype": case.kv,
                           "sliding_window": case.window})
    device = torch.device(cp.DEVICE)
    backend = select_backend(cfg, device)
    if device.type == "cpu" and case.backend == "TRITON" and _triton_importable():
        from cpattn.attention.backends.triton_attn import TritonAttentionBackend

        backend = TritonAttentionBackend   # its builder plans on the CPU as on a GPU (no kernel runs here)
    # plan() reads no page of the cache; CUDA graphs capture kernels over it, so a GPU gets every page
    blocks = coordinator.config.num_blocks_per_shard if device.type == "cuda" else 4
    fp8 = case.kv.startswith("fp8")
    cache = torch.zeros(2, blocks, cp.BLOCK, cp.HK, cp.D, device=device,
                        dtype=torch.float8_e4m3fn if fp8 and device.type == "cuda" else cp.DTYPE)
    scales = [torch.ones(2, blocks, cp.HK, device=device)] if fp8 else None
    runner = ShardLayerRunner(cfg, backend, [cache], device, scales)
    graphs = runner.new_graphs()
    pages, ledger = PageCache(), coordinator.ledger
    profile = cProfile.Profile()
    build, plan, run_start = [], [], []
    for i in range(runs):
        profiled = i == runs - 1 and runs > 1   # the last run under cProfile, the others timed without it
        admitted = ledger.admit(client_id, {s: 1 for s in seqs}, run_steps, 1)
        step, plans = ledger.open(admitted, (0,), coordinator.gen)
        held = pages.held(seqs, [0])
        reply = pickle.loads(pickle.dumps(ledger.reply(step, admitted.seqs, admitted.request, plans, held,
                                                       coordinator.gen.epoch)))
        t0 = time.perf_counter()
        tables = {0: pages.apply(0, reply.seq_ids, reply.local_pages[0])}
        use_block_tables([reply], tables)
        use_block_tables(reply.later, tables)
        runner.plan(reply.local_plans[0], graphs)   # the run's first step (a new table to the device)
        if not profiled:
            run_start.append(time.perf_counter() - t0)
        for j in range(len(reply.later)):
            if profiled:
                profile.enable()
            t0 = time.perf_counter()
            later = reply.later[j]
            t1 = time.perf_counter()
            runner.plan(later.local_plans[0], graphs)
            t2 = time.perf_counter()
            if profiled:
                profile.disable()
                continue
            build.append(t1 - t0)
            plan.append(t2 - t1)
        step.done = step.num_substeps
        for j in range(1, step.num_substeps):
            ledger.advance(step, j)
        ledger.close(step, committed=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    row = {"case": case.name, "batch": case.batch, "context": case.context, "kv_cache_dtype": case.kv,
           "window": case.window, "backend": backend.get_name(), "graphs": graphs is not None and graphs.key is not None,
           "run_steps": run_steps, "runs": runs, "client_step_ms": 1e3 * statistics.median(build),
           "runner_plan_ms": 1e3 * statistics.median(plan), "later_step_ms": 1e3 * statistics.median(
               [b + p for b, p in zip(build, plan)]), "run_start_ms": 1e3 * statistics.median(run_start),
           "cprofile_later": _top(profile, top)}
    print(_fmt_client(row), flush=True)
    return row


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


# Output ---------------------------------------------------------------------------------------------------------------
SERVICE_HEADER = (f"{'case':>20} {'layers':>6} {'starts':>6} {'begin/step':>10} {'run start':>9} {'later':>7} "
                  f"{'end':>7} {'step':>8}   later steps by phase (ms)")
CLIENT_HEADER = f"{'case':>20} {'backend':>8} {'graphs':>6} {'client_step':>11} {'runner.plan':>11} {'later':>7} {'run start':>9}"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _fmt_service(r: dict) -> str:
    def phases(key: str) -> str:
        return " ".join(f"{k} {v:.3f}" for k, v in r[key].items() if v >= 0.0005)

    return (f"{r['case']:>20} {r['layers']:>6} {r['run_starts']:>6} {r['begin_ms_per_step']:>10.3f} "
            f"{_ms(r['begin_ms_run_start']):>9} {_ms(r['begin_ms_later']):>7} {r['end_ms_per_step']:>7.3f} "
            f"{r['step_ms']:>8.2f}   {phases('phases_ms_later')}\n{'':>72}run start: {phases('phases_ms_run_start')}"
            f"\n{'':>72}later steps: {r['steady_steps']} steady {_ms(r['begin_ms_steady'])} ms, "
            f"{r['planned_steps']} planned {_ms(r['begin_ms_planned'])} ms ({phases('phases_ms_planned')}); "
            f"slowest opening {_ms(r['begin_ms_max'])} ms ({phases('phases_ms_slowest')}); attend {r['attend_ms_per_layer']:.3f} ms/layer on the host"
            f"\n{'':>72}gc in opening, ms/step by generation: "
            + " ".join(f"{g}: {t:.3f}" for g, t in r["gc_ms_per_open"].items()))


def _fmt_client(r: dict) -> str:
    return (f"{r['case']:>20} {r['backend']:>8} {str(r['graphs']):>6} {r['client_step_ms']:>11.3f} "
            f"{r['runner_plan_ms']:>11.3f} {r['later_step_ms']:>7.3f} {r['run_start_ms']:>9.3f}")


def _print_tops(title: str, rows: list[dict], key: str, n: int) -> None:
    for r in rows:
        print(f"\n{title} {r['case']}: cProfile top {n} by cumulative ms (over every measured step)")
        for t in r[key][:n]:
            print(f"  {t['cumtime_ms']:9.2f} {t['tottime_ms']:9.2f} {t['calls']:7d}  {t['function']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"any decode case of {', '.join(cp.CASES)}")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4,
                        help="steps before measuring at least (then until a run of --run-steps steps has ended)")
    parser.add_argument("--steps", type=int, help="measured steps (default: two runs of --run-steps)")
    parser.add_argument("--run-steps", type=int, default=cp.RUN_STEPS,
                        help=f"decode_run_steps (the service's default: {cp.RUN_STEPS})")
    parser.add_argument("--client-runs", type=int, default=4,
                        help="decode runs of the client part (the last one under cProfile, the others timed)")
    parser.add_argument("--kv-budget-gb", type=float, default=96.0)
    parser.add_argument("--no-extend", action="store_true",
                        help="decode_run_extend=False: each run ends after its steps, the next begins afresh")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--torch-profile", action="store_true", help="torch.profiler's top ops too (CPU time)")
    parser.add_argument("--only", choices=("service", "client"), help="one part only")
    parser.add_argument("--json", default="benchmarks/results/profile_begin.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TORCH, gloo): every path runs")
    parser.add_argument("--cpu", action="store_true",
                        help="the cases' shapes on the CPU in float32 (the client part: TRITON's builder under "
                             "TRITON_INTERPRET=1 in a venv with triton, else TORCH)")
    args = parser.parse_args(argv)
    if args.cpu:
        cp.DEVICE, cp.DTYPE = "cpu", torch.float32
    if args.smoke:
        cp.use_smoke_shapes()
        cp.CASES.update(cp.SMOKE_CASES)
        args.cases, args.layers, args.warmup, args.steps, args.client_runs = ",".join(SMOKE_CASES), 2, 4, 8, 2
        args.run_steps = 4   # steady runs after two steps: the measured 8 steps are two whole runs
        args.top, args.torch_profile = min(args.top, 5), True   # every path
    args.steps = args.steps or 2 * args.run_steps
    names = args.cases.split(",")
    gpu = cp.DEVICE == "cuda"
    meta = {"date": date.today().isoformat(), "machine": platform.node(),
            "gpu": torch.cuda.get_device_name() if gpu else "none (cpu)", "torch": torch.__version__,
            "heads": [cp.HQ, cp.HK, cp.D], "block_size": cp.BLOCK, "warmup": args.warmup, "steps": args.steps}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "client": [], "service": []}
    if args.only != "service":
        print("client: ms per later step of a decode run without Ray (medians, without cProfile), run start = tables + "
              "first plan")
        print(CLIENT_HEADER)
        for name in names:
            result["client"].append(client_row(cp.CASES[name], args.run_steps, args.client_runs, args.top))
            out.write_text(json.dumps(result, indent=1))
            if gpu:
                torch.cuda.empty_cache()   # its one-layer cache (up to 17 GB at 64 x 32K): the services' KV comes next
    if args.only != "client":
        print(f"\nservice: begin ms per step over {args.steps} steps once decode runs are {args.run_steps} steps long "
              "(1 shard, in the client's process where the GPU allows); run start / later: the steps that asked the "
              "coordinator / did not")
        print(SERVICE_HEADER)
        for row in service_rows(args, names):
            result["service"].append(row)
            out.write_text(json.dumps(result, indent=1))
    _print_tops("client", result["client"], "cprofile_later", args.top)
    _print_tops("service step.open", result["service"], "cprofile_open", args.top)
    for r in result["service"]:
        if "torch_profile_open" in r:
            print(f"\nservice step.open {r['case']}: torch.profiler, self CPU ms per step inside the openings")
            for t in r["torch_profile_open"]:
                print(f"  {t['self_cpu_ms_per_step']:9.4f} {t['calls_per_step']:7.1f}/step  {t['name']}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
