"""Helpers for the reliability tests: shard handles, KV fingerprints, waiting for recoveries, checked steps.

The expected outputs always come from ``service_oracle`` (float64, no cpattn code).
"""

from __future__ import annotations

import time

import ray


RPC_S = 60.0   # generous: other agents load the 2-core machine while these tests run


def current_shards(svc) -> list:
    """The coordinator's shard handles now (svc.gateway.shards goes stale until the client rejoins)."""
    return ray.get(svc.gateway.coordinator.get_shards.remote(svc.credential), timeout=RPC_S).shards


def kv_checksums(svc) -> list[float]:
    """Every shard's KV fingerprint: the operator's view (``svc`` started the service)."""
    return ray.get([h.kv_checksum.remote(svc.operator_credential) for h in current_shards(svc)], timeout=RPC_S)


def simulate_hang(svc, rank: int, hang: bool = True) -> None:
    """The test hook (services of the test suite start with test_hooks=True), as the operator."""
    ray.get(current_shards(svc)[rank].simulate_hang.remote(svc.operator_credential, hang), timeout=RPC_S)


def snapshot(svc, clients=(), with_kv: bool = True) -> dict:
    """Everything a rejected request must leave untouched: KV bytes, lengths, pages, per-client usage."""
    stats = svc.stats()
    snap = {"sequences": [c.sequences() for c in (svc, *clients)],
            "shards": [(s["blocks_used"], s["blocks_free"], s["tokens"], s["bytes"]) for s in stats["shards"]],
            "clients": stats["clients"], "other_clients": stats["other_clients"],
            "num_sequences": stats["num_sequences"], "epoch": stats["epoch"],
            "shards_replaced": stats["shards_replaced"]}
    if with_kv:
        snap["kv"] = kv_checksums(svc)
    return snap


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(interval_s)


def kill_shard(svc, rank: int, wait_dead: bool = True):
    """ray.kill the shard of ``rank``; with wait_dead, return only once Ray calls it dead. Returns its handle.

    Dead is ActorDiedError, not any RayActorError: ActorUnavailableError (one too) can come while the process still
    runs and serves, and a test that went on then saw a shard "killed" after layer 0 serve layer 1 and the step
    commit (CI, 2026-12-07, test_data_plane's single-replica case)."""
    handle = current_shards(svc)[rank]
    ray.kill(handle, no_restart=True)
    if wait_dead:
        def dead() -> bool:
            try:
                ray.get(handle.ping.remote(svc.operator_credential), timeout=RPC_S)
                return False
            except ray.exceptions.ActorDiedError:
                return True
            except ray.exceptions.RayActorError:   # unavailable for now: not yet known dead
                return False
        wait_for(dead, 60, f"shard {rank} to die")
    return handle


def wait_rank_replaced(svc, rank: int, killed, timeout_s: float = 90.0) -> None:
    """Wait until the coordinator's shard of ``rank`` is no longer ``killed`` (a count of replacements can be
    reached by another shard's replacement on a loaded machine, a health check that timed out)."""
    wait_for(lambda: current_shards(svc)[rank]._actor_id != killed._actor_id, timeout_s,
             f"shard {rank} replaced", 0.05)


def wait_replaced(svc, count: int, timeout_s: float = 90.0) -> float:
    """Wait until stats shards_replaced reaches ``count``; returns the seconds it took."""
    t0 = time.monotonic()
    wait_for(lambda: svc.stats()["shards_replaced"] >= count, timeout_s, f"shards_replaced >= {count}", 0.05)
    return time.monotonic() - t0


def kill_coordinator_and_wait_restored(svc, timeout_s: float = 60.0) -> float:
    """ray.kill the detached coordinator (Ray restarts it); returns seconds until the restored one answers."""
    import cpattn

    t0 = time.monotonic()
    ray.kill(svc.gateway.coordinator, no_restart=False)
    while True:   # ray.kill is asynchronous: wait for the restarted instance, not the old one
        try:
            if svc.info()["restored"]:
                return time.monotonic() - t0
        except cpattn.CpattnError:
            pass
        assert time.monotonic() - t0 < timeout_s, f"coordinator did not come back within {timeout_s} s"
        time.sleep(0.1)
