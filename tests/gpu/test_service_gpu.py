"""The service contract on the GPU machine: four shards sharing one GPU (gloo data plane) with each
GPU backend, checked against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

BACKENDS = ["TORCH", "TRITON", "FLASHINFER", "FLASH_ATTN"]


def _usable(backend: str, block_size: int) -> str | None:
    from cpattn.attention import get_attn_backend
    from cpattn.errors import BackendUnavailableError

    try:
        get_attn_backend(backend, head_size=128, dtype=torch.bfloat16, block_size=block_size, num_q_heads=8,
                         num_kv_heads=2, device="cuda")
    except BackendUnavailableError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_service_on_one_gpu_matches_reference(ray_session, backend, interleave):
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step

    why = _usable(backend, 16)
    if why:
        pytest.skip(why)
    cfg = service_config(num_shards=4, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype="bfloat16", backend=backend, dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.25, num_cpus_per_shard=0.5, num_blocks_per_shard=256, pcp_min_tokens=64)
    svc = cpattn.start(cfg)
    try:
        assert {s["backend"] for s in svc.info()["shards"]} == {backend}
        oracle = Oracle(cfg, seed=3)
        a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
        for request in ({a: 300, b: 17}, {a: 1, b: 1, c: 130}, {a: 1, b: 40, c: 1}, {a: 1, b: 1, c: 1}):
            relative_step(svc, oracle, request, 1e-2, f"{backend} I={interleave}")
    finally:
        svc.shutdown()


@pytest.mark.parametrize("kv,interleave,gpus", [("fp8_e4m3", 1, 1), ("fp8_e4m3", 16, 1), ("auto", 1, 1),
                                                 ("auto", 16, 1), ("fp8_e4m3", 16, 2), ("auto", 1, 2)])
@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
def test_service_fp8_windows_caps_sinks(ray_session, backend, kv, interleave, gpus):
    """Every GPU backend through the service on one GPU (4 shards, the client computing them in-process over CUDA IPC,
    fp8 page scales included) or two (2 shards: one in-process, one over NCCL): an fp8 or bf16 cache, a full layer
    with sinks and a windowed, soft-capped layer, PCP prefill, chunked prefill and decodes, vs the float64 oracle
    (bf16 rel < 2e-2, fp8 e4m3 < 1e-1). FLASHINFER's windows: a DCP shard's per-query windows as plans by count, its
    chunks masked; FLASH_ATTN's windowed layer on TRITON's kernels."""
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step

    why = _usable(backend, 16) or (f"needs {gpus} GPUs" if gpus > torch.cuda.device_count() else None)
    if why:
        pytest.skip(why)
    cfg = service_config(num_shards=4 if gpus == 1 else 2, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128,
                         block_size=16, dtype="bfloat16", backend=backend, dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.25 if gpus == 1 else 1.0, num_cpus_per_shard=0.5,
                         num_blocks_per_shard=256, pcp_min_tokens=64, kv_cache_dtype=kv, sliding_window=[None, 100],
                         logits_soft_cap=[None, 30.0])
    svc = cpattn.start(cfg)
    try:
        assert {s["backend"] for s in svc.info()["shards"]} == {backend}
        # fp8 caches open in-process like bf16 ones
        assert sorted(svc.gateway.local) == ([0, 1, 2, 3] if gpus == 1 else [0])
        oracle = Oracle(cfg, seed=5)
        oracle.sinks = {0: torch.linspace(-1.0, 2.0, 8, dtype=torch.float64)}
        bound = 1e-1 if kv.startswith("fp8") else 2e-2
        a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
        for request in ({a: 300, b: 17}, {a: 1, b: 1, c: 130}, {a: 1, b: 140, c: 1}, {a: 1, b: 1, c: 1}):
            relative_step(svc, oracle, request, bound, f"{backend} {kv} I={interleave} {gpus} GPU(s)")
    finally:
        svc.shutdown()


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN"])
def test_service_fp8_on_dequantised_pages(ray_session, backend, interleave):
    """FLASHINFER and FLASH_ATTN read an fp8 cache through its pages dequantised per layer (no kernel of theirs takes
    a scale per page): through the service on one GPU (4 shards computed in the client's process), a soft-capped
    layer and one with sinks, PCP prefill, chunked prefill and decodes vs the float64 oracle (e4m3 rel < 1e-1)."""
    import cpattn
    from conftest import service_config
    from service_oracle import Oracle, relative_step

    why = _usable(backend, 16)
    if why:
        pytest.skip(why)
    cfg = service_config(num_shards=4, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                         dtype="bfloat16", backend=backend, dcp_interleave=interleave, device="cuda",
                         num_gpus_per_shard=0.25, num_cpus_per_shard=0.5, num_blocks_per_shard=256, pcp_min_tokens=64,
                         kv_cache_dtype="fp8_e4m3", logits_soft_cap=[30.0, None])
    svc = cpattn.start(cfg)
    try:
        assert {s["backend"] for s in svc.info()["shards"]} == {backend}
        oracle = Oracle(cfg, seed=11)
        oracle.sinks = {1: torch.linspace(-1.0, 2.0, 8, dtype=torch.float64)}
        a, b, c = svc.add_sequence(), svc.add_sequence(), svc.add_sequence()
        for request in ({a: 300, b: 17}, {a: 1, b: 1, c: 130}, {a: 1, b: 40, c: 1}, {a: 1, b: 1, c: 1}):
            relative_step(svc, oracle, request, 1e-1, f"{backend} fp8_e4m3 I={interleave}")
    finally:
        svc.shutdown()
