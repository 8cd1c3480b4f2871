"""Sliding window, soft cap, sinks and an fp8 KV cache through the running service (local Ray, CPU),
against the independent float64 oracle of service_oracle.py (no cpattn code)."""

from __future__ import annotations

import pytest
import torch

from cpattn.errors import IncompleteStepError, InvalidRequestError
from reliability_common import RPC_S, kill_shard, kv_checksums, wait_rank_replaced
from service_oracle import Oracle, run_step


def test_window_softcap_sinks_through_the_service(start_service):
    """3 shards, GQA, per-layer settings: layer 0 full attention with sinks, layer 1 a window of 5 (smaller than
    a shard's share, crossing pages of 4 and shards) with a soft cap; PCP splits the 20-token prefill."""
    svc = start_service(num_shards=3, num_q_heads=4, num_kv_heads=2, block_size=4, dcp_interleave=1,
                        sliding_window=[None, 5], logits_soft_cap=[None, 2.0], pcp_min_tokens=6)
    oracle = Oracle(svc.config, 5)
    oracle.sinks = {0: torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)}
    a, b = svc.add_sequence(), svc.add_sequence()
    for request in ({a: 20, b: 3}, {a: 1, b: 1}, {a: 7, b: 1}, {a: 1, b: 12}, {a: 1, b: 1}):
        assert run_step(svc, oracle, request) <= 1e-10
    assert svc.stats()["backend"] == "TORCH"
    with svc.step({a: 1}) as step:
        q, k, v = oracle.random_qkv(1)
        with pytest.raises(InvalidRequestError, match=r"sinks must be a tensor \[num_q_heads=4\]"):
            step.attend(0, q, k, v, sinks=torch.zeros(3))
        for odd, match in ((torch.zeros(4).to_sparse(), "sinks is a torch.sparse_coo tensor: pass a dense one"),
                           (torch.zeros(4, device="meta"), "sinks is on meta"),
                           (torch.zeros(4, dtype=torch.complex64), "finite floating-point logits"),
                           ([0.0] * 4, r"sinks must be a tensor .* got list")):
            with pytest.raises(InvalidRequestError, match=match):
                step.attend(0, q, k, v, sinks=odd)
        for layer in range(2):
            step.attend(layer, q, k, v)
    assert svc.sequence_length(a) == 31          # the rejected call changed nothing; the step committed
    # A block that ends normally with a layer never attended: typed error naming it, nothing committed.
    with pytest.raises(IncompleteStepError, match=r"layers \[1\] never attended \(1 of 2\): it was rolled back") as info:
        with svc.step({a: 1}) as step:
            step.attend(0, *oracle.random_qkv(1))
    assert info.value.missing == [1] and svc.sequence_length(a) == 31
    with pytest.raises(KeyError):                # the caller's own error stays the one raised (silent rollback)
        with svc.step({a: 1}) as step:
            step.attend(0, *oracle.random_qkv(1))
            raise KeyError("caller")
    assert svc.sequence_length(a) == 31


def test_fp8_cache_through_the_service(start_service):
    """fp8_e4m3 KV (float32 activations): four times the blocks of a float32 cache in the same bytes (twice
    those of bf16), stats say so, and outputs stay within the format's error of the float64 oracle; interleave = block size."""
    budget = 3 * 2 * 4 * 2 * 8 * 4 * 64    # 64 float32 pages: layers, K/V, block, kv heads, head size, bytes
    svc = start_service(num_shards=3, dtype="float32", kv_cache_dtype="fp8_e4m3", num_blocks_per_shard=None,
                        kv_cache_bytes_per_shard=budget, num_layers=3, dcp_interleave=4,
                        sliding_window=[None, 6, None])
    stats = svc.stats()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"
    assert all(s["blocks_total"] == 4 * 64 and s["token_capacity"] == 4 * 64 * 4 for s in stats["shards"])
    oracle = Oracle(svc.config, 6)
    a, b = svc.add_sequence(), svc.add_sequence()
    worst = 0.0
    for request in ({a: 30, b: 9}, {a: 1, b: 1}, {a: 4, b: 1}, {a: 1, b: 1}):
        worst = max(worst, run_step(svc, oracle, request, check=False))
    assert 0 < worst < 0.15, worst                 # max abs error; outputs are O(1) (unit-variance V)


def test_fp8_cache_with_replicas_survives_a_killed_shard(start_service):
    """kv_replicas=2 with dynamic fp8 scales: a killed shard's replacement is refilled from the copies and
    holds exactly the same real values (checksums of the dequantised caches), and steps continue."""
    svc = start_service(num_shards=3, dtype="float32", kv_cache_dtype="fp8_e5m2", kv_replicas=2,
                        sliding_window=[None, 7], rpc_timeout_s=RPC_S, collective_timeout_s=5.0,
                        health_check_interval_s=1.0, start_timeout_s=120.0)
    oracle = Oracle(svc.config, 7)
    a, b = svc.add_sequence(), svc.add_sequence()
    for request in ({a: 14, b: 5}, {a: 1, b: 1}):
        run_step(svc, oracle, request, check=False)
    sums = kv_checksums(svc)
    wait_rank_replaced(svc, 1, kill_shard(svc, 1))
    assert kv_checksums(svc) == pytest.approx(sums, rel=1e-12)
    worst = max(run_step(svc, oracle, request, check=False) for request in ({a: 1, b: 1}, {a: 3, b: 1}))
    assert 0 < worst < 0.3, worst                  # e5m2: 2 mantissa bits; outputs are O(1)


def test_fp8_one_clients_outliers_leave_another_clients_outputs_bit_identical(start_service):
    """Two clients of one fp8_e4m3 service (dynamic scales): client A's probe of a sequence gives bit-identical
    outputs before and after client B writes a finite K/V element of 1e6 and frees it, including for a sequence
    A adds afterwards on pages B freed (a page written from its first slot starts afresh). Every layer has a
    window, so shards holding no key of a query within it send no row for it (ServiceConfig.row_window)."""
    import cpattn
    from service_oracle import causal_attention

    svc = start_service(num_shards=3, dtype="float32", kv_cache_dtype="fp8_e4m3", num_blocks_per_shard=6,
                        num_layers=2, dcp_interleave=4, sliding_window=[12, 3], logits_soft_cap=[None, 5.0])
    client_b = cpattn.connect(name=svc.config.name, namespace=svc.config.namespace)
    try:
        cfg, g = svc.config, torch.Generator().manual_seed(22)

        def qkv(t, big=None):
            x = [torch.randn(t, h, cfg.head_size, generator=g) for h in (cfg.num_q_heads, cfg.num_kv_heads,
                                                                         cfg.num_kv_heads)]
            if big is not None:
                x[1][t // 2, 0, 3] = x[2][t // 2, 1, 5] = big
            return x

        prefill = [qkv(21) for _ in range(cfg.num_layers)]
        probe = [qkv(1) for _ in range(cfg.num_layers)]

        def fill(client, layers):
            sid = client.add_sequence()
            with client.step({sid: layers[0][0].shape[0]}) as step:
                for layer, (q, k, v) in enumerate(layers):
                    step.attend(layer, q, k, v)
            return sid

        def probe_outputs(sid):
            with svc.step({sid: 1}) as step:
                return [step.attend(layer, q, k, v).clone() for layer, (q, k, v) in enumerate(probe)]

        first = probe_outputs(fill(svc, prefill))
        for layer, (q, k, v) in enumerate(probe):            # the probe is within the format's bound of float64
            kk = torch.cat([prefill[layer][1], k]).double()
            vv = torch.cat([prefill[layer][2], v]).double()
            ref = causal_attention(q.double(), kk, vv, window=[12, 3][layer], soft_cap=[None, 5.0][layer])
            assert float((first[layer].double() - ref).norm() / ref.norm()) < 1e-1
        twin = fill(svc, prefill)                            # same values on other pages, before B writes
        outlier = fill(client_b, [qkv(21, big=1e6) for _ in range(cfg.num_layers)])
        with client_b.step({outlier: 1}) as step:            # B's outlier also in a decode step
            for layer, (q, k, v) in enumerate(qkv(1, big=-1e6) for _ in range(cfg.num_layers)):
                step.attend(layer, q, k, v)
        assert all(torch.equal(x, y) for x, y in zip(first, probe_outputs(twin)))
        client_b.free(outlier)
        reused = fill(svc, prefill)                          # the pool holds only the pages B freed
        assert all(torch.equal(x, y) for x, y in zip(first, probe_outputs(reused)))
    finally:
        client_b.close()
