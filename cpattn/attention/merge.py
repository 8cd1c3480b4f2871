"""Base-aware merge of partial attention states by log-sum-exp.

Legend: N partials, T tokens, H heads, D head size.
For partials (o_n, l_n) over disjoint key sets, with l_n natural-log LSEs:
    m = max_n l_n,  w_n = exp(l_n - m),  o = sum_n w_n o_n / sum_n w_n,  l = m + log(sum_n w_n).
A partial with l_n = -inf holds no keys and contributes nothing; a row with only such partials
gives o = 0, l = -inf (never NaN). Subtracting m keeps large LSE gaps exact (see the online-softmax
update in FlashAttention / ring attention).
"""

from __future__ import annotations

import enum
import math

import torch

from cpattn.errors import InvalidRequestError


class LseBase(enum.Enum):
    """Logarithm base a kernel reports its LSE in."""

    E = "e"      # FlashAttention, torch: log(sum exp(s))
    TWO = "2"    # FlashInfer: log2(sum 2^(s * log2 e))

    @property
    def to_natural(self) -> float:
        return 1.0 if self is LseBase.E else math.log(2.0)


def to_natural_lse(lse: torch.Tensor, base: LseBase) -> torch.Tensor:
    """The one place LSE bases are converted: base-b LSE -> natural log (-inf stays -inf)."""
    if not isinstance(base, LseBase):
        raise InvalidRequestError(f"lse_base must be an LseBase (E or TWO), got {base!r}")
    return lse if base is LseBase.E else lse * base.to_natural


def merge_attn_states(outs_NTHD: torch.Tensor | list[torch.Tensor], lses_NTH: torch.Tensor | list[torch.Tensor],
                      lse_base: LseBase = LseBase.E) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial outputs into one.

    Args:
        outs_NTHD: [N, T, H, D] partial outputs (or a list of [T, H, D]).
        lses_NTH: [N, T, H] their LSEs in ``lse_base`` (or a list of [T, H]).
        lse_base: base of ``lses_NTH``; the result's LSE is always natural log.
    Returns:
        out [T, H, D] in the dtype of ``outs`` and lse [T, H] natural log; computed in float32
        (float64 when the inputs are float64).
    """
    outs = torch.stack(list(outs_NTHD)) if isinstance(outs_NTHD, (list, tuple)) else outs_NTHD
    lses = torch.stack(list(lses_NTH)) if isinstance(lses_NTH, (list, tuple)) else lses_NTH
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[:3] != lses.shape:
        raise InvalidRequestError(
            f"merge_attn_states needs outs [N,T,H,D] and lses [N,T,H] with matching N,T,H; "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}")
    if outs.shape[0] == 0:
        raise InvalidRequestError("merge_attn_states needs at least one partial (N >= 1)")
    compute = torch.float64 if outs.dtype == torch.float64 or lses.dtype == torch.float64 else torch.float32
    lse = to_natural_lse(lses.to(compute), lse_base)
    lse_max = lse.amax(dim=0)
    empty = torch.isneginf(lse_max)
    safe_max = torch.where(empty, torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse - safe_max)                     # -inf -> 0
    total = weights.sum(dim=0)
    # where(): a partial with weight 0 contributes exactly 0 even if its output holds NaN/inf.
    weighted = torch.where(weights[..., None] > 0, outs.to(compute) * weights[..., None], 0.0).sum(dim=0)
    out = torch.where(empty[..., None], torch.zeros_like(weighted), weighted / torch.where(empty, 1.0, total)[..., None])
    lse_out = torch.where(empty, torch.full_like(lse_max, -math.inf), safe_max + torch.log(torch.where(empty, 1.0, total)))
    return out.to(outs.dtype), lse_out


def apply_sinks(out_TQD: torch.Tensor, lse_TQ: torch.Tensor, sinks_Q: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add learned attention-sink logits (gpt-oss style) to a *fully merged* attention state.

    A sink is one more logit per head in the softmax denominator with no value: with natural-log lse
    over all keys, lse' = log(exp(lse) + exp(sink)) and out' = out * exp(lse - lse'). Applied once,
    after every partial is merged, so the sink enters the LSE exactly once whatever the number of
    shards (adding it to each shard's partial would count it N times). A row with no key (lse -inf)
    gets out 0 and lse = sink. Returns (out in out's dtype, lse natural log).
    """
    if sinks_Q is None:
        return out_TQD, lse_TQ
    if sinks_Q.dim() != 1 or sinks_Q.shape[0] != out_TQD.shape[1]:
        raise InvalidRequestError(f"sinks must be [num_q_heads={out_TQD.shape[1]}], got {tuple(sinks_Q.shape)}")
    compute = torch.float64 if lse_TQ.dtype == torch.float64 or out_TQD.dtype == torch.float64 else torch.float32
    lse = lse_TQ.to(compute)
    new_lse = torch.logaddexp(lse, sinks_Q.to(lse.device, compute)[None, :])
    keep = torch.exp(lse - new_lse)                                   # exp(-inf) = 0 for an empty row
    return (out_TQD.to(compute) * keep[..., None]).to(out_TQD.dtype), new_lse
