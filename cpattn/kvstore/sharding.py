"""Decode context parallelism (DCP): which shard owns which token.

With N shards and interleave I, global position p lives on shard ``(p // I) % N`` at local
position ``(p // (N*I)) * I + p % I``. I = 1 deals tokens round robin; I = block_size deals whole
pages, so each shard's local pages fill one at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from cpattn.errors import InvalidRequestError


def _check(world_size: int, interleave: int, rank: int | None = None) -> None:
    if world_size < 1:
        raise InvalidRequestError(f"world_size {world_size} must be >= 1")
    if interleave < 1:
        raise InvalidRequestError(f"interleave {interleave} must be >= 1")
    if rank is not None and not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank {rank} out of range for world_size {world_size}: use 0..{world_size - 1}")


def dcp_owner_rank(positions: torch.Tensor, world_size: int, interleave: int) -> torch.Tensor:
    """Shard owning each global position."""
    _check(world_size, interleave)
    return (positions.to(torch.int64) // interleave) % world_size


def dcp_local_position(positions: torch.Tensor, world_size: int, interleave: int) -> torch.Tensor:
    """Position of each global position inside its owner's local sequence."""
    _check(world_size, interleave)
    p = positions.to(torch.int64)
    return (p // (world_size * interleave)) * interleave + p % interleave


def dcp_local_seq_lens(seq_lens: torch.Tensor | list[int], world_size: int, rank: int,
                       interleave: int) -> torch.Tensor:
    """How many of each sequence's first ``seq_len`` tokens live on ``rank`` (int64)."""
    _check(world_size, interleave, rank)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    if bool((lens < 0).any()):
        raise InvalidRequestError(f"seq_lens must be >= 0, got {lens.tolist()}")
    span = world_size * interleave
    full_rounds, rem = lens // span, lens % span
    return full_rounds * interleave + (rem - rank * interleave).clamp(min=0, max=interleave)


def dcp_local_seq_lens_host(seq_lens: np.ndarray, world_size: int, rank: int, interleave: int) -> np.ndarray:
    """``dcp_local_seq_lens`` of a host array, by numpy (int64): a decode run's [S, B] lengths on the client,
    where a torch op on a large array waits for torch's intra-op threads (cluster/steady_run.py)."""
    _check(world_size, interleave, rank)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if (lens < 0).any():
        raise InvalidRequestError(f"seq_lens must be >= 0, got {lens.tolist()}")
    span = world_size * interleave
    return (lens // span) * interleave + np.clip(lens % span - rank * interleave, 0, interleave)


def dcp_local_seq_len(seq_len: int, world_size: int, rank: int, interleave: int) -> int:
    """``dcp_local_seq_lens`` for one length in plain ints: the coordinator asks it per sequence per shard
    per step, where building a tensor each time costs more than the arithmetic."""
    span = world_size * interleave
    return (seq_len // span) * interleave + min(max(seq_len % span - rank * interleave, 0), interleave)
