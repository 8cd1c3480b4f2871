"""A node holding a shard leaves a local multi-node Ray cluster; with kv_replicas=2 the service refills a
replacement on a spare node and every sequence continues exactly.

Run by tests/multinode_check.py on the cluster it shares with the SPREAD check; node_loss() returns the nodes
before/after, the replaced count and the max error vs float64.
"""

from __future__ import annotations

import time

import torch

from multinode_check import checked_step, new_history


def start_cluster():
    """A 0-CPU head (the driver and the coordinator) and four one-CPU nodes; returns (cluster, workers)."""
    from ray.cluster_utils import Cluster

    # Ray declares a node dead after health_check_failure_threshold failed checks health_check_period_ms apart (5 x 3 s
    # by default); 3 x 1 s here, so the test waits ~3 s instead of ~15 s for what it tests: the service's response.
    # A live raylet still has health_check_timeout_ms (10 s) to answer each check.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    try:
        # Four one-CPU nodes for three shards: the one left free is the spare that takes the lost shard's place
        # (started with the others, not after the first steps: one node start less to wait for).
        workers = [cluster.add_node(num_cpus=1) for _ in range(4)]
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, workers


def node_loss(cluster, workers) -> dict:
    """Three shards with kv_replicas=2 on three of the four nodes; one node removed; the shard moves to the spare."""
    import cpattn

    cfg = cpattn.ServiceConfig(
        num_shards=3, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4, dtype="float64",
        num_blocks_per_shard=64, num_cpus_per_shard=1, placement_strategy="SPREAD", kv_replicas=2,
        pcp_min_tokens=8, name="cpattn-node-loss", rpc_timeout_s=60.0,
        # The step in flight when the node goes ends by this timeout (the lost shard is silent): 8 s, as the
        # other kill tests' 5 s, with room for a loaded machine; a healthy step's collectives take milliseconds.
        collective_timeout_s=8.0,
        health_check_interval_s=0.5, start_timeout_s=120.0,
        # The commit's outcome at the step's end: a step the service ends with "run it again" (the lost node's
        # shard is silent, not yet replaced) then fails inside step() below, which runs it again.
        async_commit=False)
    svc = cpattn.start(cfg)
    try:
        info = svc.info()
        coordinator_node = info["coordinator_node_id"]
        shard_nodes = [s["node_id"] for s in info["shards"]]
        gen = torch.Generator().manual_seed(1)
        sids = [svc.add_sequence(), svc.add_sequence()]
        history = new_history(sids)
        max_err = 0.0

        retries = 0

        def step(request):
            """A checked step; one the service ends with "run the step again" (a shard silent but not yet
            past shard_hang_timeout_s: the README's partition semantics), or whose group could not be rebuilt
            yet, is run again, as a user would."""
            nonlocal max_err, retries
            for _ in range(20):
                saved = dict(history)
                try:
                    max_err = max(max_err, checked_step(svc, history, request, gen))
                    return
                except cpattn.errors.ServiceError as exc:
                    # DataPlaneError: the rejoin reached for the lost shard before its replacement was in.
                    if "run the step again" not in str(exc) and not isinstance(exc, cpattn.errors.DataPlaneError):
                        raise
                    history.clear()
                    history.update(saved)   # nothing of the failed step was committed
                    retries += 1
                    time.sleep(1.0)
            raise RuntimeError(f"step {request} kept failing")

        step({sids[0]: 21, sids[1]: 5})
        step({sids[0]: 1, sids[1]: 1})
        spare = next(w for w in workers if w.node_id not in shard_nodes)   # room for the replacement
        victim = next(w for w in workers if w.node_id in shard_nodes and w.node_id != coordinator_node)
        cluster.remove_node(victim, allow_graceful=False)
        # The lost node's worker processes can outlive its raylet for a while; keep stepping (each step
        # checked) until Ray has declared the node dead and the shard was replaced and refilled.
        t0 = time.monotonic()
        steps_during = 0
        while svc.stats()["shards_replaced"] < 1:
            if time.monotonic() - t0 > 120:
                raise RuntimeError("the shard on the removed node was not replaced within 120 s")
            step({sids[0]: 1, sids[1]: 1})
            steps_during += 1
            time.sleep(0.5)
        recovery_s = time.monotonic() - t0
        step({sids[0]: 2, sids[1]: 3})
        step({sids[0]: 1, sids[1]: 1})
        after = svc.info()
        stats = svc.stats()
    finally:
        svc.shutdown()
    return {"shard_nodes_before": shard_nodes, "shard_nodes_after": [s["node_id"] for s in after["shards"]],
            "removed": victim.node_id, "spare": spare.node_id, "shards_replaced": stats["shards_replaced"],
            "recovery_s": recovery_s, "steps_during_recovery": steps_during, "steps_run_again": retries,
            "max_err": max_err}
