"""Issue 20: four clients on one service, once all honest and once with the fourth hostile.

The hostile client, while the other three decode: joins under its own fresh tickets whose handshake never
finishes (every shard, many at once), replays a spent ticket, shows forged and other groups' tickets, calls
operator-only methods, and sends begin_step with extreme values. The three honest clients' outputs are checked
against the float64 oracle of tests/service_oracle.py (no cpattn code) and their step latencies compared.

    python benchmarks/hostile_load.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cpattn  # noqa: E402
from service_oracle import Oracle, run_step, unique_name  # noqa: E402

HONEST = 3


def honest(svc, seed: int, steps: int, latencies: list, errors: list, start: threading.Barrier) -> None:
    oracle = Oracle(svc.config, seed)
    seq = svc.add_sequence()
    run_step(svc, oracle, {seq: 16})   # prefill
    start.wait()
    for _ in range(steps):
        t0 = time.perf_counter()
        errors.append(run_step(svc, oracle, {seq: 1}))
        latencies.append(time.perf_counter() - t0)


def hostile(svc, stop: threading.Event, counts: dict) -> None:
    from cpattn.cluster.netstore import make_bound_store

    coordinator = svc.gateway.coordinator
    shards = ray.get(coordinator.get_shards.remote(svc.credential), timeout=60).shards
    host = ray.util.get_node_ip_address()
    seq = svc.add_sequence()
    stores, n = [], 0
    while not stop.is_set():
        refs = []
        for shard in shards:
            for _ in range(20):   # joins that never finish, under the client's own fresh tickets
                name = f"{svc.client_id}-hostile{n}"
                n += 1
                ticket = ray.get(coordinator.group_ticket.remote(svc.credential, name), timeout=60)
                store = make_bound_store(host, 2, 5.0)
                stores.append(store)
                refs.append(shard.join_group.remote(name, host, store.port, 1, 2, "gloo", ticket))
            refs.append(shard.join_group.remote(svc.gateway.group_name, host, 1, 1, 2, "gloo", svc.gateway._ticket))
            refs.append(shard.join_group.remote(f"{svc.client_id}-x", host, 1, 1, 2, "gloo", "forged|1|00"))
            refs.append(shard.simulate_hang.remote(svc.credential, True))
            refs.append(shard.kv_checksum.remote(svc.credential))
        refs.append(coordinator.shutdown.remote(svc.credential))
        refs.append(coordinator.stats.remote(svc.credential, True))
        for request in ({seq: 2**63}, {seq: -1}, {seq: 10**9}, {seq: float("inf")}, {"seq-nope": 1}, {seq: 0}):
            refs.append(coordinator.begin_step.remote(svc.credential, svc.gateway.group_name, request, None, ()))
        for ref in refs:
            try:
                ray.get(ref, timeout=120)
                counts["accepted"] = counts.get("accepted", 0) + 1
            except ray.exceptions.RayTaskError as exc:
                kind = type(exc.cause).__name__
                counts[kind] = counts.get(kind, 0) + 1
        del stores[:-200]


def phase(cfg, steps: int, with_hostile: bool) -> dict:
    svc = cpattn.start(cfg)
    try:
        clients = [cpattn.connect(name=cfg.name, namespace=cfg.namespace) for _ in range(HONEST + 1)]
        latencies, errors, counts = [], [], {}
        start, stop = threading.Barrier(HONEST + (1 if not with_hostile else 0)), threading.Event()
        threads = [threading.Thread(target=honest, args=(c, 10 + i, steps, latencies, errors, start))
                   for i, c in enumerate(clients[:HONEST])]
        if with_hostile:
            extra = threading.Thread(target=hostile, args=(clients[HONEST], stop, counts), daemon=True)
        else:
            extra = threading.Thread(target=honest, args=(clients[HONEST], 99, steps, [], [], start))
        for t in threads + [extra]:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        extra.join(timeout=180)
        latencies.sort()
        for c in clients:
            c.close()
        return {"hostile": with_hostile, "steps": len(latencies), "max_error": max(errors),
                "p50_ms": 1e3 * latencies[len(latencies) // 2], "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
                "hostile_calls": counts, "shards_replaced": svc.stats()["shards_replaced"]}
    finally:
        svc.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="decode steps per honest client")
    args = parser.parse_args(argv)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    cfg = cpattn.ServiceConfig(num_shards=2, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                               dtype="float64", num_blocks_per_shard=256, num_cpus_per_shard=0.25,
                               collective_timeout_s=30.0, join_timeout_s=2.0, name=unique_name("hostile-load"))
    results = [phase(cfg, args.steps, False), phase(cfg, args.steps, True)]
    for r in results:
        print(json.dumps(r))
    ratio = results[1]["p99_ms"] / results[0]["p99_ms"]
    print(f"p99 with a hostile client / without: {ratio:.2f}x; max error {max(r['max_error'] for r in results):.2e}")
    out = Path(__file__).parent / "results" / "hostile_load.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"runs": results, "p99_ratio": ratio}, indent=2))
    ray.shutdown()
    return 0 if ratio <= 1.5 and all(r["max_error"] <= 1e-10 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
