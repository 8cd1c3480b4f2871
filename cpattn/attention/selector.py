"""Choosing a backend: explicit choice validates and fails with every reason; auto takes the first valid.

``select_backend(config, device)`` is the one choice the service makes (shards, the client opening a
shard's cache, the checks before anything starts); ``get_attn_backend`` is its keyword form.
``select_prefill_backend`` adds the backend of prefill steps beside it (``prefill_backend``), on the same cache.
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


# auto's prefill order (prefill_backend: auto), by causal-prefill speed on an H200 (benchmarks/RESULTS.md "Causal
# prefill": FA4 ~590 TFLOP/s, FlashInfer ~550, TRITON ~356); the decode backend ends the search, so a backend
# slower at prefill than it is never taken. CPU: TORCH is the only backend, decode and prefill alike.
PREFILL_PRIORITY = {"cuda": ["FLASH_ATTN", "FLASHINFER"], "cpu": []}
SAME = "same"


def select_prefill_backend(config, decode: type[AttentionBackend], device: str | torch.device | None = None, *,
                           prefill_backend: str | None = None, platform_here: bool = True) -> type[AttentionBackend]:
    """The backend of the config's prefill steps beside ``decode`` (select_backend's choice), sharing its cache.

    ``config.prefill_backend`` (or ``prefill_backend``, a client taking the name its shard chose): ``same`` is
    ``decode``; a name is validated as select_backend validates ``backend`` (every reason), then against
    ``decode``'s cache (``pair_reasons``): BackendUnavailableError saying what to change; ``auto`` takes the
    first of PREFILL_PRIORITY that passes both, else ``decode`` (auto never fails where decode serves).
    """
    name = prefill_backend or config.prefill_backend
    if name == SAME or name.upper() == decode.get_name():
        return decode
    if name != "auto":
        chosen = select_backend(config, device, backend=name, platform_here=platform_here)
        reasons = pair_reasons(config, decode, chosen)
        if reasons:
            raise BackendUnavailableError(
                f"prefill_backend {chosen.get_name()} cannot share backend {decode.get_name()}'s paged KV cache: set "
                f"prefill_backend to same or auto, or choose a backend (or block_size) both can use",
                {chosen.get_name(): reasons})
        return chosen
    device_type = torch.device(device or config.resolved_device()).type
    for candidate in PREFILL_PRIORITY.get(device_type, []):
        if candidate == decode.get_name():
            break
        try:
            chosen = select_backend(config, device, backend=candidate, platform_here=platform_here)
        except BackendUnavailableError:
            continue
        if config.backend_features()["sliding_window"] and not chosen.auto_prefill_with_windows:
            continue
        if not pair_reasons(config, decode, chosen):
            return chosen
    return decode


def pair_reasons(config, decode: type[AttentionBackend], prefill: type[AttentionBackend]) -> list[str]:
    """Why ``prefill`` cannot read and write the one paged KV cache a shard allocates for ``decode`` ([] when
    it can): the same cache layout, and one kernel page size both accept (the runner views the cache and
    expands block tables once per step for both). dtype, fp8, windows and soft caps are each backend's own
    validation against the config; LSEs are converted per backend (to_natural_lse), so bases may differ."""
    from cpattn.errors import InvalidRequestError
    from cpattn.kvstore import select_common_kernel_block_size

    reasons = []
    shape = (3, config.block_size, config.num_kv_heads, config.head_size)   # 3 pages: not confused with K/V's 2
    mine, theirs = prefill.get_kv_cache_shape(*shape), decode.get_kv_cache_shape(*shape)
    if tuple(mine) != tuple(theirs):
        reasons.append(f"its KV cache layout {tuple(mine)} differs from {decode.get_name()}'s {tuple(theirs)} "
                       "(for 3 pages)")
    try:
        select_common_kernel_block_size(config.block_size, [decode.get_supported_kernel_block_sizes(),
                                                            prefill.get_supported_kernel_block_sizes()])
    except InvalidRequestError:
        reasons.append(f"no kernel page size divides block_size {config.block_size} and suits both it "
                       f"({prefill.get_supported_kernel_block_sizes()}) and {decode.get_name()} "
                       f"({decode.get_supported_kernel_block_sizes()})")
    return reasons


def chosen_backend_class(name: str) -> type[AttentionBackend]:
    """The class of a backend a shard already chose (its info names it): to read what it declares (CUDA-graph
    support, hooks), never to choose one; choosing is select_backend's."""
    return load_backend_class(name)


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
