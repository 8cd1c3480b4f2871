"""A prefill step's per-rank wire (cluster/wire_select.py) on real shards over gloo, float64.

Each remote rank gets only the query rows it computes and the new K/V it stores or attends; outputs are checked
against the float64 oracle (service_oracle) and the bytes the client sent against a count made by hand from
token positions (who stores token p: (p // I) mod N) and the causal pieces of attention/pcp.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import cpattn
from conftest import service_config
from cpattn.attention.pcp import plan_causal_pieces
from cpattn.cluster.wire_select import message_bytes, select_wire
from cpattn.errors import IncompleteStepError
from service_oracle import Oracle, checked_step

ITEMSIZE = 8   # float64


def expected_sent_bytes(cfg, query_lens: list[int], context_lens: list[int], replicas: int = 1) -> int:
    """Bytes per layer of a per-rank step: each rank's header | q rows | k, v rows, counted from positions."""
    n, inter, t = cfg.num_shards, cfg.dcp_interleave, sum(query_lens)
    pieces = plan_causal_pieces(query_lens, n, cfg.pcp_min_tokens, skip_decodes=True)
    total = 0
    for rank in range(n):
        holds = {rank} | ({(rank + 1) % n} if replicas == 2 else set())   # a replica of the next rank's tokens
        q_rows, kv_rows, start = set(), set(), 0
        for q_len, ctx in zip(query_lens, context_lens):
            owners = [(p // inter) % n for p in range(ctx + q_len)]
            if rank in owners[:ctx] or (q_len == 1 and owners[ctx] == rank):   # local context (a decode: folded)
                q_rows.update(range(start, start + q_len))
            kv_rows.update(start + i for i in range(q_len) if owners[ctx + i] in holds)
            start += q_len
        for q_start, q_end, k_start in pieces[rank].tolist():
            q_rows.update(range(q_start, q_end))
            kv_rows.update(range(k_start, q_end))
        assert max(q_rows | kv_rows, default=0) < t
        total += message_bytes(len(q_rows), len(kv_rows), cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, ITEMSIZE)
    return total


def broadcast_bytes(cfg, num_tokens: int) -> int:
    return message_bytes(num_tokens, num_tokens, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, ITEMSIZE)


@pytest.fixture(scope="module")
def services(ray_session):
    """(three shards, interleave 1, GQA 4:1), (two shards, interleave 16, two replicas); prefill_wire auto, which on
    gloo (its root sends each rank a copy of a broadcast) picks per-rank for these prefills. Started at once."""
    cfgs = [service_config(num_shards=3, num_q_heads=8, num_kv_heads=2),
            service_config(num_shards=2, dcp_interleave=16, block_size=16, kv_replicas=2, pcp_min_tokens=8)]
    with ThreadPoolExecutor(len(cfgs)) as pool:
        futures = [pool.submit(cpattn.start, cfg) for cfg in cfgs]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()
        yield started
    finally:
        for svc in started:
            svc.shutdown()


def _steps(svc, oracle: Oracle, plan: list[dict[str, int]], names: dict[str, str]) -> list[dict]:
    """Each request (sequences by name, added on first use) checked against the oracle; the steps' timings."""
    timings = []
    for request in plan:
        for name in request:
            names.setdefault(name, svc.add_sequence())
        step, _ = checked_step(svc, oracle, {names[k]: v for k, v in request.items()})
        timings.append(step.timings)
    return timings


def test_per_rank_prefill_is_exact_and_sends_only_what_ranks_need(services):
    svc = services[0]
    cfg, oracle, names = svc.config, Oracle(svc.config, seed=1), {}
    # A PCP prefill from empty; a short one (one rank computes it); a chunk onto context with a decode and a new
    # sequence of two tokens; two tokens alone (rank 2 stores none and computes none: it gets a header alone).
    plan = [{"a": 41}, {"b": 5}, {"a": 23, "b": 1, "c": 2}, {"d": 2}]
    timings = _steps(svc, oracle, plan, names)
    contexts = [[0], [0], [41, 5, 0], [0]]
    for request, ctx, t in zip(plan, contexts, timings):
        lens = list(request.values())
        per_layer = t["sent_bytes"] / cfg.num_layers
        assert per_layer == expected_sent_bytes(cfg, lens, ctx)
        assert per_layer < cfg.num_shards * broadcast_bytes(cfg, sum(lens))   # what gloo's broadcast sends
    # {"d": 2}: rank 0 computes both rows and needs both keys, rank 1 stores token 1, rank 2 gets the header.
    sizes = [message_bytes(q, kv, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, ITEMSIZE)
             for q, kv in ((2, 2), (0, 1), (0, 0))]
    assert sizes[2] == 32 and timings[-1]["sent_bytes"] / cfg.num_layers == sum(sizes)


def test_interleave_16_replicas_and_a_decode_step_between(services):
    svc = services[1]
    cfg, oracle, names = svc.config, Oracle(svc.config, seed=2), {}
    plan = [{"a": 37}, {"a": 1}, {"a": 20, "b": 9}]
    timings = _steps(svc, oracle, plan, names)
    assert timings[0]["sent_bytes"] / cfg.num_layers == expected_sent_bytes(cfg, [37], [0], replicas=2)
    assert timings[1]["sent_bytes"] / cfg.num_layers == broadcast_bytes(cfg, 1)   # a decode step: broadcast
    assert timings[2]["sent_bytes"] / cfg.num_layers == expected_sent_bytes(cfg, [20, 9], [38, 0], replicas=2)


def test_a_per_rank_step_stopped_early_releases_every_shard(services):
    svc = services[0]
    oracle, names = Oracle(svc.config, seed=4), {}
    names["a"] = svc.add_sequence()
    q, k, v = oracle.random_qkv(30)
    with pytest.raises(IncompleteStepError, match=r"layers \[1\] never attended"):
        with svc.step({names["a"]: 30}) as step:
            step.attend(0, q, k, v)
    assert svc.sequence_length(names["a"]) == 0
    _steps(svc, oracle, [{"a": 30}, {"a": 4}], names)   # the shards left the aborted step: the next ones run


def test_auto_keeps_the_broadcast_when_it_is_smaller():
    """NCCL pipelines one broadcast: three remote ranks that each need every row would cost three times more."""
    from cpattn.cluster.step_planner import ShardStepPlan
    from cpattn.attention.metadata import CommonAttentionMetadata

    def plan(rows, slots):
        md = CommonAttentionMetadata.__new__(CommonAttentionMetadata)
        md.slot_mapping, md.max_query_len = torch.tensor(slots), 4
        return ShardStepPlan(step_id=1, num_tokens=4, metadata=md, causal_pieces=torch.zeros(0, 3, dtype=torch.int64),
                             rows=rows)
    every = [plan(None, [0, -1, -1, 1]) for _ in range(4)]
    assert not select_wire(every, {0}, 4, 2, 8, 2, "auto", "nccl")
    assert select_wire(every, {0}, 4, 2, 8, 2, "auto", "gloo")          # gloo's root sends each rank its copy
    assert [p.kv_rows.tolist() for p in every[1:]] == [[0, 3]] * 3 and all(p.selected for p in every)
    one = [plan(None, [0, -1, -1, 1]), plan(torch.tensor([1, 2]), [-1, 0, 1, -1])]
    assert select_wire(one, {0}, 4, 2, 8, 2, "auto", "nccl") and one[1].kv_rows.tolist() == [1, 2]
    assert not select_wire([plan(None, [0]), plan(None, [-1])], {0}, 4, 2, 8, 2, "broadcast", "nccl")


@pytest.mark.parametrize("seed", range(3))
def test_disjoint_rows_merge_as_a_scatter_exactly(seed):
    """A prefill's rows, each computed by one shard: the scatter equals the LSE merge bit for bit (float32)."""
    from cpattn.attention.ops.merge import _merge_rows_lse
    from cpattn.cluster.wire_select import rows_disjoint

    gen = torch.Generator().manual_seed(seed)
    t, n = 37, 3
    owner = torch.randint(0, n, (t,), generator=gen)
    parts = []
    for rank in range(n):
        rows = (owner == rank).nonzero().flatten()
        parts.append((rows, torch.randn(rows.numel(), 4, 8, generator=gen), torch.randn(rows.numel(), 4, generator=gen)))
    assert rows_disjoint([p[0] for p in parts], t)
    got, want = _merge_rows_lse(parts, t, disjoint=True), _merge_rows_lse(parts, t)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not rows_disjoint([parts[0][0], parts[0][0]], t) and not rows_disjoint([parts[0][0]], t)
    assert not rows_disjoint([None, parts[1][0]], t) and not rows_disjoint([p[0] for p in parts[:2]], t)
