"""The baseline of examples/long_context_job.py (``--attn sdpa``): the same model with transformers' own SDPA
attention and its own DynamicCache on one device, run the same way (chunked prefill, greedy decode)."""

from __future__ import annotations

import inspect

import torch

# Tokens of random KV written per cache update by fill_random: bounds the transient copy (DynamicCache
# concatenates on every update) to one slice of one layer.
RANDOM_FILL_SLICE = 65536


class SdpaLM:
    """Same interface as CpattnLM (``forward``, ``position``, ``free``): the KV lives in a transformers
    DynamicCache on the model's device, attention is torch's scaled_dot_product_attention."""

    def __init__(self, model, batch: int, attn: str = "sdpa"):
        """``attn``: transformers' attention implementation (eager for a model with no SDPA, e.g. Gemma 2)."""
        from transformers import DynamicCache

        model.set_attn_implementation(attn)
        self.model = model
        self.device = next(model.parameters()).device
        self.batch = batch
        self.cache = DynamicCache()
        self.position = 0
        # transformers 5.2x renamed forward's past_key_values to cache (the old name warns); 5.17 has only the old
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last new token per row, [B, vocab]; the tokens' KV joins the cache (positions continue
        from the cache's length)."""
        out = self.model(input_ids=input_ids.to(self.device), use_cache=True, logits_to_keep=1,
                         **{self.cache_kwarg: self.cache})
        self.position += input_ids.shape[1]
        return out.logits[:, -1]

    @torch.no_grad()
    def fill_random(self, num_tokens: int, seed: int) -> None:
        """Random KV for the first ``num_tokens`` positions of every row (``--synthetic-prefix``): the cache then
        holds what a prefill of that length would, without its compute."""
        c = self.model.config
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for start in range(0, num_tokens, RANDOM_FILL_SLICE):
            n = min(RANDOM_FILL_SLICE, num_tokens - start)
            for layer in range(c.num_hidden_layers):
                k, v = torch.randn(2, self.batch, c.num_key_value_heads, n, head, generator=gen, device=self.device,
                                   dtype=dtype)
                self.cache.update(k, v, layer)
            self.position += n   # every layer holds these: running out of memory later reports the tokens held

    def kv_bytes(self) -> int:
        """Bytes the cache holds now (K and V of every layer)."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def free(self) -> None:
        self.cache = None
