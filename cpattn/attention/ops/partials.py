"""The shape contract of partial attention states, checked by every merge (torch and Triton), and the state
of rows that attended nothing.

Legend: N partials, T tokens, H heads, D head size, P pieces.
"""

from __future__ import annotations

import math

import torch

from cpattn.errors import InvalidRequestError


def stack_partials(outs_NTHD: torch.Tensor | list[torch.Tensor], lses_NTH: torch.Tensor | list[torch.Tensor],
                   caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, T, H, D] and lses [N, T, H] from tensors or lists, checked before any merge reads them."""
    outs = torch.stack(list(outs_NTHD)) if isinstance(outs_NTHD, (list, tuple)) else outs_NTHD
    lses = torch.stack(list(lses_NTH)) if isinstance(lses_NTH, (list, tuple)) else lses_NTH
    if outs.dim() != 4 or lses.dim() != 3 or outs.shape[:3] != lses.shape:
        raise InvalidRequestError(
            f"{caller} needs outs [N,T,H,D] and lses [N,T,H] with matching N,T,H; "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}")
    if outs.shape[0] == 0:
        raise InvalidRequestError(f"{caller} needs at least one partial (N >= 1)")
    return outs, lses


def unattended_rows(q_TQD: torch.Tensor, pieces_P3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Attention among a step's new tokens by pieces (q_start, q_end, k_start) starts here: out 0 and LSE -inf
    (float32) on every row, which rows no piece covers keep; and the pieces that hold queries, as lists."""
    t, hq, d = q_TQD.shape
    out_TQD = torch.zeros(t, hq, d, dtype=q_TQD.dtype, device=q_TQD.device)
    lse_TQ = torch.full((t, hq), -math.inf, dtype=torch.float32, device=q_TQD.device)
    return out_TQD, lse_TQ, [p for p in pieces_P3.tolist() if p[1] > p[0]]
