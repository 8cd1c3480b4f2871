"""get_attn_backend: explicit choice validates and fails with every reason; auto takes the first valid.

Explicit never silently swaps: a user who pinned FLASHINFER gets FLASHINFER or an error listing why
not. Results are cached on a key holding every factor that changes the answer, including the
registry generation so a plugin registered later is seen.
"""

from __future__ import annotations

import functools
import logging

import torch

from cpattn.attention.backend import DTYPE_NAMES, AttentionBackend, AttentionSelectorConfig
from cpattn.attention.registry import PRIORITY, load_backend_class, registry_generation
from cpattn.errors import BackendUnavailableError

logger = logging.getLogger("cpattn.attention")


def get_attn_backend(backend: str = "auto", *, head_size: int, dtype: torch.dtype | str, block_size: int,
                     num_q_heads: int, num_kv_heads: int, kv_cache_dtype: str = "auto",
                     device: str | torch.device = "cpu", needs_lse: bool = True,
                     use_pcp: bool = False, sliding_window: bool = False,
                     logits_soft_cap: bool = False) -> type[AttentionBackend]:
    """Return the backend class to use; raises BackendUnavailableError (with ``.reasons``)."""
    dev = torch.device(device)
    capability = None
    if dev.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(dev)
    config = AttentionSelectorConfig(
        head_size=head_size, dtype=DTYPE_NAMES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else dtype,
        kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, device_type=dev.type, device_capability=capability,
        needs_lse=needs_lse, use_pcp=use_pcp, sliding_window=bool(sliding_window),
        logits_soft_cap=bool(logits_soft_cap))
    return _cached_get_attn_backend(backend.upper() if backend != "auto" else "auto", config, registry_generation())


def clear_selector_cache() -> None:
    _cached_get_attn_backend.cache_clear()


@functools.lru_cache(maxsize=256)
def _cached_get_attn_backend(backend: str, config: AttentionSelectorConfig,
                             generation: int) -> type[AttentionBackend]:
    if backend != "auto":
        cls = load_backend_class(backend)
        reasons = cls.validate(config)
        if reasons:
            raise BackendUnavailableError(
                f"attention backend {backend} cannot serve {_describe(config)}; fix the configuration or "
                f"choose another backend (auto picks the first valid one)", {backend: reasons})
        _log_choice(cls, config, explicit=True)
        return cls
    rejected: dict[str, list[str]] = {}
    for name in PRIORITY.get(config.device_type, ["TORCH"]):
        try:
            cls = load_backend_class(name)
        except BackendUnavailableError as exc:
            rejected.update(exc.reasons)
            continue
        reasons = cls.validate(config)
        if not reasons:
            _log_choice(cls, config, explicit=False)
            return cls
        rejected[name] = reasons
    raise BackendUnavailableError(f"no attention backend can serve {_describe(config)}", rejected)


def _describe(config: AttentionSelectorConfig) -> str:
    return (f"head_size={config.head_size} dtype={config.dtype} kv_cache_dtype={config.kv_cache_dtype} "
            f"block_size={config.block_size} heads={config.num_q_heads}/{config.num_kv_heads} "
            f"device={config.device_type}"
            + (" sliding_window" if config.sliding_window else "")
            + (" logits_soft_cap" if config.logits_soft_cap else ""))


def _log_choice(cls: type[AttentionBackend], config: AttentionSelectorConfig, explicit: bool) -> None:
    how = "explicit" if explicit else "auto"
    logger.info("attention backend %s (%s, %s) for %s", cls.get_name(), cls.kernel_version(), how, _describe(config))
