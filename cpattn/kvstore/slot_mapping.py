"""Slot mapping: where each new token's K/V is written in the paged cache (int64 throughout)."""

from __future__ import annotations

import torch

from cpattn.errors import InvalidRequestError

PAD_SLOT_ID = -1


def compute_slot_mapping(block_table_BW: torch.Tensor, positions_T: torch.Tensor,
                         request_of_token_T: torch.Tensor, block_size: int) -> torch.Tensor:
    """slot = block_table[request, pos // block_size] * block_size + pos % block_size.

    Tokens whose position is negative are padding and get ``PAD_SLOT_ID``. int64 so that
    pools beyond 2**31 slots cannot wrap.
    """
    positions_T = positions_T.to(torch.int64)
    request_of_token_T = request_of_token_T.to(torch.int64)
    valid = positions_T >= 0
    safe_pos = positions_T.clamp(min=0)
    num_rows, width = block_table_BW.shape
    if block_size < 1:
        raise InvalidRequestError(f"block_size {block_size} must be >= 1")
    bad_req = valid & ((request_of_token_T < 0) | (request_of_token_T >= num_rows))
    if bool(bad_req.any()):
        bad = int(torch.nonzero(bad_req)[0])
        raise InvalidRequestError(f"token {bad} belongs to request {int(request_of_token_T[bad])}, but the block "
                                  f"table has {num_rows} rows")
    too_far = valid & (safe_pos // block_size >= width)
    if bool(too_far.any()):
        bad = int(torch.nonzero(too_far)[0])
        raise InvalidRequestError(f"token {bad} at position {int(positions_T[bad])} needs page "
                                  f"{int(positions_T[bad]) // block_size}, but the block table width is {width}: "
                                  "allocate its pages first")
    block_ids = block_table_BW.to(torch.int64)[request_of_token_T, safe_pos // block_size]
    if bool((valid & (block_ids < 0)).any()):
        bad = int(torch.nonzero(valid & (block_ids < 0))[0])
        raise InvalidRequestError(f"token {bad} at position {int(positions_T[bad])} has no block in its table row")
    slots = block_ids * block_size + safe_pos % block_size
    return torch.where(valid, slots, torch.full_like(slots, PAD_SLOT_ID))
