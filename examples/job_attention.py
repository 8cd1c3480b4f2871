"""The attention function examples/long_context_job.py registers with transformers, and what it learns of a model's
attention layers before the service starts: each layer's sliding window, logit soft cap, softmax scale and sinks.

Mistral (a window on every layer), Gemma 2 (every other layer windowed, soft caps, query_pre_attn_scalar), Qwen2
with windows and gpt-oss (windows and sinks) pass these to the attention function as keywords. The job asks the
model once (``probe_layers``: one token's forward with a recording function) and starts its service with the same
per-layer windows and caps; every call then checks that what the layer asks is what the service serves, so a
model never runs silently on another attention than its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ATTN_IMPLEMENTATION = "cpattn"
PROBE_IMPLEMENTATION = "cpattn_probe"


@dataclass(frozen=True)
class LayerAttention:
    """Per attention layer, in order: sliding window (None: full), soft cap (None: none), the softmax scale the
    layer uses, whether it has sinks (gpt-oss's s_aux), and why cpattn cannot serve it (empty: it can)."""

    windows: list[int | None]
    soft_caps: list[float | None]
    scales: list[float]
    sinks: list[bool]
    problems: list[str]

    def service_fields(self) -> dict:
        """ServiceConfig's sliding_window and logits_soft_cap: one value when every layer has it, else per layer."""
        return {"sliding_window": one_or_per_layer(self.windows), "logits_soft_cap": one_or_per_layer(self.soft_caps)}

    def describe(self) -> dict:
        return {"windows": one_or_per_layer(self.windows), "soft_caps": one_or_per_layer(self.soft_caps),
                "scales": one_or_per_layer(self.scales), "sinks": any(self.sinks)}

    def summary(self) -> str:
        """One line for the job's log: what is not plain full attention."""
        parts = []
        windowed = [w for w in self.windows if w is not None]
        if windowed:
            parts.append(f"windows {sorted(set(windowed))} on {len(windowed)} of {len(self.windows)} layers")
        if any(c is not None for c in self.soft_caps):
            parts.append(f"soft cap {sorted({c for c in self.soft_caps if c is not None})}")
        if any(self.sinks):
            parts.append("sinks")
        return ", ".join(parts) or "full attention on every layer"


def one_or_per_layer(values: list):
    return values[0] if len(set(values)) == 1 else list(values)


def probe_layers(model) -> LayerAttention:
    """What every attention layer of ``model`` passes its attention function, from one token's forward through a
    recording function (returns zeros; the model's outputs are discarded). Refuses a model whose forward does not
    reach an attention function once per layer in order (its layers are not the Llama-family layout)."""
    from transformers import AttentionInterface

    seen: dict[int, dict] = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, t, d = query.shape
        seen[module.layer_idx] = {
            "window": kwargs.get("sliding_window"), "softcap": kwargs.get("softcap") or None,
            "scale": float(scaling) if scaling is not None else d ** -0.5,
            "sinks": kwargs.get("s_aux") is not None,
            "causal": getattr(module, "is_causal", True)}
        return query.new_zeros(b, t, hq, d), None

    AttentionInterface.register(PROBE_IMPLEMENTATION, record)
    previous = model.config._attn_implementation
    model.set_attn_implementation(PROBE_IMPLEMENTATION)
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    layers = model.config.num_hidden_layers
    if sorted(seen) != list(range(layers)):
        raise SystemExit(f"cpattn cannot run this model: its forward called attention for layers {sorted(seen)}, "
                         f"not once for each of its {layers} layers (model layer i must be cpattn layer i)")
    calls = [seen[i] for i in range(layers)]
    problems = [f"layer {i} is not causal (an encoder's attention): cpattn serves causal decoders"
                for i, c in enumerate(calls) if not c["causal"]]
    return LayerAttention([c["window"] for c in calls], [c["softcap"] for c in calls], [c["scale"] for c in calls],
                          [c["sinks"] for c in calls], problems)


class StepAttention:
    """The attention function transformers calls per layer; it forwards to the open cpattn step.

    transformers passes query [B, Hq, T, D] and key/value [B, Hk, T, D] of the forward's new tokens
    (no transformers cache: cpattn holds the history). Batch row b is cpattn sequence b of the step, so
    the tokens in request order are row-major (b, t). Returns [B, T, Hq, D] as eager attention does.
    A layer's own scale is kept by scaling q (cpattn scales by head_size ** -0.5); its window and soft cap must be
    the service's for that layer (``expect``); its sinks travel with the call.
    """

    def __init__(self):
        self.step = None
        self.capture_layer: int | None = None   # --oracle-check: keep this layer's q and output of decode steps
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self.windows: list[int | None] | None = None   # the service's, per layer (expect)
        self.soft_caps: list[float | None] | None = None

    def expect(self, service_config) -> None:
        """The windows and soft caps the service serves: a layer asking for others is refused, not run."""
        self.windows, self.soft_caps = service_config.layer_windows(), service_config.layer_soft_caps()

    def _check_layer(self, layer: int, window, softcap) -> None:
        if self.windows is None:
            return
        served_window, served_cap = self.windows[layer], self.soft_caps[layer]
        softcap = softcap or None
        same_cap = (softcap is None) == (served_cap is None) and (
            softcap is None or math.isclose(softcap, served_cap, rel_tol=1e-6))
        if window != served_window or not same_cap:
            raise ValueError(f"layer {layer} asks for sliding_window={window}, softcap={softcap}; the service serves "
                             f"sliding_window={served_window}, logits_soft_cap={served_cap} on that layer: let the job "
                             "start its own service (it reads both from the model), or serve one with the model's "
                             "per-layer sliding_window and logits_soft_cap")

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if self.step is None:
            raise RuntimeError("cpattn attention called outside a cpattn step: run the model through CpattnLM")
        layer = module.layer_idx
        if dropout:
            raise ValueError("cpattn attention is inference-only: put the model in eval() mode (dropout 0)")
        self._check_layer(layer, kwargs.get("sliding_window"), kwargs.get("softcap"))
        b, hq, t, d = query.shape
        q = query.transpose(1, 2).reshape(b * t, hq, d)
        if scaling is not None and abs(scaling - d ** -0.5) > 1e-9 * d ** -0.5:
            q = q * (scaling * d ** 0.5)   # (q * s * sqrt(d)) . k / sqrt(d) = s * (q . k): the layer's own scale
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)
        sinks = kwargs.get("s_aux")
        out = self.step.attend(layer, q.contiguous(), k.contiguous(), v.contiguous(),
                               **({"sinks": sinks} if sinks is not None else {}))
        if t == 1 and layer == self.capture_layer:
            self.captured = (q.clone(), out.clone())
        return out.view(b, t, hq, d), None


ATTENTION = StepAttention()
