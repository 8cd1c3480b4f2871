"""Base-aware merge of partial attention states by log-sum-exp; sinks; rows merged across shards.

Legend: N partials, T tokens, H heads, D head size.
For partials (o_n, l_n) over disjoint key sets, with l_n natural-log LSEs:
    m = max_n l_n,  w_n = exp(l_n - m),  o = sum_n w_n o_n / sum_n w_n,  l = m + log(sum_n w_n).
A partial with l_n = -inf holds no keys and contributes nothing; a row with only such partials
gives o = 0, l = -inf (never NaN). Subtracting m keeps large LSE gaps exact (see the online-softmax
update in FlashAttention / ring attention).
"""

from __future__ import annotations

import math
import os

import torch

from cpattn.attention.ops.lse import LseBase, to_natural_lse
from cpattn.attention.ops.partials import stack_partials
from cpattn.errors import InvalidRequestError


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
    outs, lses = stack_partials(outs_NTHD, lses_NTH, "merge_attn_states")
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


def merge_partials(outs_NTHD: torch.Tensor | list[torch.Tensor], lses_NTH: torch.Tensor | list[torch.Tensor],
                   lse_base: LseBase = LseBase.E) -> tuple[torch.Tensor, torch.Tensor]:
    """The service's merge: the Triton kernel for CUDA 16/32-bit tensors (and under Triton's interpreter, so CPU
    tests run the GPU's path), ``merge_attn_states`` otherwise."""
    first = outs_NTHD[0] if isinstance(outs_NTHD, (list, tuple)) else outs_NTHD
    if (first.is_cuda or _interpreting()) and first.dtype in (torch.float16, torch.bfloat16, torch.float32) and _triton_available():
        # The kernel module sits beside this floor and imports only from it (ops.lse, errors).
        from cpattn.attention.merge_triton import merge_attn_states_triton

        return merge_attn_states_triton(outs_NTHD, lses_NTH, lse_base)
    return merge_attn_states(outs_NTHD, lses_NTH, lse_base)


def merge_into_rows(out_TQD: torch.Tensor, lse_TQ: torch.Tensor, rows_R: torch.Tensor, outs_NRQD: torch.Tensor,
                    lses_NRQ: torch.Tensor, lse_base: LseBase = LseBase.E) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partials of R rows into rows ``rows_R`` (distinct) of ``out_TQD`` / ``lse_TQ`` (natural log), which
    hold one more partial over other keys; in place, and returns them. ``lse_base``: the N partials' base. On a GPU
    one launch (merge_triton.merge_into_rows_triton) where gather, stack, merge and scatter took ~8."""
    if (out_TQD.is_cuda or _interpreting()) and out_TQD.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and lse_TQ.dtype == torch.float32 and _triton_available():
        from cpattn.attention.merge_triton import merge_into_rows_triton

        merge_into_rows_triton(outs_NRQD, lses_NRQ, out_TQD, lse_TQ, rows_R, lse_base)
        return out_TQD, lse_TQ
    outs, lses = stack_partials(outs_NRQD, lses_NRQ, "merge_into_rows")
    o_dtype, l_dtype = torch.promote_types(out_TQD.dtype, outs.dtype), torch.promote_types(lse_TQ.dtype, lses.dtype)
    merged, merged_lse = merge_attn_states(
        torch.cat([out_TQD.index_select(0, rows_R)[None].to(o_dtype), outs.to(o_dtype)]),
        torch.cat([lse_TQ.index_select(0, rows_R)[None].to(l_dtype), to_natural_lse(lses.to(l_dtype), lse_base)]))
    out_TQD.index_copy_(0, rows_R, merged.to(out_TQD.dtype))
    lse_TQ.index_copy_(0, rows_R, merged_lse.to(lse_TQ.dtype))
    return out_TQD, lse_TQ


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def merge_rows(parts: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]], num_tokens: int,
               sinks_Q: torch.Tensor | None = None, disjoint: bool = False) -> torch.Tensor:
    """Merge partials that each cover some rows (None = all) into out [T, Q, D]; every row is in one or more.
    Sink logits (``sinks_Q``), when given, enter the merged state once. ``disjoint``: every row is in exactly one
    part (a prefill split across shards), so the merge is a scatter: merging with only -inf partials would give
    each row its one partial unchanged, at the cost of N full-size copies and a pass over them."""
    if sinks_Q is not None:
        return apply_sinks(*_merge_rows_lse(parts, num_tokens, disjoint), sinks_Q)[0]
    return _merge_rows_lse(parts, num_tokens, disjoint)[0]


def _merge_rows_lse(parts, num_tokens: int, disjoint: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1], parts[0][2]
    if disjoint:
        _, first, first_lse = parts[0]
        out = first.new_empty((num_tokens,) + tuple(first.shape[1:]))
        lse = first_lse.new_empty((num_tokens,) + tuple(first_lse.shape[1:]))
        for rows, part_out, part_lse in parts:
            out.index_copy_(0, rows, part_out.to(out.dtype))
            lse.index_copy_(0, rows, part_lse.to(lse.dtype))
        return out, lse
    _, first, first_lse = parts[0]
    if all(rows is None for rows, _, _ in parts):
        return merge_partials(torch.stack([o for _, o, _ in parts]), torch.stack([l for _, _, l in parts]))
    outs_NTQD = first.new_zeros((len(parts), num_tokens) + tuple(first.shape[1:]))
    lses_NTQ = first_lse.new_full((len(parts), num_tokens) + tuple(first_lse.shape[1:]), float("-inf"))
    for n, (rows, out, lse) in enumerate(parts):
        if rows is None:
            outs_NTQD[n], lses_NTQ[n] = out, lse
        else:
            outs_NTQD[n].index_copy_(0, rows, out)
            lses_NTQ[n].index_copy_(0, rows, lse)
    return merge_partials(outs_NTQD, lses_NTQ)
