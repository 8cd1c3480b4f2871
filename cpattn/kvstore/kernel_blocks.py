"""Kernel-block view: a manager page of M tokens seen as M/k kernel pages of k tokens.

Backends declare the page sizes their kernels accept; start-up picks the largest size that
divides the manager block size and every backend in use accepts. The block table and the KV
tensor view are expanded with the same rule, so producer and consumer agree on the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpattn.errors import InvalidRequestError


@dataclass(frozen=True)
class MultipleOf:
    """Any page size that is a multiple of ``base`` (e.g. FlashAttention's MultipleOf(16))."""

    base: int

    def accepts(self, size: int) -> bool:
        return size > 0 and size % self.base == 0


def _check_sizes(manager_block_size: int, kernel_block_size: int) -> None:
    if manager_block_size < 1 or kernel_block_size < 1 or manager_block_size % kernel_block_size:
        raise InvalidRequestError(f"kernel block size {kernel_block_size} must be >= 1 and divide the manager "
                                  f"block size {manager_block_size}")


def _accepts(spec: int | MultipleOf, size: int) -> bool:
    return spec.accepts(size) if isinstance(spec, MultipleOf) else spec == size


def select_common_kernel_block_size(manager_block_size: int,
                                    supported: list[list[int | MultipleOf]]) -> int:
    """Largest k dividing ``manager_block_size`` accepted by every backend's list.

    Raises InvalidRequestError naming the manager size and each backend's list when none exists.
    """
    if manager_block_size < 1:
        raise InvalidRequestError(f"manager block size {manager_block_size} must be >= 1")
    for k in range(manager_block_size, 0, -1):
        if manager_block_size % k:
            continue
        if all(any(_accepts(s, k) for s in specs) for specs in supported):
            return k
    raise InvalidRequestError(
        f"no kernel page size divides block_size {manager_block_size} and suits every backend "
        f"{supported}: choose a block_size that is a multiple of one size each backend accepts")


def expand_block_table(block_table_BW: torch.Tensor, manager_block_size: int,
                       kernel_block_size: int) -> torch.Tensor:
    """Manager id b -> kernel ids b*r .. b*r + r - 1 (r = M / k); padding (-1) stays padding."""
    _check_sizes(manager_block_size, kernel_block_size)
    r = manager_block_size // kernel_block_size
    if r == 1:
        return block_table_BW
    offs = torch.arange(r, device=block_table_BW.device, dtype=torch.int64)
    expanded = block_table_BW.to(torch.int64)[:, :, None] * r + offs
    expanded = torch.where(block_table_BW[:, :, None] < 0, torch.full_like(expanded, -1), expanded)
    return expanded.reshape(block_table_BW.shape[0], -1)


def kernel_kv_view(kv_cache_2NBKD: torch.Tensor, manager_block_size: int, kernel_block_size: int) -> torch.Tensor:
    """View [2, num_blocks, M, Hk, D] as [2, num_blocks*r, k, Hk, D]; a view, never a copy.

    K and V lead the layout precisely so that this split is a reshape of contiguous pages.
    """
    _check_sizes(manager_block_size, kernel_block_size)
    if kv_cache_2NBKD.dim() != 5 or kv_cache_2NBKD.shape[2] != manager_block_size:
        raise InvalidRequestError(f"kv cache {tuple(kv_cache_2NBKD.shape)} must be [2, num_blocks, "
                                  f"{manager_block_size}, Hk, D] for manager block size {manager_block_size}")
    r = manager_block_size // kernel_block_size
    if r == 1:
        return kv_cache_2NBKD
    two, n, m, hk, d = kv_cache_2NBKD.shape
    return kv_cache_2NBKD.view(two, n * r, kernel_block_size, hk, d)
