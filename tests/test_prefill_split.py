"""A prefill's causal part split by time between the client's in-process ranks and remote ones, and remote ranks
attending their own compact message (issue 18: attention/pcp.py split_by_time, cluster/new_tokens.py).

Exactness runs the service's data path without Ray (tests/split_service.py) against float64 attention over the
exact K/V, for odd shard counts, GQA, replicas, windows, fresh sequences, chunks onto a context and fp8 caches.
"""

from __future__ import annotations

import time

import pytest
import torch

from cpattn.attention.pcp import ALIGN, WireCost, _range_time, plan_causal_pieces, split_by_time
from cpattn.config import ServiceConfig
from split_service import SplitService
from test_fp8_kv_cache import ERROR_BOUND, RelError, _oracle


def _cost(n, remote, flops_per_byte=3000.0, hq=32, hk=8, d=128):
    return WireCost.of(remote, hq, hk, d, 2, flops_per_byte)


def test_32k_on_two_gpus_gives_the_remote_rank_the_latest_rows_and_a_smaller_share():
    cost = _cost(2, {1})
    (a0, b0), (a1, b1) = split_by_time(32768, 2, cost)
    assert (a0, b1) == (0, 32768) and b0 == a1 and b0 % ALIGN == 0
    local_pairs, remote_pairs = _range_time(a0, b0, 32768, 2, None), _range_time(a1, b1, 32768, 2, None)
    assert 0.52 < local_pairs / (local_pairs + remote_pairs) < 0.6   # the wire's ~1.4 ms goes to the client
    # Both finish together, within one aligned block of the boundary.
    local_t, remote_t = _range_time(a0, b0, 32768, 2, None), _range_time(a1, b1, 32768, 2, cost)
    assert abs(local_t - remote_t) <= _range_time(b0 - ALIGN, b0 + ALIGN, 32768, 2, cost)


@pytest.mark.parametrize("n,remote,length", [(2, {1}, 131072), (3, {1, 2}, 50000), (5, {2, 3, 4}, 9001),
                                             (4, {0, 3}, 4096), (3, {1, 2}, 300)])
def test_split_covers_the_request_once_local_ranks_first(n, remote, length):
    cost = _cost(n, remote)
    bounds = split_by_time(length, n, cost)
    order = [r for r in range(n) if r not in remote] + sorted(remote)
    assert [bounds[r] for r in order][0][0] == 0 and [bounds[r] for r in order][-1][1] == length
    for r, nxt in zip(order, order[1:]):
        assert bounds[r][1] == bounds[nxt][0] and bounds[r][0] <= bounds[r][1]
    times = [_range_time(*bounds[r], length, n, cost if r in remote else None) for r in range(n)]
    last_blocks = _range_time(length - 2 * ALIGN, length, length, n, cost)
    assert max(times) <= 1.01 * _best_possible(length, n, cost) + last_blocks


def _best_possible(length, n, cost):
    """A lower bound: all pairs spread evenly, no wire."""
    return length * (length + 1) / 2 / n


def test_pieces_cover_every_new_token_once_and_equal_shares_without_a_wire_cost():
    query_lens = [5000, 1, 40, 3000, 0, 2600]
    for cost in (None, _cost(3, {1, 2}), _cost(3, {2}, 0.5)):
        pieces = plan_causal_pieces(query_lens, 3, 2048, skip_decodes=True, wire_cost=cost)
        covered = torch.zeros(sum(query_lens), dtype=torch.int64)
        for p in pieces:
            for q_start, q_end, _ in p.tolist():
                covered[q_start:q_end] += 1
        assert covered.tolist() == [0 if t == 5000 else 1 for t in range(sum(query_lens))]   # the decode: none
    # No wire cost: head-tail pairs (chunk r and 2N-1-r of 2N), the same triangle area each.
    assert [p.tolist() for p in plan_causal_pieces([4000], 2, 2048)] == [[[0, 1000, 0], [3000, 4000, 0]],
                                                                         [[1000, 2000, 0], [2000, 3000, 0]]]
    assert WireCost.of([1], 32, 8, 128, 2, 0.0) is None and WireCost.of([], 32, 8, 128, 2, 3000.0) is None


def test_the_split_plans_in_well_under_a_millisecond():
    cost = _cost(8, set(range(1, 8)))
    t0 = time.perf_counter()
    for _ in range(10):
        split_by_time(1 << 20, 8, cost)
    assert (time.perf_counter() - t0) / 10 < 0.005   # measured ~0.3 ms (8 ranks, 1M tokens); loose for CI


def _config(n, hq, hk, **kw):
    base = dict(num_shards=n, num_layers=2, num_q_heads=hq, num_kv_heads=hk, head_size=8, block_size=4,
                dtype="float64", num_blocks_per_shard=160, pcp_min_tokens=6, dcp_interleave=1)
    base.update(kw)
    return ServiceConfig(**base)


def _layers(cfg, t, g):
    return [tuple(torch.randn(t, h, cfg.head_size, generator=g, dtype=torch.float64)
                  for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads)) for _ in range(cfg.num_layers)]


CASES = [  # (shards, local, hq, hk, extra config, flops per byte[, wire])
    (2, (0,), 4, 2, {}, 0.02),
    (3, (0,), 4, 2, {"dcp_interleave": 2}, 0.02, "broadcast"),   # full q/k/v on remote ranks: no compact
    (3, (0,), 6, 1, {"dcp_interleave": 4}, 0.05),
    (5, (0, 1), 4, 4, {}, 0.01),
    (3, (1,), 4, 2, {"kv_replicas": 2}, 0.03),
    (3, (0,), 4, 2, {"sliding_window": [None, 7], "logits_soft_cap": 9.0}, 0.02),
    (2, (0,), 4, 1, {}, 3000.0),    # the remote rank's wire costs more than any share: it only stores
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_prefills_with_compact_remote_ranks_match_float64(case):
    n, local, hq, hk, extra, fpb, *wire = CASES[case]
    cfg = _config(n, hq, hk, **extra)
    svc = SplitService(cfg, local, fpb, *wire)
    g = torch.Generator().manual_seed(70 + case)
    a, b, c = svc.add(), svc.add(), svc.add()
    history, sinks = {}, [None, torch.randn(hq, generator=g, dtype=torch.float64)]
    steps = [{a: 61}, {b: 37, c: 3}, {a: 19, b: 1}, {c: 44}, {a: 1, b: 1, c: 1}]
    for j, request in enumerate(steps):
        layers = _layers(cfg, sum(request.values()), g)
        expected = _oracle(cfg, history, request, layers, sinks)
        got = svc.step(request, layers, sinks)
        for layer, (o, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(o, e, atol=1e-10, rtol=1e-10, msg=f"step {j} layer {layer} of {request}")
        if j == 0:   # a fresh sequence: every remote rank with rows attended its message unexpanded
            for r, (p, pl) in enumerate(zip(svc.last_plans, svc.last_planned)):
                assert pl.new_tokens_only is not None
                assert pl.new_tokens_only.compact == (r not in local and not wire)
                if r not in local and fpb < 1:
                    assert p.num_rows and p.rows[0] > 0   # a remote rank's rows come after the client's


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_written_from_compact_messages_read_back_within_the_format_error(fmt):
    cfg = _config(3, 4, 2, dtype="float32", kv_cache_dtype=fmt, dcp_interleave=2)
    svc = SplitService(cfg, (0,), 0.03)
    g = torch.Generator().manual_seed(5)
    a = svc.add()
    history, sinks, err = {}, [None, None], RelError()
    for j, request in enumerate([{a: 57}, {a: 23}, {a: 1}, {a: 9}]):
        layers = [tuple(x.float() for x in qkv) for qkv in _layers(cfg, sum(request.values()), g)]
        expected = _oracle(cfg, history, request, layers, sinks)
        got = svc.step(request, layers, sinks)
        for o, e in zip(got, expected):
            if j == 0:   # a fresh prefill reads no cache: exact up to float32
                torch.testing.assert_close(o.double(), e, atol=1e-5, rtol=1e-5)
            else:
                err.add([o.double()], [e])
        if j == 0:
            assert any(pl.new_tokens_only.compact for pl in svc.last_planned)
    assert err.value < ERROR_BOUND[fmt]


def _compact_case(g, t=90):
    """Random pieces over T tokens (token space), the rows a rank would get: (P3, q rows, kv rows, P4)."""
    cuts = sorted(torch.randperm(t - 1, generator=g)[:5].add(1).tolist())
    bounds = list(zip([0] + cuts, cuts + [t]))
    pieces_P3 = torch.tensor([(qs, qe, max(0, qs - int(torch.randint(0, 30, (), generator=g))))
                              for qs, qe in bounds[1::2]], dtype=torch.int64)
    q_rows = torch.cat([torch.arange(qs, qe) for qs, qe, _ in pieces_P3.tolist()])
    kv_mask = torch.rand(t, generator=g) < 0.3                  # tokens the rank stores
    for qs, qe, ks in pieces_P3.tolist():
        kv_mask[ks:qe] = True
    kv_rows = kv_mask.nonzero().flatten()
    cq = torch.searchsorted(q_rows, pieces_P3[:, 0].contiguous())
    ck = torch.searchsorted(kv_rows, pieces_P3[:, 2].contiguous())
    pieces_P4 = torch.stack([cq, cq + pieces_P3[:, 1] - pieces_P3[:, 0], ck, ck + pieces_P3[:, 1] - pieces_P3[:, 2]], 1)
    return pieces_P3, q_rows, kv_rows, pieces_P4


@pytest.mark.parametrize("seed", range(4))
def test_compact_pieces_equal_the_token_space_reference_and_the_default_path(seed):
    from cpattn.attention.backend import AttentionSpec
    from cpattn.attention.backends.torch_ref import TorchAttentionImpl
    from cpattn.attention.ops.reference import ragged_causal_attention, ragged_causal_pieces

    g = torch.Generator().manual_seed(seed)
    window, cap = [(None, None), (5, None), (None, 4.0), (11, 7.0)][seed]
    q, k, v = (torch.randn(90, h, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    pieces_P3, q_rows, kv_rows, pieces_P4 = _compact_case(g)
    expected_out, expected_lse = ragged_causal_attention(q, k, v, pieces_P3, 0.3, window, cap)
    got_out, got_lse = ragged_causal_pieces(q[q_rows], k[kv_rows], v[kv_rows], pieces_P4, 0.3, window, cap)
    torch.testing.assert_close(got_out, expected_out[q_rows], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_lse, expected_lse[q_rows], atol=1e-12, rtol=1e-12)
    # The default GPU path (q placed among its keys, TORCH's forward_new_tokens), run on the host here.
    impl = TorchAttentionImpl(AttentionSpec(6, 2, 8, torch.float64, 4, sliding_windows=(window,),
                                            logits_soft_caps=(cap,)))
    out, lse = impl.causal_pieces_on_keys(q[q_rows], k[kv_rows], v[kv_rows], pieces_P4)
    ref_out, ref_lse = ragged_causal_pieces(q[q_rows], k[kv_rows], v[kv_rows], pieces_P4, impl.spec.scale, window, cap)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
