"""Pages outside every window go back to the pool, on the GPU: each GPU backend through the service (4 shards on
one GPU, computed in the client's process), every layer windowed, a cache smaller than the context, other
sequences taking the released pages, vs the float64 oracle. The kernels must never read a page before a window's
first key: a released page may hold another sequence's KV by then."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv,interleave", [("auto", 1), ("fp8_e4m3", 16)])
@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
def test_windowed_sequences_outgrow_the_cache_on_gpu(ray_session, backend, kv, interleave):
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step
    from tests.gpu.test_service_gpu import _usable

    why = _usable(backend, 16)
    if why:
        pytest.skip(why)
    blocks = 24   # pages of 16 a shard: 4 x 24 x 16 = 1,536 tokens in all
    cfg = service_config(num_shards=4, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype="bfloat16", backend=backend, dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.25, num_cpus_per_shard=0.5, num_blocks_per_shard=blocks,
                         pcp_min_tokens=64, kv_cache_dtype=kv, sliding_window=[100, 64], logits_soft_cap=[30.0, None],
                         # FlashInfer JIT-compiles each variant (fp8, window, cap) in the step that first needs it:
                         # a prefill ~90 s on a fresh machine, past the suite's 30 s (as test_prefill_backend_gpu).
                         collective_timeout_s=300.0, rpc_timeout_s=300.0)
    svc = cpattn.start(cfg)
    try:
        assert {s["backend"] for s in svc.info()["shards"]} == {backend}
        oracle = Oracle(cfg, seed=torch.randint(0, 10**6, ()).item())
        bound = 1e-1 if kv.startswith("fp8") else 2e-2
        where = f"{backend} {kv} I={interleave}"
        a, b = svc.add_sequence(), svc.add_sequence()
        for request in ({a: 300, b: 17}, {a: 200, b: 1}, {a: 1, b: 1}):
            relative_step(svc, oracle, request, bound, where)
        for _ in range(5):                  # chunks: PCP, the cache taken back from behind the window
            relative_step(svc, oracle, {a: 250}, bound, where)
        svc.free(b)
        oracle.drop(b)
        c = svc.add_sequence()              # takes pages a gave back
        relative_step(svc, oracle, {c: 200, a: 1}, bound, where)
        for _ in range(40):                 # decode runs (graphed where the backend captures)
            relative_step(svc, oracle, {a: 1, c: 1}, bound, where)
        assert svc.sequence_length(a) > 4 * blocks * 16
        used = sum(s["blocks_used"] for s in svc.stats()["shards"])
        assert used < 4 * blocks / 2, used
    finally:
        svc.shutdown()
