"""A shard's kernels run once at start on a scratch cache (cluster/kernel_warmup.py): every kind of step, short and
long, one layer of each (window, soft cap) variant, each prefill on the prefill backend; once per process; a kernel that fails or
gives non-finite output fails the start with the backend, the step and the layer named. (GPU: the first step
after a start does not compile, tests/gpu/test_kernel_warmup_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchReferenceBackend
from cpattn.cluster import kernel_warmup
from cpattn.cluster.kernel_warmup import warm_up_kernels
from cpattn.config import ServiceConfig
from cpattn.errors import ServiceError

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
