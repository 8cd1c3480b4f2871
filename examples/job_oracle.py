"""``--oracle-check``: the last decode step's attention of layer 0, checked against float64 at full context length.

Layer 0's keys and values depend only on the token ids (embedding, input norm, k/v projections, RoPE), so they
can be recomputed here for the whole history, chunk by chunk, without running the model's other layers; the
query and output cpattn saw for the last decoded token are captured in StepAttention. The reference is exact
softmax attention in float64, streamed over key slices (memory bounded for a million keys). Models whose layer 0
is laid out as Llama's only (Llama, Mistral, Qwen2), windows and soft caps included."""

from __future__ import annotations

import torch

KEY_SLICE = 65536
# Relative L2 bounds of the output vs float64: a bf16 output rounds at 2**-8 (~4e-3) and the cache holds the
# model's bf16 K/V; an fp8 cache's context adds its format's error (README: e4m3 ~3e-2, e5m2 ~5e-2).
BOUNDS = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2, "fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}
# Model types whose layer 0 K/V are embed -> input norm -> k/v projections -> Llama's RoPE (layer0_kv); Gemma 2
# scales its embeddings, Qwen3 and Gemma 3 normalise q and k: their K/V would be recomputed wrongly here.
ORACLE_MODEL_TYPES = ("llama", "mistral", "qwen2")


def check_supported_for_oracle(model) -> None:
    """Refuses --oracle-check, before anything starts, for a model whose layer 0 this module cannot recompute."""
    kind = getattr(model.config, "model_type", None)
    if kind not in ORACLE_MODEL_TYPES:
        raise SystemExit(f"--oracle-check recomputes layer 0's K/V the Llama way ({', '.join(ORACLE_MODEL_TYPES)}); "
                         f"this model is {kind!r}: drop --oracle-check (--verify compares tokens with eager attention)")


@torch.no_grad()
def layer0_kv(model, ids: torch.Tensor, chunk: int, first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K (after RoPE) and V of layer 0 for ``ids`` [B, L] at positions first_position.. first_position + L - 1:
    [B, Hk, L, D] in the model's dtype."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    base = model.model
    layer = base.layers[0]
    attn = layer.self_attn
    device = next(model.parameters()).device
    keys, values = [], []
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start:start + chunk].to(device)
        b, t = part.shape
        h = layer.input_layernorm(base.embed_tokens(part))
        k = attn.k_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        positions = torch.arange(first_position + start, first_position + start + t, device=device).expand(b, t)
        cos, sin = base.rotary_emb(h, positions)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        keys.append(k)
        values.append(v)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


@torch.no_grad()
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of one query per row, q [B, Hq, D], over every key k/v [B, Hk, L, D] (the query is at the
    last position): float64 [B, Hq, D]. ``window`` W: only the last W keys; ``softcap`` c: scaled logits s become
    c * tanh(s / c)."""
    if window is not None:
        k, v = k[:, :, -window:], v[:, :, -window:]
    b, hq, d = q.shape
    group = hq // k.shape[1]
    q64 = q.double().view(b, k.shape[1], group, d) * d ** -0.5
    m = torch.full((b, k.shape[1], group, 1), -torch.inf, dtype=torch.float64, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(b, k.shape[1], group, d, dtype=torch.float64, device=q.device)
    for start in range(0, k.shape[2], KEY_SLICE):
        ks = k[:, :, start:start + KEY_SLICE].to(q.device, torch.float64)
        vs = v[:, :, start:start + KEY_SLICE].to(q.device, torch.float64)
        s = q64 @ ks.transpose(-1, -2)                               # [B, Hk, G, S]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        scale = torch.exp(m - m_new)
        denom = denom * scale + p.sum(-1, keepdim=True)
        acc = acc * scale + p @ vs
        m = m_new
    return (acc / denom).view(b, hq, d)


def check_layer0(model, history: torch.Tensor, q: torch.Tensor, out: torch.Tensor, chunk: int,
                 cache_format: str, layers=None) -> dict:
    """``history`` [B, L]: every token the last decode step's query saw (itself last); q/out [B, Hq, D] as attend
    got and returned them (q scaled to the layer's own scale); ``layers``: job_attention.probe_layers (window and
    soft cap of layer 0)."""
    window, softcap = (layers.windows[0], layers.soft_caps[0]) if layers is not None else (None, None)
    first = max(0, history.shape[1] - window) if window is not None else 0
    history = history[:, first:]   # a window's keys only, at their own positions
    k, v = layer0_kv(model, history, chunk, first_position=first)
    ref = reference_attention(q.view(history.shape[0], -1, q.shape[-1]), k, v, softcap=softcap)
    got = out.view_as(ref).double()
    rel = ((got - ref).norm() / ref.norm()).item()
    bound = BOUNDS.get(cache_format, 2e-2)
    return {"layer": 0, "keys": history.shape[1], "rel_err": rel, "bound": bound, "ok": rel <= bound}
