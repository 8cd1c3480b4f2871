"""Attention backends: torch_ref (the oracle), flashinfer, flash_attn, triton_attn; GPU ones import lazily."""
