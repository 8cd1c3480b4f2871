"""Choosing a backend: explicit choice validates and fails with every reason; auto takes the first valid.

``select_backend(config, device)`` is the one choice the service makes (shards, the client opening a
shard's cache, the checks before anything starts); ``get_attn_backend`` is its keyword form.
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
                     logits_soft_cap: bool = False, platform_here: bool = True) -> type[AttentionBackend]:
    """Return the backend class to use; raises BackendUnavailableError (with ``.reasons``).

    ``platform_here=False`` judges only what backends declare against the settings, not this process's
    packages and devices (``availability``): for a process checking shards that will run elsewhere.
    """
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
    return _cached_get_attn_backend(backend.upper() if backend != "auto" else "auto", config, platform_here,
                                    registry_generation())


def select_backend(config, device: str | torch.device | None = None, *, backend: str | None = None,
                   platform_here: bool = True) -> type[AttentionBackend]:
    """The backend that serves a ServiceConfig on ``device`` (default the config's): the service's one choice.

    Every setting a backend must serve reaches ``validate``: geometry, dtype, the fp8 KV cache, sliding
    windows and logit soft caps (``config.backend_features()``). Sinks need no backend: they enter once,
    after the merge (``ops.merge.apply_sinks``). ``backend`` overrides ``config.backend`` (a client opening
    a shard's cache takes the name that shard chose).
    """
    return get_attn_backend(backend or config.backend, head_size=config.head_size, dtype=config.torch_dtype,
                            block_size=config.block_size, num_q_heads=config.num_q_heads,
                            num_kv_heads=config.num_kv_heads, device=device or config.resolved_device(),
                            platform_here=platform_here, **config.backend_features())


def clear_selector_cache() -> None:
    _cached_get_attn_backend.cache_clear()


@functools.lru_cache(maxsize=256)
def _cached_get_attn_backend(backend: str, config: AttentionSelectorConfig, platform_here: bool,
                             generation: int) -> type[AttentionBackend]:
    if backend != "auto":
        cls = load_backend_class(backend)
        reasons = _reasons(cls, config, platform_here)
        if reasons:
            raise BackendUnavailableError(
                f"attention backend {backend} cannot serve {_describe(config)}; fix the configuration or "
                f"choose another backend (auto picks the first valid one)", {backend: reasons})
        if platform_here:
            _log_choice(cls, config, explicit=True)
        return cls
    rejected: dict[str, list[str]] = {}
    for name in PRIORITY.get(config.device_type, ["TORCH"]):
        try:
            cls = load_backend_class(name)
        except BackendUnavailableError as exc:
            rejected.update(exc.reasons)
            continue
        reasons = _reasons(cls, config, platform_here)
        if not reasons:
            if platform_here:
                _log_choice(cls, config, explicit=False)
            return cls
        rejected[name] = reasons
    raise BackendUnavailableError(f"no attention backend can serve {_describe(config)}", rejected)


def _reasons(cls: type[AttentionBackend], config: AttentionSelectorConfig, platform_here: bool) -> list[str]:
    reasons = cls.validate(config)
    if platform_here:
        return reasons
    platform = set(cls.availability(config))
    return [r for r in reasons if r not in platform]


def _describe(config: AttentionSelectorConfig) -> str:
    return (f"head_size={config.head_size} dtype={config.dtype} kv_cache_dtype={config.kv_cache_dtype} "
            f"block_size={config.block_size} heads={config.num_q_heads}/{config.num_kv_heads} "
            f"device={config.device_type}"
            + (" sliding_window" if config.sliding_window else "")
            + (" logits_soft_cap" if config.logits_soft_cap else ""))


def _log_choice(cls: type[AttentionBackend], config: AttentionSelectorConfig, explicit: bool) -> None:
    how = "explicit" if explicit else "auto"
    logger.info("attention backend %s (%s, %s) for %s", cls.get_name(), cls.kernel_version(), how, _describe(config))
