"""A shard's whole-page KV methods (cluster/shard_kv.py) on plain shard workers, without Ray: page copies for a
replacement's refill (plain and fp8), synthetic fills (chunked, replicated, copy on write, fenced), checksums,
and CUDA IPC export refused on a CPU shard."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from conftest import service_config
from cpattn.cluster import authority, coordinator_sequences, shard_kv
from cpattn.cluster.shard import RemoteShard, ShardWorker
from cpattn.cluster.shard_kv import synthetic_kv
from cpattn.errors import AccessDeniedError, StepFencedError
from local_actors import FakeRay, plain_coordinator

SECRET = "s" * 64


def _worker(kind=ShardWorker, **overrides):
    threads = torch.get_num_threads()
    cfg = service_config(num_shards=2, num_blocks_per_shard=8, block_size=4, **overrides)
    worker = kind(cfg, 0, secret=SECRET)
    torch.set_num_threads(threads)   # a shard worker pins its process to num_cpus_per_shard threads
    return worker


def _pages(cfg, n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random pages [num_layers, 2, n, block_size, Hk, D]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.num_layers, 2, n, cfg.block_size, cfg.num_kv_heads, cfg.head_size, generator=gen,
                       dtype=dtype)


def _sum_abs(*tensors) -> float:
    return float(sum(t.double().abs().sum() for t in tensors))


def test_pages_written_read_back_and_copied_to_a_replacement():
    src, dst = _worker(), _worker()
    data = _pages(src.config, 2, seed=0)
    src.write_blocks([1, 5], data)
    assert torch.equal(src.read_blocks([1, 5]), data) and torch.equal(src.read_blocks([5]), data[:, :, 1:])
    assert not src.read_blocks([0, 2]).any()                                # other pages untouched
    assert src.kv_checksum() == pytest.approx(_sum_abs(data), rel=1e-12)
    assert src.get_kv_scales() is None and src.read_block_scales([1]) is None   # not an fp8 cache
    dst.write_blocks([6, 2], src.read_blocks([1, 5]), scales=src.read_block_scales([1, 5]))   # a refill
    assert torch.equal(dst.read_blocks([6, 2]), data)
    assert dst.kv_checksum() == pytest.approx(src.kv_checksum(), rel=1e-12)   # summed in another page order


def test_fp8_pages_copy_with_their_scales_byte_for_byte():
    cfg = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", head_size=16)
    src, dst, fresh = _worker(**cfg), _worker(**cfg), _worker(**cfg)
    data = _pages(src.config, 2, seed=1, dtype=torch.float32) * 3
    src.write_blocks([0, 3], data)                                          # dynamic scales from the pages
    scales = src.read_block_scales([0, 3])
    assert scales.shape == (2, 2, 2, 2) and bool((scales > 0).all())        # [layers, K/V, pages, Hk]
    assert torch.allclose(src.read_blocks([0, 3]), data, rtol=0.07, atol=0.02)   # e4m3: 3 mantissa bits
    dst.write_blocks([4, 7], src.read_blocks([0, 3]), scales=scales)
    for layer in range(2):                                                  # the same bytes under the same scales
        assert torch.equal(dst.kv_caches[layer][:, [4, 7]].view(torch.uint8),
                           src.kv_caches[layer][:, [0, 3]].view(torch.uint8))
        assert torch.equal(dst.kv_scales[layer][:, [4, 7]], src.kv_scales[layer][:, [0, 3]])
    assert dst.kv_checksum() == src.kv_checksum()
    assert dst.get_kv_scales() == src.get_kv_scales()
    fresh.write_blocks([4, 7], src.read_blocks([0, 3]))                     # no scales: computed afresh
    assert fresh.kv_checksum() == pytest.approx(src.kv_checksum(), rel=0.02)


def test_synthetic_kv_is_drawn_in_seeded_chunks(monkeypatch):
    monkeypatch.setattr(shard_kv, "SYNTHETIC_CHUNK", 4)
    k, v = synthetic_kv(5, 1, 0, 10, 2, 8)
    assert k.shape == v.shape == (10, 2, 8) and k.dtype == torch.float32 and not torch.equal(k, v)
    k_late, v_late = synthetic_kv(5, 1, 4, 6, 2, 8)                          # later chunks alone: the same values
    assert torch.equal(k_late, k[4:]) and torch.equal(v_late, v[4:])
    assert torch.equal(synthetic_kv(5, 1, 0, 3, 2, 8)[0], k[:3])
    assert not torch.equal(synthetic_kv(5, 0, 0, 10, 2, 8)[0], k)           # every layer its own
    assert not torch.equal(synthetic_kv(6, 1, 0, 10, 2, 8)[0], k)           # every seed its own
    with pytest.raises(ValueError, match="start 3 must be a multiple of 4"):
        synthetic_kv(5, 1, 3, 4, 2, 8)


def _expected(cfg, seed: int, tokens: range) -> float:
    """Sum of |K| + |V| over every layer of the synthetic tokens ``tokens`` of a fill drawn from ``seed``."""
    total = 0.0
    for layer in range(cfg.num_layers):
        k, v = synthetic_kv(seed, layer, 0, tokens.stop, cfg.num_kv_heads, cfg.head_size)
        total += _sum_abs(k[tokens.start:], v[tokens.start:])
    return total


def _total_checksum(coord) -> float:
    return sum(w._impl.kv_checksum() for w in coord.workers)


def test_fill_writes_every_replica_and_copies_a_shared_page_first(monkeypatch):
    monkeypatch.setattr(coordinator_sequences, "ray", FakeRay)
    # Tokens 0-3 on shard 0's page, 4-7 on shard 1's; two replicas of each.
    coord = plain_coordinator(service_config(num_shards=2, num_blocks_per_shard=8, block_size=4, dcp_interleave=4,
                                             kv_replicas=2))
    cfg, cred = coord.config, coord.register_client()["credential"]
    seq = coord.add_sequence(cred)
    coord.fill_synthetic(cred, seq, 6, 11)
    assert _total_checksum(coord) == pytest.approx(2 * _expected(cfg, 11, range(6)), rel=1e-12)
    fork = coord.fork(cred, seq)      # shares both pages; the half-full one is copied before the fork writes it
    assert coord.fill_synthetic(cred, fork, 2, 12) == 8
    copied_and_new = _expected(cfg, 11, range(4, 6)) + _expected(cfg, 12, range(2))
    assert _total_checksum(coord) == pytest.approx(2 * (_expected(cfg, 11, range(6)) + copied_and_new), rel=1e-12)


def test_a_fenced_fill_writes_nothing(monkeypatch):
    monkeypatch.setattr(coordinator_sequences, "ray", FakeRay)
    coord = plain_coordinator(service_config(num_shards=2, num_blocks_per_shard=8, block_size=4))
    cred = coord.register_client()["credential"]
    seq = coord.add_sequence(cred)
    for w in coord.workers:
        w.fence(coord.gen.incarnation + 1, 1.0, coord.gen.shard_secret)   # a restarted coordinator fenced it
    with pytest.raises(StepFencedError, match="fill_synthetic of coordinator incarnation 1 was fenced"):
        coord.fill_synthetic(cred, seq, 5, 1)
    assert _total_checksum(coord) == 0.0 and coord.sequence_length(cred, seq) == 0
    assert sum(coord.table.blocks_used()) == 0


def test_a_forged_plan_fills_nothing():
    coord = plain_coordinator(service_config(num_shards=2, num_blocks_per_shard=8, block_size=4))
    worker = coord.workers[0]
    cred = coord.register_client()["credential"]
    seq_obj = coord.table.get(coord.add_sequence(cred))
    _, _, plans = coord.ledger.plan_fill(coord.clients.check(cred), seq_obj.seq_id, 4, 1, coord.gen)
    forged = dataclasses.replace(plans[0], auth="not-the-secret")
    with pytest.raises(AccessDeniedError, match="shard 0: fill_synthetic refused: only the service's coordinator"):
        worker.fill_synthetic(forged, 1)
    assert worker._impl.kv_checksum() == 0.0


def test_export_kv_needs_a_live_ticket_and_a_cuda_cache():
    shard = _worker(RemoteShard)
    group = "c-1-e0-g1"
    ticket = authority.make_ticket(SECRET, group, "c-1", time.time())
    with pytest.raises(AccessDeniedError, match="group 'c-1-e0-g1' refused: no valid ticket"):
        shard.export_kv(group, "c-1|0|forged")
    with pytest.raises(AccessDeniedError, match="no valid ticket"):
        shard.export_kv("c-2-e0-g1", ticket)                             # another client's group
    stale = authority.make_ticket(SECRET, group, "c-1", time.time() - 3600)
    with pytest.raises(AccessDeniedError, match="its ticket expired"):
        shard.export_kv(group, stale)
    with pytest.raises(AccessDeniedError, match="shard 0: export_kv refused: the shards keep their KV on cpu: only "
                                                "CUDA caches can be opened by a client"):
        shard.export_kv(group, ticket)


def test_a_replacement_serves_once_marked_ready():
    worker = _worker()
    worker._ready = False   # as ShardSet starts a replacement (ready=False) until its refill is done
    assert not worker.info().ready
    worker.mark_ready(SECRET)
    assert worker.info().ready
