"""Pages given back outside every window, under random workloads through the running service (local Ray, CPU,
TORCH, float64): a fresh geometry per run (shards, interleave, page size, GQA, one window per layer, a small
pool) and a random mix of chunks, decodes, frees, forks (at the length and earlier) and steps too big for the
cache. Every output is the float64 oracle's (service_oracle.py, no cpattn code); a refused fork or step changes no
length and no page count; each shard holds no more pages than the live sequences' windows need, counted from
positions (tests/service_oracle.local_tokens), plus a decode run's pages ahead."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cpattn.errors import CapacityError, InvalidRequestError
from service_oracle import Oracle, local_tokens, run_step


def _owned_bound(length: int, window: int, shards: int, rank: int, interleave: int, block_size: int) -> int:
    """Pages of a row holding a position at or after length - window (those before it are released)."""
    held_from = local_tokens(max(0, length - window), shards, rank, interleave) // block_size
    return math.ceil(local_tokens(length, shards, rank, interleave) / block_size) - held_from


def _state(svc) -> tuple:
    return svc.sequences(), [s["blocks_used"] for s in svc.stats()["shards"]]


@pytest.mark.parametrize("run", range(2))
def test_random_workloads_stay_exact_and_hold_only_their_windows(start_service, run):
    seed = torch.randint(0, 10**9, ()).item()
    rng = random.Random(seed)
    shards, block = rng.choice([1, 2, 3, 5]), rng.choice([2, 4, 8])
    interleave = rng.choice([i for i in (1, 2, 4) if block % i == 0])   # pages hold whole interleave runs
    q_heads, kv_heads = rng.choice([(4, 2), (2, 1), (4, 4), (6, 2)])
    windows = [rng.randint(1, 24) for _ in range(2)]
    replicas = rng.choice([1, 2]) if shards > 1 else 1
    ahead = 8   # decode_run_steps below: a run allocates up to this many tokens of pages ahead
    # Room for ~3 sequences' windows, their chunks and a run ahead, far less than the tokens written.
    per_seq = (math.ceil((max(windows) + 16 + ahead) / (shards * block)) + 2 + interleave) * replicas
    svc = start_service(num_shards=shards, dcp_interleave=interleave, block_size=block, num_q_heads=q_heads,
                        num_kv_heads=kv_heads, sliding_window=windows, num_blocks_per_shard=3 * per_seq,
                        decode_run_steps=ahead, pcp_min_tokens=rng.choice([4, 6, 1000]), kv_replicas=replicas)
    where = f"seed {seed}: {shards} shards x{replicas}, I={interleave}, pages of {block}, windows {windows}"
    oracle = Oracle(svc.config, seed)
    live = [svc.add_sequence()]
    written = refused = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.1 and len(live) > 1:
            sid = live.pop(rng.randrange(len(live)))
            svc.free(sid)
            oracle.drop(sid)
            continue
        if op < 0.2 and len(live) < 4:
            live.append(svc.add_sequence())
            continue
        if op < 0.3 and any(oracle.length(s) > 0 for s in live):
            source = rng.choice([s for s in live if oracle.length(s) > 0])
            length = oracle.length(source)
            at = length if rng.random() < 0.5 else rng.randint(0, length)
            before = _state(svc)
            try:
                fork = svc.fork(source, num_tokens=at)
            except (InvalidRequestError, CapacityError):
                assert _state(svc) == before, where   # a refused fork changes nothing
                refused += 1
                continue
            oracle.fork(source, fork, at)
            live.append(fork)
            continue
        decode = rng.random() < 0.6
        request = {s: 1 if decode else rng.randint(1, 16) for s in rng.sample(live, rng.randint(1, len(live)))}
        if rng.random() < 0.05:
            request[rng.choice(list(request))] = 4 * shards * 3 * per_seq * block   # more than the whole cache
        before = _state(svc)
        try:
            assert run_step(svc, oracle, request) <= 1e-10, where
        except CapacityError:
            assert _state(svc) == before, where          # a refused step changes nothing
            refused += 1
            continue
        written += sum(request.values())
        lengths = svc.sequences()
        def row_bound(n: int, rank: int) -> int:
            return _owned_bound(n, max(windows), shards, rank, interleave, block) + math.ceil(ahead / block) + 1

        for rank, used in enumerate(_state(svc)[1]):   # a replica row copies another rank's: the largest counts
            bound = sum(row_bound(n, rank) + (replicas - 1) * max(row_bound(n, r) for r in range(shards))
                        for n in lengths.values())
            assert used <= bound, f"{where}: shard {rank} holds {used} pages > {bound} for {lengths}"
    assert svc.sequences() == {s: oracle.length(s) for s in live}, where
    print(f"{where}: {written} tokens written, {refused} refused, cache {3 * per_seq * shards * block} tokens")
