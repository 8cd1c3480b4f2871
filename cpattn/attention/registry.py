"""Registry of attention backends: built-ins by enum, plugins by ``register_backend``.

Values are import paths so a backend module (and its GPU package) loads only when chosen.
"""

from __future__ import annotations

import enum
import importlib

from cpattn.errors import BackendUnavailableError, ConfigError


class AttentionBackendEnum(enum.Enum):
    TORCH = "cpattn.attention.backends.torch_ref:TorchReferenceBackend"
    FLASHINFER = "cpattn.attention.backends.flashinfer:FlashInferBackend"
    FLASH_ATTN = "cpattn.attention.backends.flash_attn:FlashAttentionBackend"
    TRITON = "cpattn.attention.backends.triton_attn:TritonAttentionBackend"


# Platform priority for auto selection: the fastest valid backend first (see benchmarks/RESULTS.md).
# CUDA, measured on an H200 (2026-11-29): TRITON has the fastest paged decode in every case (B=1 1M
# 1.08 ms vs FlashInfer 1.52 and FA4 13.6) and the DCP per-rank path; FlashInfer is close behind for
# short decodes and prefills at ~550 TFLOP/s; FlashAttention (FA4 on SM90) leads causal prefill
# (~590 TFLOP/s) but cannot split KV on SM90, so a single long decode is 12x slower.
PRIORITY = {
    "cuda": ["TRITON", "FLASHINFER", "FLASH_ATTN", "TORCH"],
    "cpu": ["TORCH"],
}

_paths: dict[str, str] = {m.name: m.value for m in AttentionBackendEnum}
_generation = 0   # bumped on every registration; part of the selector's cache key


def register_backend(name: str | AttentionBackendEnum, class_path: str, *, priority: int | None = None,
                     device_type: str = "cuda") -> None:
    """Register (or override) a backend by import path ``module:Class``.

    ``priority`` inserts the name into ``device_type``'s auto order at that index.
    """
    global _generation
    key = name.name if isinstance(name, AttentionBackendEnum) else str(name).upper()
    if ":" not in class_path:
        raise ConfigError(f"class_path {class_path!r} must look like 'package.module:ClassName'")
    _paths[key] = class_path
    if priority is not None:
        order = PRIORITY.setdefault(device_type, [])
        if key in order:
            order.remove(key)
        order.insert(priority, key)
    _generation += 1


def registry_generation() -> int:
    return _generation


def registry_state() -> dict:
    """This process's registrations (plugin paths, auto order), to replay where backends are selected.

    Shard actors run in other processes: a plugin registered by the caller exists there only if
    the service hands them this and they call ``apply_registry_state``.
    """
    builtin = {m.name: m.value for m in AttentionBackendEnum}
    return {"paths": {k: v for k, v in _paths.items() if builtin.get(k) != v},
            "priority": {device: list(order) for device, order in PRIORITY.items()}}


def apply_registry_state(state: dict) -> None:
    """Replay ``registry_state()`` of another process (plugins first, then the auto orders)."""
    global _generation
    _paths.update(state.get("paths", {}))
    for device, order in state.get("priority", {}).items():
        PRIORITY[device] = list(order)
    _generation += 1


def backend_names() -> list[str]:
    return list(_paths)


def load_backend_class(name: str):
    """Import and return the backend class registered under ``name``."""
    key = name.upper()
    if key not in _paths:
        raise BackendUnavailableError(
            f"unknown attention backend {name!r}: use auto or one of {', '.join(_paths)}",
            {name: ["not registered"]})
    module_name, _, cls_name = _paths[key].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {key} could not be imported",
                                      {key: [f"import of {module_name} failed: {exc}"]}) from exc
    return getattr(module, cls_name)
