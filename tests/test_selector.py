"""get_attn_backend: explicit choices fail with every reason, auto order per device, cache key, plugins."""

import dataclasses
import importlib.util
import logging
import pickle

import pytest
import torch

from cpattn.attention import AttentionBackend, AttentionSelectorConfig, get_attn_backend, register_backend
from cpattn.attention import registry
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.attention.selector import clear_selector_cache
from cpattn.errors import BackendUnavailableError, ConfigError

BASE = dict(head_size=128, dtype=torch.float32, block_size=16, num_q_heads=8, num_kv_heads=2)


class CudaOnlyPluginBackend(AttentionBackend):
    """Declares CUDA, float16 and head sizes 64/128 only, and says its package is missing."""

    name = "CUDA_ONLY_PLUGIN"
    supported_dtypes = ("float16",)
    supported_head_sizes = (64, 128)
    supported_devices = ("cuda",)

    @classmethod
    def availability(cls, config):
        return ["import of fancy_kernels failed: No module named 'fancy_kernels'"]


class PickyPluginBackend(AttentionBackend):
    """Accepts exactly one configuration (set by the test), rejects everything else."""

    name = "PICKY_PLUGIN"
    supported_dtypes = ("float16", "bfloat16", "float32", "float64")
    supported_devices = ("cpu", "cuda")
    accepted: AttentionSelectorConfig | None = None

    @classmethod
    def validate(cls, config):
        return [] if config == cls.accepted else [f"only serves {cls.accepted}"]


class AnyPluginBackend(PickyPluginBackend):
    name = "ANY_PLUGIN"

    @classmethod
    def validate(cls, config):
        return []


def _path(cls):
    return f"{__name__}:{cls.__name__}"


@pytest.fixture(autouse=True)
def clean_registry(clean_backend_registry):
    """Registration is process-global: every test here gets the registry restored afterwards."""


def test_explicit_torch_on_cpu_and_cuda():
    assert get_attn_backend("TORCH", **BASE) is TorchReferenceBackend
    assert get_attn_backend("torch", **BASE, device="cuda") is TorchReferenceBackend
    assert get_attn_backend("TORCH", **{**BASE, "head_size": 100}) is TorchReferenceBackend   # any head size


def test_explicit_invalid_choice_lists_every_reason():
    register_backend("CUDA_ONLY_PLUGIN", _path(CudaOnlyPluginBackend))
    with pytest.raises(BackendUnavailableError, match="CUDA_ONLY_PLUGIN cannot serve") as info:
        get_attn_backend("CUDA_ONLY_PLUGIN", **{**BASE, "head_size": 96})
    reasons = info.value.reasons["CUDA_ONLY_PLUGIN"]
    expected = ["device cpu not supported", "dtype float32 not supported", "head_size 96 not supported",
                "import of fancy_kernels failed"]
    assert len(reasons) == len(expected)
    for fragment, reason in zip(expected, reasons):
        assert fragment in reason
    for fragment in expected:
        assert fragment in str(info.value)          # the message shows every reason too
    # It never silently swaps to another backend.
    assert set(info.value.reasons) == {"CUDA_ONLY_PLUGIN"}


def test_explicit_flashinfer_on_cpu_fails_with_reasons():
    with pytest.raises(BackendUnavailableError) as info:
        get_attn_backend("FLASHINFER", **BASE, device="cpu")
    reasons = info.value.reasons["FLASHINFER"]
    assert reasons
    module_present = importlib.util.find_spec("cpattn.attention.backends.flashinfer") is not None
    package_present = importlib.util.find_spec("flashinfer") is not None
    if module_present:
        assert any("device cpu" in r for r in reasons), reasons
    if not package_present:
        assert any("flashinfer" in r.lower() and ("import" in r.lower() or "install" in r.lower())
                   for r in reasons), reasons


def test_auto_order_per_device():
    assert get_attn_backend("auto", **BASE, device="cpu") is TorchReferenceBackend
    # On cuda, auto walks FLASHINFER, TRITON, FLASH_ATTN, TORCH; here the GPU ones are rejected.
    got = get_attn_backend("auto", **BASE, device="cuda")
    first_valid = None
    for name in registry.PRIORITY["cuda"]:
        try:
            cls = registry.load_backend_class(name)
        except BackendUnavailableError:
            continue
        cfg = AttentionSelectorConfig(head_size=128, dtype="float32", kv_cache_dtype="auto", block_size=16,
                                      num_q_heads=8, num_kv_heads=2, device_type="cuda",
                                      device_capability=torch.cuda.get_device_capability()
                                      if torch.cuda.is_available() else None)
        if not cls.validate(cfg):
            first_valid = cls
            break
    assert got is first_valid
    # A valid plugin placed first wins; a rejecting plugin first is skipped.
    PickyPluginBackend.accepted = None
    register_backend("PICKY_PLUGIN", _path(PickyPluginBackend), priority=0, device_type="cpu")
    assert get_attn_backend("auto", **BASE, device="cpu") is TorchReferenceBackend
    register_backend("ANY_PLUGIN", _path(AnyPluginBackend), priority=0, device_type="cpu")
    assert registry.PRIORITY["cpu"][:2] == ["ANY_PLUGIN", "PICKY_PLUGIN"]
    assert get_attn_backend("auto", **BASE, device="cpu") is AnyPluginBackend


def test_auto_with_nothing_valid_reports_every_candidate():
    with pytest.raises(BackendUnavailableError, match="no attention backend") as info:
        get_attn_backend("auto", **{**BASE, "dtype": "int8"}, device="cuda")
    assert set(info.value.reasons) == set(registry.PRIORITY["cuda"])
    assert any("dtype int8" in r for r in info.value.reasons["TORCH"])


def test_unknown_backend_lists_valid_names():
    with pytest.raises(BackendUnavailableError, match="unknown attention backend 'NOPE'") as info:
        get_attn_backend("NOPE", **BASE)
    for name in ("TORCH", "FLASHINFER", "FLASH_ATTN", "TRITON"):
        assert name in str(info.value)
    assert "NOPE" in info.value.reasons


def test_register_backend_invalidates_cached_results():
    assert get_attn_backend("auto", **BASE) is TorchReferenceBackend            # now cached
    register_backend("ANY_PLUGIN", _path(AnyPluginBackend), priority=0, device_type="cpu")
    assert get_attn_backend("auto", **BASE) is AnyPluginBackend
    assert get_attn_backend("TORCH", **BASE) is TorchReferenceBackend           # cached
    register_backend("TORCH", _path(AnyPluginBackend))                         # override a built-in
    assert get_attn_backend("TORCH", **BASE) is AnyPluginBackend


def test_register_backend_bad_path():
    with pytest.raises(ConfigError, match="class_path 'no_colon_here'"):
        register_backend("X", "no_colon_here")


# Every field of AttentionSelectorConfig, and how to change it through get_attn_backend.
FIELD_CHANGES = {
    "head_size": dict(head_size=64),
    "dtype": dict(dtype=torch.float64),
    "kv_cache_dtype": dict(kv_cache_dtype="fp8"),
    "block_size": dict(block_size=32),
    "num_q_heads": dict(num_q_heads=16),
    "num_kv_heads": dict(num_kv_heads=4),
    "device_type": dict(device="cpu"),
    "device_capability": dict(capability=(8, 0)),
    "needs_lse": dict(needs_lse=False),
    "use_pcp": dict(use_pcp=True),
    "sliding_window": dict(sliding_window=True),
    "logits_soft_cap": dict(logits_soft_cap=True),
}


def test_cache_key_holds_every_field(monkeypatch):
    """PICKY accepts only the base configuration; changing any one field must change the answer.

    If a field were missing from the cache key, the cached PICKY answer would come back.
    """
    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(AttentionSelectorConfig)}
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    base = dict(BASE, device="cuda", kv_cache_dtype="auto", needs_lse=True, use_pcp=False)
    PickyPluginBackend.accepted = AttentionSelectorConfig(
        head_size=128, dtype="float32", kv_cache_dtype="auto", block_size=16, num_q_heads=8, num_kv_heads=2,
        device_type="cuda", device_capability=(9, 0), needs_lse=True, use_pcp=False)
    register_backend("PICKY_PLUGIN", _path(PickyPluginBackend))
    assert get_attn_backend("PICKY_PLUGIN", **base) is PickyPluginBackend          # cached now
    for field, change in FIELD_CHANGES.items():
        kwargs = dict(base)
        if "capability" in change:
            capability["value"] = change["capability"]
        else:
            kwargs.update(change)
        with pytest.raises(BackendUnavailableError, match="only serves"):
            get_attn_backend("PICKY_PLUGIN", **kwargs)
        capability["value"] = (9, 0)
        assert get_attn_backend("PICKY_PLUGIN", **base) is PickyPluginBackend, field


def test_selector_logs_the_chosen_backend_and_kernel_version(caplog):
    with caplog.at_level(logging.INFO, logger="cpattn.attention"):
        get_attn_backend("auto", **BASE)
    messages = [r.getMessage() for r in caplog.records]
    assert any("TORCH" in m and f"torch {torch.__version__}" in m and "auto" in m for m in messages), messages


def test_backend_unavailable_error_pickles_with_reasons():
    err = BackendUnavailableError("nope", {"FLASHINFER": ["device cpu not supported", "import failed"]})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is BackendUnavailableError
    assert back.reasons == err.reasons and str(back) == str(err)
