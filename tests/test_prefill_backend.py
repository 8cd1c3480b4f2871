"""prefill_backend (issue 23): a shard's prefill steps on one backend, its decode steps on another, both on the one
paged KV cache the shard allocates.

In one process (tests/dcp_shards.py's shards, the library's ShardLayerRunner): a step where some sequence has
more than one new token is planned and run by the prefill backend, a decode step by the decode backend, every
partial exact against float64 (the prefill double reports base-2 LSEs and reads pages of 16 inside pages of 32,
so a wrong conversion or view would show). The choice: same / auto / a name, every reason when a named one
cannot serve the settings or share the cache, refused before anything starts. Through the service: a prefill
backend that mislabels its LSE base spoils prefill steps only, so the routing is what the shards really do.
With TRITON_INTERPRET=1 (and triton), TRITON and TORCH are paired on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import cpattn
from conftest import service_config
from cpattn.attention import make_dcp_context_metadata, register_backend, select_backend, select_prefill_backend
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.errors import BackendUnavailableError, ConfigError
from tests.dcp_shards import LocalShard, expected_partial, shard_config
from tests.prefill_doubles import DOUBLES, Pages16Base2Backend

HQ, HK, D = 4, 2, 16
# Steps of two sequences: a prefill, decodes, a mixed step (one decode beside a chunk: the prefill backend).
STEPS = [([37, 5], "prefill"), ([1, 1], "decode"), ([1, 9], "prefill"), ([1, 1], "decode")]


@pytest.fixture
def doubles(clean_backend_registry):
    for name, path in DOUBLES.items():
        register_backend(name, path, device_type="cpu")


def _pair_shards(cfg, decode, prefill, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shards = [LocalShard(rank, cfg, 2, g) for rank in range(cfg.num_shards)]
    for s in shards:
        s.cache = s.cache.to(dtype)
        s.runner = ShardLayerRunner(cfg, decode, [s.cache], torch.device("cpu"), prefill_backend_cls=prefill)
    return shards


def _run_steps(shards, dtype, seed, tol):
    """Every step of STEPS on every shard: the backend that ran it (per step), checked against float64."""
    g = torch.Generator().manual_seed(seed)
    total = [sum(step[0][r] for step in STEPS) for r in range(2)]
    keys = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) for n in total]
    values = [torch.randn(n, HK, D, generator=g, dtype=torch.float64) for n in total]
    context, ran = [0, 0], []
    for query_lens, _ in STEPS:
        q = torch.randn(sum(query_lens), HQ, D, generator=g, dtype=torch.float64)
        k_new = torch.cat([k[c:c + n] for k, c, n in zip(keys, context, query_lens)])
        v_new = torch.cat([v[c:c + n] for v, c, n in zip(values, context, query_lens)])
        starts = [0, query_lens[0]]
        used = set()
        for s in shards:
            s.allocate_for([c + n for c, n in zip(context, query_lens)])
            # The causal part among new tokens: each request's on the shard of its index (any split is valid).
            pieces = torch.tensor([(starts[r], starts[r] + query_lens[r], starts[r]) for r in range(2)
                                   if r % s.world == s.rank], dtype=torch.int64).view(-1, 3)
            md = make_dcp_context_metadata(query_lens, context, s.table.gather(s.rows), s.block_size, s.world, s.rank,
                                           s.interleave)
            planned = s.runner.plan(ShardStepPlan(step_id=0, num_tokens=q.shape[0], metadata=md, causal_pieces=pieces))
            out, lse = s.runner.run_layer(planned, 0, q.to(dtype), k_new.to(dtype), v_new.to(dtype))
            eo, el = expected_partial(q, keys, values, context, query_lens, s.rank, s.world, s.interleave, pieces)
            assert torch.equal(lse.isinf(), el.isinf())
            finite = ~el.isinf()
            assert (out.double() - eo).abs().max().item() <= tol
            assert (lse.double() - el)[finite].abs().max().item() <= tol
            used.add(planned.runner.backend.get_name())
        ran.append(used)
        context = [c + n for c, n in zip(context, query_lens)]
    return ran


def test_prefill_steps_run_on_the_prefill_backend_and_decode_steps_on_the_decode_backend():
    cfg = shard_config(2, 1, 32, HQ, HK, D, torch.float64, num_blocks=8)
    shards = _pair_shards(cfg, TorchReferenceBackend, Pages16Base2Backend, torch.float64, seed=1)
    # One kernel page size for both: pages of 32 seen as two of 16 (the prefill double takes only 16).
    assert {s.runner.kernel_block_size for s in shards} == {s.runner.prefill_runner.kernel_block_size for s in shards} \
        == {16}
    ran = _run_steps(shards, torch.float64, seed=2, tol=1e-10)
    want = [{"PAGES16_BASE2" if kind == "prefill" else "TORCH"} for _, kind in STEPS]
    assert ran == want


def test_same_backend_is_one_runner():
    cfg = shard_config(2, 1, 32, HQ, HK, D, torch.float64, num_blocks=8)
    shards = _pair_shards(cfg, TorchReferenceBackend, TorchReferenceBackend, torch.float64, seed=3)
    assert all(s.runner.prefill_runner is None and s.runner.prefill_backend is TorchReferenceBackend for s in shards)
    assert _run_steps(shards, torch.float64, seed=4, tol=1e-10) == [{"TORCH"}] * len(STEPS)


def gpu_config(**fields) -> cpattn.ServiceConfig:
    base = dict(num_shards=2, num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                dtype="bfloat16", device="cuda", num_gpus_per_shard=1, num_blocks_per_shard=8)
    return cpattn.ServiceConfig(**{**base, **fields})


def test_same_auto_and_names(doubles):
    cpu = service_config(prefill_backend="auto", block_size=32)
    decode = select_backend(cpu)
    assert select_prefill_backend(cpu, decode) is decode is TorchReferenceBackend   # CPU: TORCH only
    assert select_prefill_backend(service_config(), decode) is decode                 # same, the default
    assert select_prefill_backend(cpu, decode, prefill_backend="PAGES16_BASE2") is Pages16Base2Backend
    # auto on CUDA, judged on the settings (platform_here=False): FLASH_ATTN beside TRITON, an fp8 cache too (its
    # pages dequantised for the kernel), and windows (its windowed layers on TRITON's kernels: timed faster for a
    # model of full and windowed layers, RESULTS.md "Session 22").
    gpu = gpu_config(backend="TRITON", prefill_backend="auto")
    triton = select_backend(gpu, platform_here=False)
    assert select_prefill_backend(gpu, triton, platform_here=False).get_name() == "FLASH_ATTN"
    fp8 = gpu_config(backend="TRITON", prefill_backend="auto", kv_cache_dtype="fp8_e4m3")
    assert select_prefill_backend(fp8, triton, platform_here=False).get_name() == "FLASH_ATTN"
    for settings in (dict(sliding_window=64), dict(kv_cache_dtype="fp8_e4m3", sliding_window=64)):
        cfg = gpu_config(backend="TRITON", prefill_backend="auto", **settings)
        assert select_prefill_backend(cfg, triton, platform_here=False).get_name() == "FLASH_ATTN"
    # A backend whose windowed prefill auto may not take (the flag off) is passed over for windows only.
    from cpattn.attention.backends.flash_attn import FlashAttentionBackend
    from cpattn.attention.backends.flashinfer import FlashInferBackend

    windowed = gpu_config(backend="TRITON", prefill_backend="auto", sliding_window=64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FlashAttentionBackend, "auto_prefill_with_windows", False)
        assert select_prefill_backend(windowed, triton, platform_here=False) is FlashInferBackend
        assert select_prefill_backend(gpu, triton, platform_here=False) is FlashAttentionBackend
        mp.setattr(FlashInferBackend, "auto_prefill_with_windows", False)
        assert select_prefill_backend(windowed, triton, platform_here=False) is triton
    # A backend slower at prefill than the decode backend is never auto's choice.
    flashinfer = select_backend(gpu_config(backend="FLASHINFER"), platform_here=False)
    assert select_prefill_backend(gpu_config(backend="FLASHINFER", prefill_backend="auto"), flashinfer,
                                  platform_here=False).get_name() == "FLASH_ATTN"


def test_a_prefill_backend_that_cannot_share_the_cache_is_refused_saying_what_to_change(doubles):
    from cpattn.cluster.service import check_backend

    pages = service_config(block_size=32, backend="PAGES16_BASE2", prefill_backend="PAGES32")
    with pytest.raises(BackendUnavailableError, match="prefill_backend PAGES32 cannot share backend PAGES16_BASE2's "
                                                      "paged KV cache: set prefill_backend to same or auto") as exc:
        check_backend(pages)
    assert exc.value.reasons["PAGES32"] == ["no kernel page size divides block_size 32 and suits both it ([32]) and "
                                            "PAGES16_BASE2 ([16])"]
    layout = service_config(prefill_backend="PAGES_FIRST")
    with pytest.raises(BackendUnavailableError, match="prefill_backend PAGES_FIRST cannot share backend TORCH's") as exc:
        check_backend(layout)
    assert exc.value.reasons["PAGES_FIRST"] == ["its KV cache layout (3, 2, 4, 2, 8) differs from TORCH's "
                                                "(2, 3, 4, 2, 8) (for 3 pages)"]


def test_an_explicit_prefill_backend_that_cannot_serve_the_settings_fails_with_every_reason():
    from cpattn.cluster.service import check_backend

    fp8 = gpu_config(backend="TORCH", prefill_backend="FLASH_ATTN", kv_cache_dtype="fp8_e4m3", sliding_window=64,
                     dtype="float32")
    with pytest.raises(BackendUnavailableError, match="attention backend FLASH_ATTN cannot serve") as exc:
        check_backend(fp8)
    reasons = exc.value.reasons["FLASH_ATTN"]
    assert not any("fp8" in r for r in reasons)          # FLASH_ATTN reads fp8 pages dequantised
    assert not any("sliding_window is not served" in r for r in reasons)   # windowed layers on TRITON's kernels
    assert any("dtype float32 not supported" in r for r in reasons)
    with pytest.raises(BackendUnavailableError, match="attention backend FLASH_ATTN cannot serve"):
        check_backend(service_config(prefill_backend="FLASH_ATTN"))   # on the CPU: every reason, platform too


def test_start_refuses_an_incompatible_pair_before_anything_starts(doubles, nothing_may_start):
    with pytest.raises(BackendUnavailableError, match="prefill_backend PAGES32 cannot share backend PAGES16_BASE2"):
        cpattn.start(service_config(block_size=32, backend="PAGES16_BASE2", prefill_backend="PAGES32"))


def test_prefill_backend_must_be_a_name():
    with pytest.raises(ConfigError, match="prefill_backend 'flash-attn!' is not a backend name: use same, auto, TORCH"):
        service_config(prefill_backend="flash-attn!")


def test_the_service_runs_prefill_steps_on_the_prefill_backend(ray_session, clean_backend_registry):
    """Decode on TORCH, prefill on a backend that returns natural-log LSEs but declares base 2: its partials merge
    wrongly (tests/test_reliability_regressions.py), so prefill steps come out wrong and decode steps exact, on
    every shard the service runs; info() and stats() name both backends."""
    from service_oracle import Oracle, checked_step

    from tests.reliability_plugins import PLUGINS

    register_backend("RELIA_MISLABELLED", PLUGINS["RELIA_MISLABELLED"], device_type="cpu")
    svc = cpattn.start(service_config(prefill_backend="RELIA_MISLABELLED"))
    try:
        shards = svc.info()["shards"]
        assert {(s["backend"], s["prefill_backend"]) for s in shards} == {("TORCH", "RELIA_MISLABELLED")}
        assert svc.stats()["prefill_backend"] == "RELIA_MISLABELLED"
        oracle = Oracle(svc.config, 7)
        a, b = svc.add_sequence(), svc.add_sequence()
        errors = {}
        for request in ({a: 12, b: 7}, {a: 1, b: 1}, {a: 1, b: 6}, {a: 1, b: 1}):
            kind = "prefill" if max(request.values()) > 1 else "decode"
            err = checked_step(svc, oracle, request, tol=math.inf)[1]
            errors[kind] = max(errors.get(kind, 0.0), err)
    finally:
        svc.shutdown()
    assert errors["decode"] <= 1e-10 and errors["prefill"] > 1e-2, errors


interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                               reason="TRITON on the CPU: TRITON_INTERPRET=1 with triton installed, no CUDA")


@interpret
@pytest.mark.parametrize("decode_name, prefill_name", [("TRITON", "TORCH"), ("TORCH", "TRITON")])
def test_triton_and_torch_paired_in_the_interpreter(decode_name, prefill_name):
    """float16 activations (the interpreter has no bf16 dot): within 3e-3 (absolute, out and LSE) of float64."""
    pytest.importorskip("triton")
    from cpattn.attention.registry import load_backend_class

    cfg = shard_config(2, 1, 32, HQ, HK, D, torch.float16, num_blocks=8)
    decode, prefill = load_backend_class(decode_name), load_backend_class(prefill_name)
    shards = _pair_shards(cfg, decode, prefill, torch.float16, seed=5)
    ran = _run_steps(shards, torch.float16, seed=6, tol=3e-3)
    assert ran == [{prefill_name if kind == "prefill" else decode_name} for _, kind in STEPS]
