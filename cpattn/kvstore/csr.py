"""Block table -> FlashInfer's CSR page table (``paged_kv_indptr / indices / last_page_len``)."""

from __future__ import annotations

import torch

from cpattn.errors import InvalidRequestError


def block_table_to_csr(block_table: torch.Tensor, seq_lens: torch.Tensor | list[int],
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten the first ceil(len / block_size) ids of each row.

    Returns ``indptr`` (B + 1,), ``indices`` (indptr[-1],) and ``last_page_len`` (B,), int64.
    A full last page has length ``block_size`` (not 0); an empty sequence has 0 pages and
    last_page_len 0.
    """
    if block_size < 1:
        raise InvalidRequestError(f"block_size {block_size} must be >= 1")
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=block_table.device)
    if block_table.dim() != 2 or block_table.shape[0] != lens.numel():
        raise InvalidRequestError(f"block_table {tuple(block_table.shape)} must be [B, W] with "
                                  f"B = len(seq_lens) = {lens.numel()}")
    if bool((lens < 0).any()):
        raise InvalidRequestError(f"seq_lens must be >= 0, got {lens.tolist()}")
    num_pages = (lens + block_size - 1) // block_size
    if bool((num_pages > block_table.shape[1]).any()):
        raise InvalidRequestError(f"block_table width {block_table.shape[1]} is too small for seq_lens {lens.tolist()}")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=block_table.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    mask = cols[None, :] < num_pages[:, None]
    indices = block_table.to(torch.int64)[mask]
    last_page_len = torch.where(lens > 0, (lens - 1) % block_size + 1, torch.zeros_like(lens))
    return indptr, indices, last_page_len
