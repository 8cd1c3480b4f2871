"""The configuration users write: ``ServiceConfig``, loadable from YAML, validated at construction.

Every invalid value is rejected with the field, the value and the fix, e.g.
``num_q_heads 12 is not a multiple of num_kv_heads 8: pick num_kv_heads dividing 12``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError, field_validator, model_validator

from cpattn.config_groups import (AttentionFeatures, ClientLimits, KVCacheSize, ModelGeometry, Placement,
                                  Reliability, StepExecution)
from cpattn.errors import ConfigError

DTYPES = ("float16", "bfloat16", "float32", "float64")
BACKENDS = ("auto", "TORCH", "FLASHINFER", "FLASH_ATTN", "TRITON")

# A window wider than this is no window (int32 kernel arguments): use None for full attention.
MAX_SLIDING_WINDOW = 2**31 - 1
# The coordinator's bookkeeping: 8 bytes per KV page per shard (block_pool), 16 per sequence row per shard
# (block_table); a config implying more than this would exhaust the coordinator's process before it served.
COORDINATOR_BOOKKEEPING_BYTES = 4 * 2**30
BYTES_PER_BLOCK_ENTRY = 8
BYTES_PER_ROW_ENTRY = 16
# KV one shard may be asked to hold: more than any single device or host has (a larger value fails deep in
# a shard's constructor as an opaque ActorDiedError).
MAX_KV_BYTES_PER_SHARD = 4 * 2**40


# The groups last first: pydantic orders inherited fields by reversed MRO, so the fields read in GROUPS' order.
class ServiceConfig(AttentionFeatures, ClientLimits, Reliability, StepExecution, Placement, KVCacheSize,
                    ModelGeometry):
    """One cpattn service: how many shards, the model's attention geometry, and how to run it.

    Its fields are declared in groups (cpattn/config_groups.py); here are the checks across them and the
    values derived from them."""

    def __init__(self, **data: Any):
        # Raise our own ConfigError (a ValueError too) so callers catch one hierarchy.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None

    @field_validator("shard_resources", "shard_label_selector", "coordinator_resources", "coordinator_label_selector",
                     mode="before")
    @classmethod
    def _mapping_from_json(cls, value: Any) -> Any:
        """A mapping given as a string (a `cpattn serve --shard-resources '{"cpattn_shard": 1}'` flag) is JSON."""
        if isinstance(value, str):
            import json

            try:
                return json.loads(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a JSON mapping: write e.g. '{{\"cpattn_shard\": 1}}'") from None
        return value

    @field_validator("backend", "prefill_backend", mode="before")
    @classmethod
    def _keyword_any_case(cls, value: Any) -> Any:
        """`--backend torch` worked but AUTO / SAME did not: the keywords match in any case, as the names do."""
        return value.lower() if isinstance(value, str) and value.lower() in ("auto", "same") else value

    @field_validator("sliding_window", "logits_soft_cap", "kv_scales", mode="before")
    @classmethod
    def _list_from_json(cls, value: Any) -> Any:
        """A per-layer list given as a flag (`--sliding-window '[4096, null]'`) is JSON; `none` / `null` is None."""
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        if isinstance(value, str) and value.lstrip().startswith("["):
            import json

            try:
                return json.loads(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a JSON list: write e.g. '[4096, null]' (null for a layer "
                                 "without it)") from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        """pydantic takes True for 1 in an int or float field (num_shards: true started one shard): refused,
        inside lists and mappings too; strings still convert (CLI flags and YAML give "4")."""
        if isinstance(data, dict):
            for name, value in data.items():
                info = cls.model_fields.get(name)
                if info is not None and _takes_numbers(info.annotation) and _holds_bool(value):
                    raise ValueError(f"{name}={value!r}: {name} takes numbers, not true/false (a bool is not "
                                     "read as 1 or 0 here): give the number itself")
        return data

    @model_validator(mode="after")
    def _check_geometry(self) -> "ServiceConfig":
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}: "
                f"pick num_kv_heads dividing {self.num_q_heads} (GQA groups must be equal)")
        from cpattn.attention.ops.head_size import HEAD_SIZE_RULE, head_size_ok

        if not head_size_ok(self.head_size):
            raise ValueError(f"head_size {self.head_size} must be {HEAD_SIZE_RULE}: use e.g. 64, 128 or 256")
        if self.block_size % self.dcp_interleave:
            raise ValueError(
                f"block_size {self.block_size} is not a multiple of dcp_interleave {self.dcp_interleave}: "
                f"use a dcp_interleave dividing {self.block_size} (1 or {self.block_size})")
        if self.backend != "auto" and not self.backend.replace("_", "").isalnum():
            raise ValueError(f"backend {self.backend!r} is not a backend name: use one of {', '.join(BACKENDS)}")
        if not self.prefill_backend.replace("_", "").isalnum():
            raise ValueError(f"prefill_backend {self.prefill_backend!r} is not a backend name: use same, "
                             f"{', '.join(BACKENDS)}")
        for name in ("sliding_window", "logits_soft_cap"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers: give one per "
                                 "layer (None for a layer without it) or a single value for every layer")
        for layer, w in enumerate(self.layer_windows()):   # (num_layers is bounded: these lists stay small)
            if w is not None and not 1 <= w <= MAX_SLIDING_WINDOW:
                raise ValueError(f"sliding_window {w} of layer {layer} must be in 1..{MAX_SLIDING_WINDOW} (None "
                                 "disables the window: full attention)")
        for layer, cap in enumerate(self.layer_soft_caps()):
            if cap is not None and not (cap > 0 and math.isfinite(cap)):
                raise ValueError(f"logits_soft_cap {cap} of layer {layer} must be finite and > 0 (None disables "
                                 "the cap)")
        self._check_sizes()
        if self.kv_scales is not None:
            if self.kv_cache_dtype == "auto":
                raise ValueError("kv_scales are fp8 scales: set kv_cache_dtype to fp8_e4m3 or fp8_e5m2, "
                                 "or drop kv_scales")
            shape_ok = (len(self.kv_scales) == self.num_layers
                        and all(len(kv) == 2 and all(len(h) == self.num_kv_heads for h in kv) for kv in self.kv_scales))
            if not shape_ok:
                raise ValueError(f"kv_scales must be [num_layers={self.num_layers}][2][num_kv_heads="
                                 f"{self.num_kv_heads}] (one K and one V scale per layer and kv head)")
            if not all(x > 0 and x < float("inf") for kv in self.kv_scales for h in kv for x in h):
                raise ValueError("kv_scales must all be finite and > 0")
        self._check_placement()
        if self.kv_replicas > self.num_shards:
            raise ValueError(
                f"kv_replicas {self.kv_replicas} needs at least as many shards, num_shards is {self.num_shards}: "
                "raise num_shards or set kv_replicas 1")
        return self

    def _check_sizes(self) -> None:
        """What num_blocks_per_shard, kv_cache_bytes_per_shard and max_sequences imply in memory."""
        blocks = self.blocks_per_shard()
        kv_bytes = blocks * self.bytes_per_block()
        if self.num_blocks_per_shard is None and self.kv_cache_bytes_per_shard < self.bytes_per_block():
            raise ValueError(
                f"kv_cache_bytes_per_shard {self.kv_cache_bytes_per_shard} holds no KV page: one page of "
                f"{self.block_size} tokens over {self.num_layers} layers takes {self.bytes_per_block()} bytes: "
                "raise kv_cache_bytes_per_shard, or set num_blocks_per_shard")
        if kv_bytes > MAX_KV_BYTES_PER_SHARD:
            raise ValueError(
                f"num_blocks_per_shard {blocks} means {kv_bytes / 2**30:.4g} GiB of KV cache per shard "
                f"({self.bytes_per_block()} bytes per block), more than any device holds (at most "
                f"{MAX_KV_BYTES_PER_SHARD // 2**40} TiB): lower num_blocks_per_shard or kv_cache_bytes_per_shard")
        block_bytes = self.num_shards * blocks * BYTES_PER_BLOCK_ENTRY
        row_bytes = self.num_shards * self.max_sequences * self.kv_replicas * BYTES_PER_ROW_ENTRY
        if block_bytes + row_bytes > COORDINATOR_BOOKKEEPING_BYTES:
            field = "num_blocks_per_shard" if block_bytes >= row_bytes else "max_sequences"
            value = blocks if field == "num_blocks_per_shard" else self.max_sequences
            raise ValueError(
                f"{field} {value} over {self.num_shards} shards needs {(block_bytes + row_bytes) / 2**30:.4g} GiB of "
                f"bookkeeping in the coordinator ({BYTES_PER_BLOCK_ENTRY} bytes per block and "
                f"{BYTES_PER_ROW_ENTRY} per sequence slot, per shard), more than the "
                f"{COORDINATOR_BOOKKEEPING_BYTES // 2**30} GiB it may use: lower {field}")

    def _check_placement(self) -> None:
        """Placement and data-plane binding fields (issue 21)."""
        name = self.data_plane_interface
        if name is not None and not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", name):
            raise ValueError(f"data_plane_interface {name!r} is not a network interface name (1-15 characters, e.g. "
                             "eth1 or ens5; `ip -br addr` lists them): name one, or leave it unset to use the node IP")
        for field_name in ("shard_resources", "coordinator_resources"):
            for key, amount in getattr(self, field_name).items():
                if key in ("CPU", "GPU", "memory") or not key:
                    raise ValueError(f"{field_name} {key!r}: CPU and GPU come from num_cpus_per_shard / "
                                     "num_gpus_per_shard; name custom resources here (ray start --resources)")
                if not 0 < amount < float("inf"):
                    raise ValueError(f"{field_name}[{key!r}] = {amount} must be > 0 (a resource amount)")
        for field_name in ("shard_label_selector", "coordinator_label_selector"):
            for key, value in getattr(self, field_name).items():
                if not key or not value:
                    raise ValueError(f"{field_name} {key!r}: {value!r}: keys and values must be non-empty label "
                                     "strings, as given to `ray start --labels key=value`")

    # Derived values -------------------------------------------------------------------------------
    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def layer_windows(self) -> list[int | None]:
        """sliding_window of every layer (None = full attention)."""
        w = self.sliding_window
        return list(w) if isinstance(w, list) else [w] * self.num_layers

    def row_window(self) -> int | None:
        """The largest window when every layer has one, else None: a shard holding no key of a query within it
        computes and sends no row for that query (cluster/step_planner.computed_rows)."""
        windows = self.layer_windows()
        return None if not windows or any(w is None for w in windows) else max(windows)

    def layer_soft_caps(self) -> list[float | None]:
        """logits_soft_cap of every layer (None = no cap)."""
        c = self.logits_soft_cap
        return list(c) if isinstance(c, list) else [c] * self.num_layers

    @property
    def kv_cache_format(self) -> str:
        """The cache element type by name: the activation dtype, fp8_e4m3 or fp8_e5m2 (alias fp8 resolved)."""
        if self.kv_cache_dtype == "auto":
            return self.dtype
        return "fp8_e4m3" if self.kv_cache_dtype == "fp8" else self.kv_cache_dtype

    def backend_features(self) -> dict:
        """What beyond geometry and dtype the attention backend must serve (get_attn_backend keywords)."""
        return {"kv_cache_dtype": "auto" if self.kv_cache_dtype == "auto" else self.kv_cache_format,
                "sliding_window": any(w is not None for w in self.layer_windows()),
                "logits_soft_cap": any(c is not None for c in self.layer_soft_caps())}

    def bytes_per_block(self) -> int:
        """Bytes of one KV page across all layers (K and V); fp8 caches hold one byte per element
        (their per-page scales, 8 bytes per layer and kv head, 4 / (block_size * head_size) of the page, are not
        counted)."""
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "fp8_e4m3": 1,
                    "fp8_e5m2": 1}[self.kv_cache_format]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def blocks_per_shard(self) -> int:
        if self.num_blocks_per_shard is not None:
            return self.num_blocks_per_shard
        return max(1, self.kv_cache_bytes_per_shard // self.bytes_per_block())

    def in_process_refusal(self) -> str | None:
        """Why no client may open a shard's cache in its own process (local_shards), or None when it may. The
        coordinator (begin_step's local_ranks) and the shards (export_kv) enforce it, not only the client: a
        client that opened a shard's cache holds every tenant's KV on that shard."""
        if self.local_shards == "off":
            return "the service runs with local_shards='off' (every shard over the wire)"
        if self.detached:
            return ("the service is detached: its coordinator may restart mid-step, and only the shards can fence "
                    "a previous incarnation's writes")
        if self.resolved_device().split(":")[0] != "cuda":
            return f"the shards keep their KV on {self.resolved_device()}: only CUDA caches can be opened by a client"
        return None

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if self.num_gpus_per_shard > 0 else "cpu"


def _takes_numbers(annotation: Any) -> bool:
    """int or float anywhere in a field's type (int | None, list[int | None], dict[str, float], ...)."""
    import typing

    return annotation in (int, float) or any(map(_takes_numbers, typing.get_args(annotation)))


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_holds_bool, value))
    return isinstance(value, dict) and any(map(_holds_bool, value.values()))


# The most values a real file holds: kv_scales of 4,096 layers x K and V x 128 KV heads, with room to spare.
MAX_FILE_VALUES = 1 << 21


def load_config(path: str | Path, **overrides: Any) -> ServiceConfig:
    """Load a ServiceConfig from YAML; keyword overrides (e.g. CLI flags) win over file values."""
    import yaml

    if not isinstance(path, (str, Path)):
        raise ConfigError(f"config path {path!r} must be a str or pathlib.Path naming a YAML file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                          "give a YAML file") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {str(path)!r} does not exist: check the path (e.g. "
                          "examples/service_local.yaml, relative to the current directory)") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(_describe_yaml_error(path, exc)) from exc
    except RecursionError:   # PyYAML builds nested values recursively
        raise ConfigError(f"{path}: values nested too deeply for YAML to read (a ServiceConfig nests three "
                          "levels at most, kv_scales): fix the brackets") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of ServiceConfig fields, got {type(data).__name__}")
    if (size := _expanded_size(data, {})) > MAX_FILE_VALUES:   # before pydantic walks (and copies) every one
        raise ConfigError(f"{path}: the file expands to {size:,} values (through YAML anchors and aliases, *name), "
                          f"more than any ServiceConfig holds ({MAX_FILE_VALUES:,}): write each list out once")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{path}: key {odd[0]!r} is not a ServiceConfig field name: keys are names such as "
                          "num_shards")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServiceConfig(**data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _expanded_size(value: Any, seen: dict[int, int]) -> int:
    """Values in ``value`` with every alias expanded. YAML aliases share one object, so counting each object once
    (``seen``: id -> size) takes time in the file's size, while the expansion can be exponential in it."""
    if not isinstance(value, (list, dict)):
        return 1
    if id(value) not in seen:
        items = value.values() if isinstance(value, dict) else value
        seen[id(value)] = 1 + sum(_expanded_size(item, seen) for item in items)
    return seen[id(value)]


def _describe(exc: ValidationError) -> str:
    parts, seen = [], set()
    for err in exc.errors():
        loc = err.get("loc", ())
        # A union field reports each branch (sliding_window.int, sliding_window.list[...]): one line per field.
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("int", "float", "str"))))
        field = ".".join(str(p) for p in loc) or "config"
        if field in seen:
            continue
        seen.add(field)
        msg = err.get("msg", "").removeprefix("Value error, ")
        if err.get("type") == "finite_number":
            msg += " (inf and nan cannot work here): give a finite value"
        value = err.get("input")
        if err.get("type") == "extra_forbidden":
            valid = ", ".join(ServiceConfig.model_fields)
            parts.append(f"unknown field {field!r}: valid fields are {valid}")
        elif isinstance(value, dict) and field == "config":   # a check across fields: its message names them
            parts.append(msg)
        else:
            shown = repr(value)
            shown = shown if len(shown) <= 120 else shown[:100] + f"... ({len(shown):,} characters)"
            parts.append(f"{field}={shown}: {msg}")
    return "; ".join(parts)


def _describe_yaml_error(path: str | Path, exc: Exception) -> str:
    """``file, line L, column C: problem: fix the YAML syntax`` (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    return f"{where}: invalid YAML, {what}: fix the syntax there (a mapping of ServiceConfig fields, e.g. num_shards: 4)"
