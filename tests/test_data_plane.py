"""The data plane's pieces on CPU: which rows a shard returns, merging partial rows, the commit sent without
waiting (async_commit) when a shard dies after the last layer, and one step per client at a time.

Expected values come from the float64 oracle (service_oracle) or from merging full-size partials.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

import cpattn
from conftest import service_config
from cpattn.attention import merge_attn_states
from cpattn.attention.pcp import plan_causal_pieces
from cpattn.attention.ops.merge import merge_rows
from cpattn.cluster.step_planner import computed_rows
from cpattn.errors import InvalidRequestError, ServiceError
from reliability_common import kill_shard, wait_replaced
from service_oracle import Oracle, checked_step


def _rows_by_hand(query_lens, local_ctx, pieces) -> set[int]:
    rows, start = set(), 0
    for q, c in zip(query_lens, local_ctx):
        if c > 0:
            rows.update(range(start, start + q))
        start += q
    for qs, qe, _ in pieces:
        rows.update(range(qs, qe))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_computed_rows_are_context_rows_plus_causal_pieces(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 6, (), generator=gen))
    query_lens = torch.randint(1, 40, (int(torch.randint(1, 7, (), generator=gen)),), generator=gen).tolist()
    pieces = plan_causal_pieces(query_lens, n, pcp_min_tokens=16)
    t = sum(query_lens)
    for rank in range(n):
        local_ctx = (torch.randint(0, 3, (len(query_lens),), generator=gen) * torch.randint(0, 2, (len(query_lens),),
                                                                                            generator=gen))
        rows = computed_rows(torch.tensor(query_lens), local_ctx, pieces[rank])
        expected = _rows_by_hand(query_lens, local_ctx.tolist(), pieces[rank].tolist())
        got = set(range(t)) if rows is None else set(rows.tolist())
        assert got == expected
        if rows is not None:
            assert rows.dtype == torch.int64 and bool((rows[1:] > rows[:-1]).all())


def test_decode_rows_are_all_rows_and_empty_prefill_rank_has_none():
    # A decode with context everywhere: every rank returns every row (None).
    assert computed_rows(torch.tensor([1, 1]), torch.tensor([5, 3]), torch.zeros(0, 3, dtype=torch.int64)) is None
    # A prefill from empty on a rank with no piece: nothing travels back.
    rows = computed_rows(torch.tensor([8]), torch.tensor([0]), torch.zeros(0, 3, dtype=torch.int64))
    assert rows is not None and rows.numel() == 0


@pytest.mark.parametrize("seed", range(5))
def test_merge_rows_matches_full_merge(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    t, h, d, n = 13, 3, 8, int(torch.randint(1, 5, (), generator=gen))
    outs = torch.randn(n, t, h, d, generator=gen, dtype=torch.float64)
    lses = torch.randn(n, t, h, generator=gen, dtype=torch.float64) * 4
    covered = torch.rand(n, t, generator=gen) < 0.6
    covered[0] |= ~covered.any(0)            # every row in at least one partial
    parts = []
    for i in range(n):
        if bool(covered[i].all()) and i % 2 == 0:
            parts.append((None, outs[i], lses[i]))
            continue
        rows = covered[i].nonzero().flatten()
        lses[i, ~covered[i]] = -math.inf
        if rows.numel():
            parts.append((rows, outs[i, rows], lses[i, rows]))
    expected, _ = merge_attn_states(outs, lses)
    got = merge_rows(parts, t)
    assert got.dtype == torch.float64 and torch.allclose(got, expected, rtol=1e-12, atol=1e-12)


# --- commit sent without waiting ------------------------------------------------------------------

TIMEOUTS = dict(rpc_timeout_s=60.0, collective_timeout_s=5.0, health_check_interval_s=1.0, start_timeout_s=120.0)


def _kill_after_layer0(svc, rank):
    return lambda step, layer: kill_shard(svc, rank) if layer == 0 else None


@pytest.mark.parametrize("async_commit", [True, False])
def test_idle_shard_lost_mid_step_single_replica(ray_session, async_commit):
    """kv_replicas=1, a shard holding none of the step's rows killed mid-step (the client may not see it on
    the wire): the step's tokens are not added, the error (at the step's end, or with async_commit at the
    client's next call) says to run it again, nothing was lost, and the sequence continues exactly."""
    svc = cpattn.start(service_config(num_shards=3, async_commit=async_commit, **TIMEOUTS))
    try:
        oracle = Oracle(svc.config, 5)
        b = svc.add_sequence()
        checked_step(svc, oracle, {b: 1}, tol=1e-10)       # b's one token lives on shard 0; shard 2 holds none
        replaced = svc.stats()["shards_replaced"]
        with pytest.raises(ServiceError, match="rolled back") as info:   # 2 tokens: a plain step, not a decode run
            checked_step(svc, oracle, {b: 2}, after_layer=_kill_after_layer0(svc, 2), tol=1e-10)
        assert "run" in str(info.value) and "again" in str(info.value)
        wait_replaced(svc, replaced + 1)
        assert svc.sequence_length(b) == oracle.length(b) == 1
        checked_step(svc, oracle, {b: 3}, tol=1e-10)
    finally:
        svc.shutdown()


def test_two_replicas_shard_lost_mid_step_is_invisible(ray_session):
    """kv_replicas=2: whether the client sees the loss on the wire (replay inside the step) or only the
    commit does (replay at the next call, from the step's kept q/k/v), the caller sees no error and every
    output, before and after, is exact."""
    svc = cpattn.start(service_config(num_shards=3, kv_replicas=2, **TIMEOUTS))
    try:
        oracle = Oracle(svc.config, 6)
        a = svc.add_sequence()
        checked_step(svc, oracle, {a: 1}, tol=1e-10)
        replaced = svc.stats()["shards_replaced"]
        checked_step(svc, oracle, {a: 1}, after_layer=_kill_after_layer0(svc, 2), tol=1e-10)
        assert svc.sequence_length(a) == oracle.length(a) == 2
        wait_replaced(svc, replaced + 1)
        checked_step(svc, oracle, {a: 1}, tol=1e-10)
        checked_step(svc, oracle, {a: 7}, tol=1e-10)
    finally:
        svc.shutdown()


def test_second_thread_on_one_client_is_rejected(ray_session):
    """One open step per client, claimed atomically: a second thread gets InvalidRequestError and the first
    step still commits exactly."""
    svc = cpattn.start(service_config(num_shards=2, **TIMEOUTS))
    try:
        oracle = Oracle(svc.config, 7)
        a, b = svc.add_sequence(), svc.add_sequence()
        entered, release, errors = threading.Event(), threading.Event(), []

        def second():
            entered.wait(30)
            try:
                with svc.step({b: 1}):
                    pass
            except InvalidRequestError as exc:
                errors.append(exc)
            finally:
                release.set()

        thread = threading.Thread(target=second)
        thread.start()
        checked_step(svc, oracle, {a: 3}, tol=1e-10,
                     after_layer=lambda step, layer: (entered.set(), release.wait(30)) if layer == 0 else None)
        thread.join(30)
        assert len(errors) == 1 and "one step at a time" in str(errors[0])
        assert svc.sequences() == {a: 3, b: 0}
    finally:
        svc.shutdown()
