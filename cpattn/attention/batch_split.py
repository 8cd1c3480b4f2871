"""Decode/prefill split of a batch: short queries (decodes) first, one permutation for everything.

FlashInfer-style builders run a decode plan on the first requests and a prefill plan on the rest.
The reorder is a single permutation applied to q/k/v rows, outputs, request rows and block tables
(invariant 7), and undone on the output so callers see request order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodePrefillSplit:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    request_order: torch.Tensor
    """(B,) int64: new request i is old request request_order[i] (decodes first, stable)."""
    token_order: torch.Tensor
    """(T,) int64: new token j is old token token_order[j]."""
    query_start_loc: torch.Tensor
    """(B + 1,) int64 after the reorder."""

    @property
    def prefill_qo_indptr(self) -> torch.Tensor:
        """qo_indptr of the prefill part, rebased to start at 0."""
        qsl = self.query_start_loc[self.num_decodes:]
        return qsl - qsl[0]

    @property
    def is_identity(self) -> bool:
        return bool((self.request_order == torch.arange(self.request_order.numel())).all())


def split_decodes_and_prefills(query_start_loc_cpu: torch.Tensor, decode_threshold: int = 1) -> DecodePrefillSplit:
    """Requests with query_len <= decode_threshold are decodes; they move to the front, order kept."""
    qsl = query_start_loc_cpu.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    is_decode = q_lens <= decode_threshold
    order = torch.cat([torch.nonzero(is_decode).flatten(), torch.nonzero(~is_decode).flatten()])
    new_lens = q_lens[order]
    new_qsl = torch.zeros_like(qsl)
    new_qsl[1:] = torch.cumsum(new_lens, 0)
    token_order = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in order.tolist()]) \
        if order.numel() else torch.zeros(0, dtype=torch.int64)
    num_decodes = int(is_decode.sum())
    num_decode_tokens = int(new_lens[:num_decodes].sum())
    return DecodePrefillSplit(
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
        num_prefills=int(order.numel()) - num_decodes, num_prefill_tokens=int(qsl[-1]) - num_decode_tokens,
        request_order=order, token_order=token_order.to(torch.int64), query_start_loc=new_qsl)
