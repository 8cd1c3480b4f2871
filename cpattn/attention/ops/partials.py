"""The shape contract of partial attention states, checked by every merge (torch and Triton).

Legend: N partials, T tokens, H heads, D head size.
"""

from __future__ import annotations

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
