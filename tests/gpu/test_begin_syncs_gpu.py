"""Opening a decode run's later step on the client never waits for the GPU (issue 18): building the step's plans
and the in-process shard's plan (ShardLayerRunner.plan: the backend's metadata, the graphs' buffers refilled) make
no device synchronisation, checked by torch's sync debug mode, for bf16, dynamic fp8 and sliding-window caches.
A synchronisation there costs a wait for whatever the caller's model queued before the step (and ~10-50 us when
the GPU is idle): ShardLayerRunner._to_device used to copy three index tensors blocking and the builders read
``bool(slots >= 0)`` back from the device, on every step."""

from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = pytest.mark.gpu


def _coordinator(kv: str, window: int | None):
    from cpattn.cluster.coordinator import Coordinator
    from cpattn.config import ServiceConfig

    common = dict(num_shards=1, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                  num_blocks_per_shard=512, max_sequences=8, kv_cache_dtype=kv, sliding_window=window)
    coordinator = Coordinator(ServiceConfig(**common, device="cpu", dtype="float32"))
    client_id = coordinator.clients.check(coordinator.register_client()["credential"])
    return coordinator, client_id, ServiceConfig(**common, device="cuda", dtype="bfloat16", backend="TRITON")


@pytest.mark.parametrize("kv, window", [("auto", None), ("fp8_e4m3", None), ("auto", 64)])
def test_a_decode_runs_later_steps_open_without_a_device_sync(kv, window):
    from cpattn.attention.backends.triton_attn import TritonAttentionBackend
    from cpattn.cluster.decode_run_plans import use_block_tables
    from cpattn.cluster.layer_runner import ShardLayerRunner
    from cpattn.cluster.page_delta import PageCache

    coordinator, client_id, cfg = _coordinator(kv, window)
    seqs = [coordinator.table.add(client_id, f"s{i}").seq_id for i in range(3)]
    # Contexts of 800-1007 keys stay in one graphs bucket for the run: under 64 pages, and a split count that
    # changes only at powers of two of keys per tile (decode_num_splits)
    for i, s in enumerate(seqs):
        seq, growth, _ = coordinator.ledger.plan_fill(client_id, s, 1000 - 100 * i, 1, coordinator.gen)
        coordinator.ledger.commit_fill(seq, 1000 - 100 * i, growth)
    device = torch.device("cuda")
    fp8 = kv != "auto"
    cache = torch.zeros(2, 512, 16, 2, 64, device=device, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    runner = ShardLayerRunner(cfg, TritonAttentionBackend, [cache] * cfg.num_layers, device,
                              [torch.ones(2, 512, 2, device=device)] * cfg.num_layers if fp8 else None)
    graphs = runner.new_graphs()
    assert graphs is not None
    ledger, pages = coordinator.ledger, PageCache()
    admitted = ledger.admit(client_id, {s: 1 for s in seqs}, 8, 1)
    step, plans = ledger.open(admitted, (0,), coordinator.gen)
    reply = pickle.loads(pickle.dumps(ledger.reply(step, admitted.seqs, admitted.request, plans,
                                                   pages.held(seqs, [0]), coordinator.gen.epoch)))
    tables = {0: pages.apply(0, reply.seq_ids, reply.local_pages[0])}
    use_block_tables([reply], tables)
    use_block_tables(reply.later, tables)
    assert runner.plan(reply.local_plans[0], graphs).graphs is not None   # captures the bucket
    torch.cuda.synchronize()
    graphed = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for j in range(len(reply.later)):
            planned = runner.plan(reply.later[j].local_plans[0], graphs)
            graphed += planned.graphs is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphed == len(reply.later) == 7   # every later step replays the graphs (no recapture, no sync)
