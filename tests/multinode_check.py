"""A cpattn service on a local multi-node Ray cluster (several raylets on this machine); run as a script.

tests/test_multinode.py runs it in a subprocess because ray.cluster_utils.Cluster needs a Ray of its
own, and the test session already holds one. Prints one JSON line (``RESULT {"spread": ..., "node_loss": ...}``)
with where the shards landed and the error against a float64 reference; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import logging
import sys

import torch


def dense_reference(q_THD, k_all_SKD, v_all_SKD, num_context: int) -> torch.Tensor:
    """Causal attention of T new queries at positions num_context.. over the S = num_context + T keys, float64."""
    t, hq, d = q_THD.shape
    group = hq // k_all_SKD.shape[1]
    k = k_all_SKD.double().repeat_interleave(group, dim=1)
    v = v_all_SKD.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q_THD.double(), k) * d ** -0.5
    pos_q = torch.arange(num_context, num_context + t)[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def new_history(sids: list[str], layers: int = 2, kv_heads: int = 2, head_size: int = 8) -> dict:
    """Every committed token's K/V per (sequence, layer), empty to start."""
    empty = torch.zeros(0, kv_heads, head_size, dtype=torch.float64)
    return {(sid, layer): (empty, empty) for sid in sids for layer in range(layers)}


def checked_step(svc, history: dict, request: dict[str, int], gen: torch.Generator) -> float:
    """One step of random float64 q/k/v (Hq 4, Hk 2, D 8, 2 layers) against dense_reference; returns max error."""
    num = sum(request.values())
    max_err = 0.0
    with svc.step(request) as step:
        for layer in range(2):
            q, k, v = (torch.randn(num, h, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
            out = step.attend(layer, q, k, v)
            start = 0
            for sid, n in request.items():
                k_old, v_old = history[(sid, layer)]
                k_all, v_all = torch.cat([k_old, k[start:start + n]]), torch.cat([v_old, v[start:start + n]])
                ref = dense_reference(q[start:start + n], k_all, v_all, k_old.shape[0])
                max_err = max(max_err, (out[start:start + n] - ref).abs().max().item())
                history[(sid, layer)] = (k_all, v_all)
                start += n
    return max_err


def spread(svc_name: str) -> dict:
    """SPREAD over every one-CPU node of the cluster (one shard per node), exact against float64."""
    import ray

    import cpattn

    cpu_nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
    cfg = cpattn.ServiceConfig(
        num_shards=len(cpu_nodes), num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
        dtype="float64", num_blocks_per_shard=64, num_cpus_per_shard=0.5, placement_strategy="SPREAD",
        pcp_min_tokens=8, name=svc_name, rpc_timeout_s=60.0, collective_timeout_s=60.0)
    svc = cpattn.start(cfg)
    try:
        shard_nodes = [s["node_id"] for s in svc.info()["shards"]]
        gen = torch.Generator().manual_seed(0)
        sids = [svc.add_sequence(), svc.add_sequence()]
        history = new_history(sids)
        max_err = 0.0
        # A long prefill (PCP split), a mixed step, then decodes: context spans many blocks on every node.
        for request in ({sids[0]: 21, sids[1]: 5}, {sids[0]: 3, sids[1]: 12}, {sids[0]: 1, sids[1]: 1}):
            max_err = max(max_err, checked_step(svc, history, request, gen))
        stats = svc.stats()
    finally:
        svc.shutdown()
    return {"cpu_nodes": cpu_nodes, "shard_nodes": shard_nodes, "max_err": max_err,
            "blocks_used": [s["blocks_used"] for s in stats["shards"]]}


def main() -> int:
    """One local cluster for both scenarios (a cluster start is most of each one's time): SPREAD over every
    node, then the node-loss scenario (tests/multinode_node_loss.py) once that service is shut down."""
    import ray

    from multinode_node_loss import node_loss, start_cluster

    cluster, workers = start_cluster()
    try:
        ray.init(address=cluster.address, namespace="cpattn", logging_level=logging.WARNING, log_to_driver=False)
        result = {"spread": spread("cpattn-multinode"), "node_loss": node_loss(cluster, workers)}
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
