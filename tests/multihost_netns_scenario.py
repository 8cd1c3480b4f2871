"""The driver of tests/test_multihost_netns.py, run inside host a's network namespace (the Ray head's).

Argument: a JSON object (the cluster's names and addresses, which phases to run). Prints one line per phase,
``PHASE {...}``, and ``RESULT {...}`` at the end; exits non-zero on failure.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import torch

from multinode_check import dense_reference

LAYERS, HQ, HK, D = 2, 4, 2, 8


class History:
    """Every committed token's K/V per (sequence, layer), float64; a step's tokens join only once it committed."""

    def __init__(self, sids: list[str]):
        empty = torch.zeros(0, HK, D, dtype=torch.float64)
        self.kv = {(sid, layer): (empty, empty) for sid in sids for layer in range(LAYERS)}

    def step(self, svc, request: dict[str, int], gen: torch.Generator, on_layer=None) -> float:
        """One step of random q/k/v checked against the float64 reference; returns the max relative error."""
        num = sum(request.values())
        worst, pending = 0.0, {}
        with svc.step(request) as step:
            for layer in range(LAYERS):
                if on_layer is not None:
                    on_layer(layer)
                q, k, v = (torch.randn(num, h, D, dtype=torch.float64, generator=gen).float() for h in (HQ, HK, HK))
                out = step.attend(layer, q, k, v).double()
                start = 0
                for sid, n in request.items():
                    k_old, v_old = self.kv[(sid, layer)]
                    k_all, v_all = torch.cat([k_old, k[start:start + n].double()]), torch.cat([v_old, v[start:start + n].double()])
                    ref = dense_reference(q[start:start + n].double(), k_all, v_all, k_old.shape[0])
                    err = ((out[start:start + n] - ref).abs().max() / ref.abs().max()).item()
                    worst = max(worst, err)
                    pending[(sid, layer)] = (k_all, v_all)
                    start += n
        self.kv.update(pending)
        return worst


def steps_until_served(svc, hist: History, sids, gen, deadline_s: float) -> dict:
    """Steps until one commits (each failure must be a cpattn error, never ShardLostError); how long it took."""
    from cpattn.errors import CpattnError, ShardLostError

    t0, errors = time.monotonic(), []
    while True:
        try:
            err = hist.step(svc, {sids[0]: 2, sids[1]: 1}, gen)
            return {"served_after_s": time.monotonic() - t0, "rel_err": err, "errors": errors}
        except ShardLostError:
            raise
        except CpattnError as exc:
            errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            if time.monotonic() - t0 > deadline_s:
                raise
            time.sleep(0.5)


def timed_failure(svc, hist: History, sids, gen, cut) -> dict:
    """A step whose link is cut (``cut()``) after layer 0: how long until it raised, and what."""
    marks = {}

    def on_layer(layer: int) -> None:
        if layer == 1:
            cut()
            marks["cut"] = time.monotonic()

    try:
        hist.step(svc, {sids[0]: 2, sids[1]: 1}, gen, on_layer)
        return {"raised": None, "after_s": time.monotonic() - marks["cut"]}
    except Exception as exc:   # the test asserts it is a cpattn error
        return {"raised": type(exc).__name__, "cpattn": isinstance(exc, __import__("cpattn").CpattnError),
                "message": str(exc)[:400], "after_s": time.monotonic() - marks["cut"]}


def main() -> int:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING)
    import ray

    import cpattn
    from netns_cluster import NetnsCluster

    cluster = NetnsCluster.from_spec(spec["cluster"])
    cfg = cpattn.ServiceConfig(
        ray_address=cluster.address, num_shards=2, num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
        block_size=4, dtype="float32", num_blocks_per_shard=64, num_cpus_per_shard=1, pcp_min_tokens=8,
        placement_strategy="STRICT_SPREAD", kv_replicas=2, name="cpattn-netns",
        shard_label_selector={"cpattn/shards": "yes"}, coordinator_resources={"cpattn_coordinator": 1},
        collective_timeout_s=spec["collective_timeout_s"], shard_hang_timeout_s=spec["shard_hang_timeout_s"],
        rpc_timeout_s=30.0, start_timeout_s=90.0, health_check_interval_s=0.5, client_lease_s=120.0)
    result: dict = {}
    _wait_for_file(spec.get("start_when"), 120)
    t0 = time.monotonic()
    svc = cpattn.start(cfg)
    result["start_s"] = time.monotonic() - t0
    gen = torch.Generator().manual_seed(0)
    sids = [svc.add_sequence(), svc.add_sequence()]
    hist = History(sids)

    def phase(name: str, value) -> None:
        result[name] = value
        print("PHASE " + json.dumps({name: value}), flush=True)

    try:
        info = svc.info()
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        phase("placement", {"shard_ips": [s["node_ip"] for s in info["shards"]],
                            "coordinator_ip": nodes.get(info["coordinator_node_id"])})
        errs = [hist.step(svc, {sids[0]: 23, sids[1]: 6}, gen), hist.step(svc, {sids[0]: 1, sids[1]: 1}, gen)]
        phase("exact", {"rel_err": max(errs)})

        if "short_s" in spec:   # shorter than shard_hang_timeout_s: nothing lost, nothing replaced
            cut = timed_failure(svc, hist, sids, gen, lambda: _partition(cluster, spec["short_s"]))
            time.sleep(spec["short_s"])
            served = steps_until_served(svc, hist, sids, gen, 30)
            phase("short", {"step": cut, **served, "replaced": svc.stats()["shards_replaced"]})

        if "long_s" in spec:    # longer: the open step ends with a cpattn error in bound, then serves again
            before = svc.stats()["shards_replaced"]
            cut = timed_failure(svc, hist, sids, gen, lambda: _partition(cluster, spec["long_s"]))
            time.sleep(max(0.0, spec["long_s"] - cut["after_s"]))
            served = steps_until_served(svc, hist, sids, gen, 90)
            phase("long", {"step": cut, **served, "replaced": svc.stats()["shards_replaced"] - before})

        if spec.get("kill_node"):   # host b's processes killed; the node comes back (as KubeRay restarts a pod)
            before = svc.stats()["shards_replaced"]
            cut = timed_failure(svc, hist, sids, gen, lambda: cluster.kill_host(1))
            cluster.start_worker()
            served = steps_until_served(svc, hist, sids, gen, 90)
            phase("kill_node", {"step": cut, **served, "replaced": svc.stats()["shards_replaced"] - before})

        final = [hist.step(svc, {sids[0]: 1, sids[1]: 1}, gen) for _ in range(2)]
        phase("final", {"rel_err": max(final), "replaced": svc.stats()["shards_replaced"]})
    finally:
        svc.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _wait_for_file(path: str | None, timeout_s: float) -> None:
    """Until the test says host b's node is up (it touches ``path``): this process imported while it joined."""
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while path is not None and not Path(path).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"host b's node was not up within {timeout_s}s ({path} never appeared)")
        time.sleep(0.1)


def _partition(cluster, seconds: float) -> None:
    """Cut the link now; restore it ``seconds`` later (in the background)."""
    cluster.link(False)
    timer = threading.Timer(seconds, cluster.link, args=(True,))
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    sys.exit(main())
