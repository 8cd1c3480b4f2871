"""The models examples/long_context_job.py runs: a tiny random Llama (the CPU default and the CI test), a
Llama-3-8B-shaped random Llama built directly on the GPU (the GPU default), or local weights (``--model DIR``)."""

from __future__ import annotations

import torch

TINY = "tiny"
LLAMA3_8B = "llama3-8b"
MISTRAL_7B = "mistral-7b"
BUILT_IN = (None, TINY, LLAMA3_8B, MISTRAL_7B)   # --model names that are not a directory (random weights)
# Positions the Llama-3-8B shape accepts: 2M, so a 1M-token prompt plus its decode fits (RoPE is computed per
# forward for the positions it gets, so this costs nothing).
LLAMA3_MAX_POSITIONS = 2**21


def tiny_llama_config(num_layers: int = 2, vocab_size: int = 256, max_positions: int = 32768):
    """A small random Llama: 4 query heads, 2 KV heads (GQA), head size 16; nothing is downloaded."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=False)


def llama3_8b_config(num_layers: int = 32, max_positions: int = LLAMA3_MAX_POSITIONS):
    """Meta-Llama-3-8B's shape (its config.json): 32 layers, 32 query heads, 8 KV heads, head 128, hidden 4096,
    MLP 14336, vocab 128256, RoPE theta 500000; ``num_layers`` fewer for quick checks."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=max_positions, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)


def mistral_7b_config(num_layers: int = 32, max_positions: int = LLAMA3_MAX_POSITIONS):
    """Mistral-7B-v0.1's shape (its config.json): Llama-3-8B's layers (32 x 32 query / 8 KV heads of 128, hidden
    4096, MLP 14336) with a 4,096-token sliding window on every layer, vocab 32000, RoPE theta 10000: a model whose
    every layer reads at most 4,096 keys however long the context."""
    from transformers import MistralConfig

    return MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                         max_position_embeddings=max_positions, rope_theta=10000.0, rms_norm_eps=1e-5,
                         sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def rope_theta(config) -> float | dict[str, float] | None:
    """RoPE base of a config, wherever this transformers version keeps it (rope_theta, or rope_parameters in 5.x);
    per layer type where the model has several (Gemma 3: {"sliding_attention": 1e4, "full_attention": 1e6})."""
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    per_type = {kind: float(p["rope_theta"]) for kind, p in params.items() if isinstance(p, dict) and "rope_theta" in p}
    return per_type or None


def random_model(config, seed: int, dtype: torch.dtype, device: torch.device | str, attn: str = "eager"):
    """A randomly initialised causal LM of the config's class built where it will run: under
    ``torch.device(device)`` every parameter is allocated and initialised on that device in ``dtype`` (an 8B model
    on the GPU takes a second; nothing passes through the host). The same seed on the same device kind gives the
    same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)   # seeds the CPU and every CUDA device
    with torch.device(device):   # the config's own class (LlamaForCausalLM, MistralForCausalLM)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    where = {p.device.type for p in model.parameters()}
    if where != {torch.device(device).type}:   # a transformers version that builds elsewhere first: move it
        model.to(device)
    return model.eval()


def build_model(model_path: str | None = None, seed: int = 0, num_layers: int | None = 2, dtype: str = "float32",
                device: str | torch.device = "cpu", attn: str = "eager"):
    """``model_path``: None or "tiny" (the tiny random Llama), "llama3-8b" or "mistral-7b" (their shapes, random
    weights) or a local Hugging Face directory (no downloads). ``num_layers`` None keeps the model's own depth."""
    torch_dtype = getattr(torch, dtype)
    if model_path in (None, TINY):
        return random_model(tiny_llama_config(num_layers or 2), seed, torch_dtype, device, attn)
    if model_path == LLAMA3_8B:
        return random_model(llama3_8b_config(num_layers or 32), seed, torch_dtype, device, attn)
    if model_path == MISTRAL_7B:
        return random_model(mistral_7b_config(num_layers or 32), seed, torch_dtype, device, attn)
    from transformers import AutoModelForCausalLM

    extra = {"num_hidden_layers": num_layers} if num_layers else {}
    # device_map loads the weights straight onto the GPU but needs accelerate (not a dependency of cpattn):
    # without it the weights are read into host memory and moved.
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:
        extra["device_map"] = str(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation=attn,
                                                     local_files_only=True, **extra)
    except ValueError as exc:   # e.g. Gemma 2: transformers runs its soft caps in eager attention only
        if attn == "sdpa" and "scaled_dot_product_attention" in str(exc):
            raise NoSdpaError(f"{model_path}: transformers has no SDPA attention for this model "
                              f"({str(exc).split(' does not support')[0]})") from exc
        raise
    return model.to(device).eval()


class NoSdpaError(ValueError):
    """transformers offers no SDPA attention for this model (only eager and its own kernels)."""


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model_config, kv_itemsize: int) -> int:
    """KV bytes one token takes over all layers (K and V)."""
    head = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return model_config.num_hidden_layers * 2 * model_config.num_key_value_heads * head * kv_itemsize


def describe(model, name: str) -> dict:
    """The model's shape for the JSON report."""
    c = model.config
    return {"name": name, "layers": c.num_hidden_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size,
            "q_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "vocab": c.vocab_size, "rope_theta": rope_theta(c), "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}

