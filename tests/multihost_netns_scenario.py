"""The driver of tests/test_multihost_netns.py, run inside host a's network namespace (the Ray head's).

Argument: a JSON object (the cluster's names and addresses, which phases to run). Prints one line per phase,
``PHASE {...}``, and ``RESULT {...}`` at the end; exits non-zero on failure.
"""

from __future__ import annotations

import json
import logging
import subprocess
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


def ip_link(ns: str, veth: str, state: str) -> None:
    subprocess.run(["ip", "-n", ns, "link", "set", veth, state], check=True)


def main() -> int:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING)
    import ray

    import cpattn
    from cpattn.errors import CpattnError, ShardLostError

    cfg = cpattn.ServiceConfig(
        ray_address=spec["address"], num_shards=2, num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HK, head_size=D,
        block_size=4, dtype="float32", num_blocks_per_shard=64, num_cpus_per_shard=1, pcp_min_tokens=8,
        placement_strategy="STRICT_SPREAD", kv_replicas=2, name="cpattn-netns",
        shard_label_selector={"cpattn/shards": "yes"}, coordinator_resources={"cpattn_coordinator": 1},
        collective_timeout_s=spec["collective_timeout_s"], shard_hang_timeout_s=spec["shard_hang_timeout_s"],
        rpc_timeout_s=30.0, start_timeout_s=60.0, health_check_interval_s=0.5, client_lease_s=60.0)
    result: dict = {}
    t0 = time.monotonic()
    svc = cpattn.start(cfg)
    result["start_s"] = time.monotonic() - t0
    try:
        info = svc.info()
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        result["shard_ips"] = [s["node_ip"] for s in info["shards"]]
        result["coordinator_ip"] = nodes.get(info["coordinator_node_id"])
        gen = torch.Generator().manual_seed(0)
        sids = [svc.add_sequence(), svc.add_sequence()]
        hist = History(sids)
        errs = [hist.step(svc, {sids[0]: 23, sids[1]: 6}, gen), hist.step(svc, {sids[0]: 1, sids[1]: 1}, gen)]
        result["exact_rel_err"] = max(errs)
        print("PHASE " + json.dumps({"exact": result}), flush=True)
    finally:
        svc.shutdown() if hasattr(svc, "shutdown") else None
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
