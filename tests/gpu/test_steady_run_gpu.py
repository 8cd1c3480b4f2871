"""Steady decode steps through the service on one GPU (cluster/steady_run.py): a long decode loop, most of whose
steps open from their run's rows on the device, stays exact against the float64 oracle every step and layer, with
bf16 and dynamic fp8 caches, DCP interleave 1 and 16, kv_replicas 1 and 2, sliding windows, a mixed step in the
middle (the run ends; the next one is steady again), and contexts that cross a KV-split bucket; each run goes on
in extensions (decode_run_extend), whose block tables come as deltas to the in-process shards."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _steady(parts: dict) -> bool:
    """A step opened from its run's rows (steady_run.SteadyRun.open), not planned."""
    return "steady" in parts and "run_next" not in parts


@pytest.mark.parametrize("kv, interleave, replicas, window", [
    ("auto", 1, 1, None), ("auto", 16, 2, None), ("fp8_e4m3", 16, 1, None), ("fp8_e4m3", 1, 2, None),
    ("auto", 16, 1, [None, 300]), ("fp8_e4m3", 1, 1, [700, 64])])
def test_steady_decode_steps_match_float64(ray_session, kv, interleave, replicas, window):
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step

    cfg = service_config(num_shards=2, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype="bfloat16", backend="TRITON", dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.5, num_cpus_per_shard=0.5, num_blocks_per_shard=512, pcp_min_tokens=64,
                         kv_cache_dtype=kv, kv_replicas=replicas, decode_run_steps=16, sliding_window=window)
    svc = cpattn.start(cfg)
    try:
        assert sorted(svc.gateway.local) == [0, 1]   # both computed in the client's process
        oracle = Oracle(cfg, seed=11)
        bound = 1e-1 if kv.startswith("fp8") else 2e-2
        a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
        # a: 2030 keys, ~1015 a shard: the decodes cross 1024 keys on each (another split count: a planned step)
        decode = {a: 1, b: 1, c: 1}
        steps = [{a: 1000, b: 200}, {a: 1030, b: 17, c: 130}] + [decode] * 24 + [{a: 1, b: 30, c: 1}] + [decode] * 20
        starts, opened = 0, []
        for n, request in enumerate(steps):
            step = relative_step(svc, oracle, request, bound, f"{kv} I={interleave} r{replicas} W={window} step {n}")
            parts = step.timings["begin_parts"]
            opened.append(parts)
            starts += "begin_rpc" in parts
        served = [_steady(p) for p in opened]   # opened from the run's rows
        steady = sum(served)
        # An extension's first step is planned and makes the SteadyRun of its later steps from the previous segment's
        # template: steady before it and right after it (a run's second step makes its own: a run start before it)
        reused = sum(1 for j in range(1, len(opened) - 1)
                     if "steady_rows" in opened[j] and served[j - 1] and served[j + 1])
        assert reused >= 2, [sorted(p) for p in opened]
        # runs of 4, 8 and 12 of 16, then (after the mixed step) 4, 8 and 8 of 16: all but each run's first two
        # steps and each extension's first (38), less a step per split bucket crossed
        assert steady >= 28, steady
        # One begin_step per run: its segments (4, 8, 16 steps) are extensions, their tables deltas (run_extension.py)
        assert starts == 5, starts   # the two prefills, the first decode, the mixed step, the decode after it
    finally:
        svc.shutdown()


@pytest.mark.parametrize("interleave", [1, 16])
def test_forks_steady_steps_match_float64(ray_session, interleave):
    """Forks of one document decode in steady steps (their shared prefix read in the template's prefix pass, their
    suffix rows refilled each step): every layer of every step within bf16 tolerance of the float64 oracle."""
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step

    cfg = service_config(num_shards=2, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype="bfloat16", backend="TRITON", dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.5, num_cpus_per_shard=0.5, num_blocks_per_shard=512, pcp_min_tokens=64,
                         decode_run_steps=16)
    svc = cpattn.start(cfg)
    try:
        assert sorted(svc.gateway.local) == [0, 1]
        oracle = Oracle(cfg, seed=29)
        doc = svc.add_sequence()
        relative_step(svc, oracle, {doc: 1000}, 2e-2, f"I={interleave} document")
        forks = []
        for _ in range(4):
            forks.append(svc.fork(doc))
            oracle.fork(doc, forks[-1], 1000)
        steady = 0
        for n in range(30):
            step = relative_step(svc, oracle, {f: 1 for f in forks}, 2e-2, f"I={interleave} forks step {n}")
            steady += _steady(step.timings["begin_parts"])
        for local in svc.gateway.local_graphs.values():   # the graphs hold the prefix pass
            assert local is not None and local.key is not None and local.key[4] is not None, local and local.key
        assert steady >= 20, steady   # all but the run's first two steps and each extension's first
    finally:
        svc.shutdown()
