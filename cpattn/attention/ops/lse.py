"""Log-sum-exp bases: what each kernel reports, and the one conversion to natural log.

Every partial crosses a merge in natural log; a backend declares its base (``lse_base``) and its LSE is
converted here, nowhere else (FlashInfer reports log2, FlashAttention / Triton / torch natural log).
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


def check_lse_base(base) -> LseBase:
    if not isinstance(base, LseBase):
        raise InvalidRequestError(f"lse_base must be an LseBase (E or TWO), got {base!r}")
    return base


def to_natural_lse(lse: torch.Tensor, base: LseBase) -> torch.Tensor:
    """The one place LSE bases are converted: base-b LSE -> natural log (-inf stays -inf)."""
    check_lse_base(base)
    return lse if base is LseBase.E else lse * base.to_natural
