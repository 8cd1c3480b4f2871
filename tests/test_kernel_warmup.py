"""A shard's kernels run once at start on a scratch cache (cluster/kernel_warmup.py): every kind of step, short and
long, one layer of each (window, soft cap) variant, each prefill on the prefill backend; once per process; a kernel that fails or
gives non-finite output fails the start with the backend, the step and the layer named; FlashInfer's modules are
compiled side by side first, every one a step can plan. (GPU: the first step after a start does not compile,
tests/gpu/test_kernel_warmup_gpu.py.)"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchReferenceBackend
from cpattn.cluster import kernel_warmup
from cpattn.cluster.kernel_warmup import warm_up_kernels
from cpattn.config import ServiceConfig
from cpattn.errors import ServiceError
from tests.test_flashinfer_plumbing import _Wrapper, flashinfer_model  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
CALLS: list[tuple] = []


class RecordingImpl(TorchAttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        CALLS.append((self.backend_name, "forward", layer, q_TQD.shape[0]))
        return super().forward(layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=kv_scale)

    def forward_new_tokens(self, q_TQD, k_TKD, v_TKD, pieces_P3, layer=0):
        CALLS.append((self.backend_name, "new_tokens", layer, q_TQD.shape[0]))
        return super().forward_new_tokens(q_TQD, k_TKD, v_TKD, pieces_P3, layer)

    def forward_causal_pieces(self, q_RQD, k_SKD, v_SKD, pieces_P4, layer=0):
        CALLS.append((self.backend_name, "causal_pieces", layer, q_RQD.shape[0]))
        return super().forward_causal_pieces(q_RQD, k_SKD, v_SKD, pieces_P4, layer)


class DecodeImpl(RecordingImpl):
    backend_name = "DECODE"


class PrefillImpl(RecordingImpl):
    backend_name = "PREFILL"


class DecodeBackend(TorchReferenceBackend):
    name, impl_cls = "WARM_DECODE", DecodeImpl


class PrefillBackend(TorchReferenceBackend):
    name, impl_cls = "WARM_PREFILL", PrefillImpl


class FailingImpl(TorchAttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        raise RuntimeError("no kernel image is available for execution on the device")


class NanImpl(TorchAttentionImpl):
    def forward(self, layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=None):
        out, lse = super().forward(layer, q_TQD, k_TKD, v_TKD, kv_cache, attn_metadata, kv_scale=kv_scale)
        return out * float("nan"), lse


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_warmup, "_warmed", set())
    CALLS.clear()


def _config(**kw) -> ServiceConfig:
    base = dict(num_shards=3, num_layers=5, num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                dtype="float32", num_blocks_per_shard=64, pcp_min_tokens=1)
    return ServiceConfig(**{**base, **kw})


def test_every_kind_of_step_runs_once_per_layer_variant_prefills_on_the_prefill_backend():
    # Variants (window, cap): layer 0 and 4 (None, None), 1 (8, None), 2 and 3 (8, 30.0): layers 0, 1, 2 run.
    cfg = _config(sliding_window=[None, 8, 8, 8, None], logits_soft_cap=[None, None, 30.0, 30.0, None])
    seconds = warm_up_kernels(cfg, DecodeBackend, PrefillBackend, torch.device("cpu"))
    assert seconds > 0
    short, long = 2 * cfg.block_size, kernel_warmup.LONG_CHUNK
    layers = (0, 1, 2)
    expected = ([("PREFILL", "causal_pieces", layer, t) for t in (short, long) for layer in layers]   # from empty
                + [("PREFILL", kind, layer, t) for t in (short, long) for layer in layers          # chunked
                   for kind in ("forward", "new_tokens")]
                + [("DECODE", "forward", layer, t) for t in (1, 2) for layer in layers])           # one, two
    assert CALLS == expected
    # Once per process for the same kernels; another shape is warmed again.
    assert warm_up_kernels(cfg, DecodeBackend, PrefillBackend, torch.device("cpu")) == 0.0 and len(CALLS) == 24
    assert warm_up_kernels(cfg.model_copy(update=dict(head_size=16)), DecodeBackend, PrefillBackend,
                           torch.device("cpu")) > 0


@pytest.mark.parametrize("kv_cache_dtype, kv_scales", [("fp8_e4m3", None), ("fp8_e5m2", [[[0.5, 0.5]] * 2] * 5)])
def test_fp8_caches_with_dynamic_and_static_scales_warm_up(kv_cache_dtype, kv_scales):
    cfg = _config(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, sliding_window=16)
    assert warm_up_kernels(cfg, DecodeBackend, DecodeBackend, torch.device("cpu")) > 0
    assert {c[1] for c in CALLS} == {"causal_pieces", "forward", "new_tokens"} and {c[2] for c in CALLS} == {0}


def test_one_backend_serves_both_kinds_when_no_prefill_backend_is_set():
    warm_up_kernels(_config(), DecodeBackend, None, torch.device("cpu"))
    assert {c[0] for c in CALLS} == {"DECODE"} and len(CALLS) == 8


@pytest.mark.parametrize("impl, match", [
    (FailingImpl, r"shard 2: the WARM_FAIL kernel's first run on cpu \(chunked prefill, layer 0\) failed: "
                  r"RuntimeError: no kernel image"),
    (NanImpl, r"shard 2: the WARM_FAIL kernel's first run on cpu \(chunked prefill, layer 0\) gave non-finite")])
def test_a_kernel_that_fails_or_gives_nan_fails_the_start_naming_backend_step_and_layer(impl, match):
    broken = type("BrokenBackend", (TorchReferenceBackend,), {"name": "WARM_FAIL", "impl_cls": impl})
    with pytest.raises(ServiceError, match=match):
        warm_up_kernels(_config(), broken, None, torch.device("cpu"), who="shard 2")
    assert not kernel_warmup._warmed   # not remembered: a retry runs it again


# FlashInfer's modules, compiled side by side before the warm-up's steps (kernel_warmup._compile_side_by_side and
# FlashInferMetadataBuilder.jit_variants), on the float64 model of its wrappers (tests/test_flashinfer_plumbing.py).
# What decides a module: the wrapper, q and KV dtypes, head size, soft cap, window on or off, custom mask or not.


@pytest.fixture
def planned_modules(flashinfer_model, monkeypatch):
    """Every plan's module as (thread kind, wrapper, q dtype, kv dtype, head size, cap, window on, masked)."""
    seen = []
    plan = _Wrapper._plan

    def recording(self, *args, **kw):
        ahead = threading.current_thread().name.startswith("cpattn-jit")
        seen.append(("ahead" if ahead else "step", type(self).__name__, kw["q_data_type"], kw["kv_data_type"],
                     args[6], kw.get("logits_soft_cap"), kw.get("window_left", -1) >= 0,
                     kw.get("packed_custom_mask") is not None))
        return plan(self, *args, **kw)

    monkeypatch.setattr(_Wrapper, "_plan", recording)
    monkeypatch.setattr(kernel_warmup, "COMPILE_WORKERS", 4)
    return flashinfer_model, seen


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_flashinfer_modules_are_compiled_ahead_and_are_every_module_the_steps_plan(planned_modules, kv_cache_dtype):
    backend, seen = planned_modules
    # Layers: full; a window with a cap; the window alone; full with the cap (Gemma 2's mix, and more).
    cfg = _config(num_layers=4, sliding_window=[None, 40, 40, None], logits_soft_cap=[None, 30.0, None, 30.0],
                  kv_cache_dtype=kv_cache_dtype, block_size=16)
    warm_up_kernels(cfg, backend, backend, torch.device("cpu"))
    ahead = [m[1:] for m in seen if m[0] == "ahead"]
    steps = {m[1:] for m in seen if m[0] == "step"}
    assert len(ahead) == len(set(ahead)), "a module compiled ahead twice"
    assert steps <= set(ahead), f"planned by a step, not compiled ahead: {steps - set(ahead)}"
    f32 = torch.float32   # a cache in fp8 is read dequantised: the plans' kv dtype is q's
    expected = {("_Decode", f32, f32, 8, cap, on, False) for cap in (None, 30.0) for on in (False, True)}
    expected |= {("_Prefill", f32, f32, 8, cap, on, False) for cap in (None, 30.0) for on in (False, True)}
    expected |= {("_Prefill", f32, f32, 8, cap, False, True) for cap in (None, 30.0)}   # masked: windowed layers
    assert set(ahead) == expected
    # What the scratch's steps (one shard) plan, less the masked prefills: only a DCP shard's chunks plan those.
    assert steps == {m for m in expected if not m[-1]}


def test_a_flashinfer_decode_beside_another_prefill_backend_compiles_decodes_only(planned_modules):
    backend, seen = planned_modules
    cfg = _config(num_layers=2, sliding_window=[None, 40], block_size=16)
    warm_up_kernels(cfg, backend, PrefillBackend, torch.device("cpu"))
    ahead = {m[1:] for m in seen if m[0] == "ahead"}
    assert ahead == {("_Decode", torch.float32, torch.float32, 8, None, on, False) for on in (False, True)}
    assert {m[1:] for m in seen if m[0] == "step"} <= ahead


def test_one_shard_compiles_no_masked_prefill(planned_modules):
    """A custom mask is planned only for a DCP shard's chunk under a window: a one-shard service never builds it."""
    backend, seen = planned_modules
    warm_up_kernels(_config(num_shards=1, num_layers=2, sliding_window=[None, 40], block_size=16), backend, backend,
                    torch.device("cpu"))
    ahead = {m[1:] for m in seen if m[0] == "ahead"}
    assert len(ahead) == 4 and not any(m[-1] for m in ahead)


def test_variants_compile_at_once_and_one_that_fails_is_logged_not_raised(planned_modules, monkeypatch, caplog):
    """The calls run side by side (each waits for the others at a barrier); a failed one leaves the warm-up's steps
    to plan that variant again (here they succeed), with a warning saying so."""
    backend, _ = planned_modules
    barrier = threading.Barrier(3, timeout=30)

    def variants(self, prefill=True, sharded=True):
        def fails():
            barrier.wait()
            raise RuntimeError("nvcc: out of memory")
        return [barrier.wait, barrier.wait, fails]

    monkeypatch.setattr(backend.get_builder_cls(), "jit_variants", variants)
    with caplog.at_level(logging.INFO, logger="cpattn"):
        assert warm_up_kernels(_config(num_layers=1, block_size=16), backend, backend, torch.device("cpu")) > 0
    assert "compiling a kernel variant ahead failed (the warm-up's steps try it again): RuntimeError: nvcc: out " \
           "of memory" in caplog.text and "2 kernel variants compiled side by side" in caplog.text


def test_the_jit_ahead_benchmark_runs_as_printed_on_a_model(planned_modules, tmp_path, monkeypatch):
    """benchmarks/flashinfer_jit_ahead.py (timed on the GPU) on the CPU model: a script broken here would cost a
    device session's minutes."""
    import runpy

    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))   # the script sets it; restored after
    script = runpy.run_path(str(ROOT / "benchmarks" / "flashinfer_jit_ahead.py"))
    result = script["main"](["--device", "cpu", "--workers", "2", "--shards", "2", "--jit-dir", str(tmp_path),
                             "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == result and result["workers"] == 2
    assert any("5 kernel variants compiled side by side" in message for message, _ in result["log"]), result
