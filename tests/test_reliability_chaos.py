"""Chaos: a bounded workload (prefill chunks, then mixed decodes) while a background thread kills random
shards at random moments; kv_replicas=2. Every sequence completes with outputs within 1e-5 of float64
(float32 service), and the test reports how many kills it survived.
"""

from __future__ import annotations

import random
import threading
import time

import ray

import cpattn
from conftest import service_config
from reliability_common import RPC_S
from service_oracle import Oracle, checked_step

MAX_KILLS = 3
DEADLINE_S = 75.0
TOL = 1e-5


class Killer(threading.Thread):
    """Kills a random shard after a random delay, waits for its replacement, repeats up to MAX_KILLS times.

    One kill at a time: two replicas survive one lost shard, not two at once.
    """

    def __init__(self, coordinator, seed: int):
        super().__init__(daemon=True, name="chaos-killer")
        self.coordinator = coordinator
        self.rng = random.Random(seed)
        self.kills: list[tuple[int, float]] = []   # (rank, seconds until replaced)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while len(self.kills) < MAX_KILLS and not self.stop.wait(self.rng.uniform(0.1, 1.5)):
                shards = ray.get(self.coordinator.get_shards.remote(), timeout=RPC_S)["shards"]
                rank = self.rng.randrange(len(shards))
                before = ray.get(self.coordinator.stats.remote(), timeout=RPC_S)["shards_replaced"]
                t0 = time.monotonic()
                ray.kill(shards[rank], no_restart=True)
                while ray.get(self.coordinator.stats.remote(), timeout=RPC_S)["shards_replaced"] <= before:
                    if time.monotonic() - t0 > 60:
                        raise AssertionError(f"shard {rank} was not replaced within 60s")
                    time.sleep(0.05)
                self.kills.append((rank, time.monotonic() - t0))
        except BaseException as exc:   # reported by the test
            self.error = exc


def test_random_shard_kills_during_a_workload(ray_session):
    svc = cpattn.start(service_config(num_shards=3, kv_replicas=2, dtype="float32", block_size=4, dcp_interleave=2,
                                      num_blocks_per_shard=128, pcp_min_tokens=12, rpc_timeout_s=RPC_S,
                                      collective_timeout_s=5.0, health_check_interval_s=0.5, start_timeout_s=120.0))
    killer = Killer(svc.gateway.coordinator, seed=1234)
    try:
        oracle = Oracle(svc.config, 77)
        rng = random.Random(5)
        prompts = {svc.add_sequence(): n for n in (37, 20, 9, 50)}
        t0 = time.monotonic()
        killer.start()
        num_steps, recoveries, worst = 0, 0, 0.0
        # Prefill in chunks of at most 16 tokens, several sequences per step.
        remaining = dict(prompts)
        while remaining:
            request = {s: min(16, n) for s, n in list(remaining.items())[:rng.randint(1, len(remaining))]}
            step, err = checked_step(svc, oracle, request, tol=TOL)
            num_steps, recoveries, worst = num_steps + 1, recoveries + step.recoveries, max(worst, err)
            for s, n in request.items():
                remaining[s] -= n
                if not remaining[s]:
                    del remaining[s]
        # Mixed decodes (and a few short chunks) until the killer is done, bounded in steps and time.
        seqs = list(prompts)
        while (killer.is_alive() or num_steps < 40) and num_steps < 400 and time.monotonic() - t0 < DEADLINE_S:
            request = {s: rng.choice((1, 1, 1, 2, 5)) for s in rng.sample(seqs, rng.randint(1, len(seqs)))}
            step, err = checked_step(svc, oracle, request, tol=TOL)
            num_steps, recoveries, worst = num_steps + 1, recoveries + step.recoveries, max(worst, err)
        killer.stop.set()
        killer.join(timeout=90)
        assert killer.error is None, f"killer failed: {killer.error!r}"
        stats = svc.stats()
        print(f"\nchaos: survived {len(killer.kills)} shard kills {killer.kills}; {num_steps} steps, "
              f"{recoveries} step replays, max error {worst:.2e}, shards_replaced {stats['shards_replaced']}, "
              f"{time.monotonic() - t0:.1f}s")
        assert len(killer.kills) >= 1
        assert stats["shards_replaced"] == len(killer.kills)
        # Every sequence completed: its whole history is there and the next decode is still exact.
        assert svc.sequences() == {s: oracle.length(s) for s in seqs}
        assert all(oracle.length(s) > prompts[s] for s in seqs)
        checked_step(svc, oracle, {s: 1 for s in seqs}, tol=TOL)
    finally:
        killer.stop.set()
        svc.shutdown()
