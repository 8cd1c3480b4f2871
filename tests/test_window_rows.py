"""Rows outside every window are not sent: when every layer has a sliding window, a shard that holds no key of a
query within the largest window computes and returns no row for it (ServiceConfig.row_window, computed_rows).

The service's data path without Ray (tests/test_fp8_kv_cache.InProcessService) against the float64 oracle.
"""

import torch

from cpattn import ServiceConfig
from cpattn.cluster.step_planner import computed_rows
from tests.test_fp8_kv_cache import InProcessService, _oracle


def test_computed_rows_drops_queries_with_no_key_in_the_window():
    q_lens, ctx = torch.tensor([1, 3]), torch.tensor([10, 4])
    pieces = torch.tensor([[1, 4, 1]])
    assert computed_rows(q_lens, ctx, torch.zeros(0, 3, dtype=torch.int64)) is None
    starts = torch.tensor([10, 3, 4, 2])                   # queries 0 and 2 see none of their local keys
    assert computed_rows(q_lens, ctx, torch.zeros(0, 3, dtype=torch.int64), starts).tolist() == [1, 3]
    assert computed_rows(q_lens, ctx, pieces, torch.tensor([10, 4, 4, 4])).tolist() == [1, 2, 3]   # pieces stay
    assert ServiceConfig(num_layers=2, sliding_window=[8, 3]).row_window() == 8
    assert ServiceConfig(num_layers=2, sliding_window=[8, None]).row_window() is None


def test_windowed_layers_send_only_rows_with_keys_in_the_window():
    """3 shards, interleave 8 (the page size), windows 6 and 3 on the two layers, soft cap on one: a decode's
    window lies on one or two shards, so the others send nothing for it; outputs equal float64's."""
    cfg = ServiceConfig(num_shards=3, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                        dtype="float32", num_blocks_per_shard=32, pcp_min_tokens=16, dcp_interleave=8,
                        sliding_window=[6, 3], logits_soft_cap=[None, 4.0])
    assert cfg.row_window() == 6
    g = torch.Generator().manual_seed(6)
    svc, history = InProcessService(cfg), {}
    a, b = svc.add(), svc.add()
    sinks = [None, torch.randn(cfg.num_q_heads, generator=g)]
    sent_rows = []
    for request in ({a: 40, b: 13}, {a: 1, b: 1}, {a: 1, b: 1}, {a: 5, b: 1}):
        t = sum(request.values())
        layers = [(torch.randn(t, cfg.num_q_heads, cfg.head_size, generator=g),
                   torch.randn(t, cfg.num_kv_heads, cfg.head_size, generator=g),
                   torch.randn(t, cfg.num_kv_heads, cfg.head_size, generator=g)) for _ in range(cfg.num_layers)]
        outs = svc.step(request, layers, sinks)
        refs = _oracle(cfg, history, request, layers, sinks)
        for o, r in zip(outs, refs):
            torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)
        sent_rows.append(sum(p.num_rows for p in svc.last_plans))
    # Decode steps (2 queries): without the window rule every shard would send both rows (6 rows).
    assert sent_rows[1] < 6 and sent_rows[2] < 6, sent_rows
