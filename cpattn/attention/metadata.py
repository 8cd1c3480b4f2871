"""CommonAttentionMetadata: the facts of one step that every backend plans from.

Legend: B requests, T tokens (sum of query lengths), W block-table width.
Two modes share one structure:
- causal=True  (single-rank attention): ``seq_lens`` include the step's new tokens; query j of a
  request with context c sees keys [0, c + j].
- causal=False (a DCP shard's context partial): ``seq_lens`` are the keys the shard held before
  the step; every query sees all of them, so no mask and no per-query visibility is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpattn.array_pickle import TensorsAsArrays
from cpattn.errors import InvalidRequestError
from cpattn.kvstore import (PAD_SLOT_ID, compute_slot_mapping, dcp_local_position, dcp_local_seq_lens,
                            dcp_owner_rank)


@dataclass
class CommonAttentionMetadata(TensorsAsArrays):
    query_start_loc: torch.Tensor
    """(B + 1,) int64, device: start of each request in the flattened query; last = T."""
    query_start_loc_cpu: torch.Tensor
    """(B + 1,) int64, CPU copy for planning without a device sync."""
    seq_lens: torch.Tensor
    """(B,) int64, device: keys each request's queries may read from the paged cache."""
    seq_lens_cpu: torch.Tensor
    """(B,) int64, CPU copy."""
    context_lens_cpu: torch.Tensor
    """(B,) int64: keys readable before this step (seq_lens - query_lens when causal)."""
    block_table_tensor: torch.Tensor
    """(B, W) int64, device: physical page ids of each request, -1 beyond its pages."""
    slot_mapping: torch.Tensor
    """(T,) int64, device: cache slot each new token's K/V is written to; -1 = not written here."""
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    query_positions_cpu: torch.Tensor | None = None
    """(T,) int64: global position of each query token in its sequence (what sliding windows are measured on)."""
    dcp_world_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    """DCP geometry of the keys this metadata addresses: local key l of this rank is global position
    (l // I) * N * I + rank * I + l % I (N = 1: local = global)."""
    block_table_cpu: torch.Tensor | None = None
    """(B, W) int64: the host table ``block_table_tensor`` was copied from (set by ``to``), so a backend that
    plans from the table (an fp8 cache's distinct pages) needs no device sync."""
    slot_mapping_cpu: torch.Tensor | None = None
    """(T,) int64: the host slots ``slot_mapping`` was copied from (set by ``to``), so a builder asks whether the
    step writes here without a device sync (``bool()`` of a GPU tensor waits for every kernel queued before it)."""

    def slots_on_host(self) -> torch.Tensor:
        """(T,) the slot mapping on the CPU: the host copy ``to`` kept where there is one (no device sync)."""
        return self.slot_mapping if self.slot_mapping_cpu is None else self.slot_mapping_cpu

    def table_on_host(self) -> torch.Tensor:
        """(B, W) the block table on the CPU: the host copy ``to`` kept where there is one (else a copy, which
        waits for the device)."""
        table = self.block_table_tensor
        if table.device.type == "cpu":
            return table
        return table.cpu() if self.block_table_cpu is None else self.block_table_cpu

    def window_key_start(self, window: int | None) -> torch.Tensor | None:
        """(T,) int64 on the CPU: the first *local* key index each query may read under a sliding window of
        ``window`` global positions (query at p sees keys p - window < j <= p); None without a window.

        Measured on global positions on every shard: the local keys before the start are exactly this
        rank's tokens among global positions [0, p - window + 1), counted by the DCP interleave rule.
        """
        if window is None:
            return None
        if self.query_positions_cpu is None:
            raise InvalidRequestError("this metadata carries no query positions: build it with "
                                      "make_causal_metadata / make_dcp_context_metadata to use a sliding window")
        first_global = (self.query_positions_cpu - window + 1).clamp(min=0)
        return dcp_local_seq_lens(first_global, self.dcp_world_size, self.dcp_rank, self.dcp_interleave)

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def to(self, device: torch.device | str) -> "CommonAttentionMetadata":
        """Device copies of the device-side fields (CPU copies stay on the CPU)."""
        table = self.block_table_tensor
        return replace(self, query_start_loc=self.query_start_loc.to(device),
                       seq_lens=self.seq_lens.to(device),
                       block_table_tensor=table.to(device),
                       block_table_cpu=table if table.device.type == "cpu" else self.block_table_cpu,
                       slot_mapping=self.slot_mapping.to(device),
                       slot_mapping_cpu=self.slot_mapping if self.slot_mapping.device.type == "cpu"
                       else self.slot_mapping_cpu)


def _check_lens(query_lens: torch.Tensor, context_lens: torch.Tensor) -> None:
    if query_lens.numel() != context_lens.numel():
        raise InvalidRequestError(f"query_lens ({query_lens.numel()}) and context_lens ({context_lens.numel()}) "
                                  "must describe the same requests")
    for name, lens in (("query_lens", query_lens), ("context_lens", context_lens)):
        if bool((lens < 0).any()):
            raise InvalidRequestError(f"{name} must be >= 0, got {lens.tolist()}")


def _query_start_loc(query_lens: torch.Tensor) -> torch.Tensor:
    qsl = torch.zeros(query_lens.numel() + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(query_lens, 0)
    return qsl


def make_causal_metadata(query_lens: list[int], context_lens: list[int], block_table_BW: torch.Tensor,
                         block_size: int) -> CommonAttentionMetadata:
    """Single-rank metadata: new tokens at positions context .. context + query_len - 1 of each request."""
    q = torch.as_tensor(query_lens, dtype=torch.int64)
    c = torch.as_tensor(context_lens, dtype=torch.int64)
    _check_lens(q, c)
    if q.numel() != c.numel() or block_table_BW.shape[0] != q.numel():
        raise InvalidRequestError(
            f"query_lens ({q.numel()}), context_lens ({c.numel()}) and block_table rows "
            f"({block_table_BW.shape[0]}) must describe the same requests")
    qsl = _query_start_loc(q)
    seq_lens = c + q
    req_of_tok = torch.repeat_interleave(torch.arange(q.numel()), q)
    positions = torch.arange(int(qsl[-1])) - qsl[:-1].repeat_interleave(q) + c.repeat_interleave(q)
    slots = compute_slot_mapping(block_table_BW, positions, req_of_tok, block_size)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        context_lens_cpu=c.clone(), block_table_tensor=block_table_BW.to(torch.int64), slot_mapping=slots,
        num_reqs=q.numel(), num_actual_tokens=int(qsl[-1]), max_query_len=int(q.max()) if q.numel() else 0,
        max_seq_len=int(seq_lens.max()) if q.numel() else 0, causal=True, query_positions_cpu=positions)


def make_dcp_context_metadata(query_lens: list[int], context_lens: list[int], local_block_table_BW: torch.Tensor,
                              block_size: int, world_size: int, rank: int, interleave: int,
                              fold_decodes: bool = False) -> CommonAttentionMetadata:
    """One shard's metadata for a step: queries vs the local context it held before the step.

    ``local_block_table_BW`` must already hold the pages for the new tokens this rank owns; their
    slots are in ``slot_mapping`` (other ranks' tokens are -1), but ``seq_lens`` exclude them.

    ``fold_decodes``: a decode (a request with one new token) also sees its own key on the rank that
    stores it: that rank's ``seq_lens`` count the token (backends write K/V before attending), so the
    step needs no separate causal pass and no extra merge for it (``plan_causal_pieces(skip_decodes=True)``
    leaves decodes out). ``context_lens_cpu`` still counts only the keys held before the step.
    """
    q = torch.as_tensor(query_lens, dtype=torch.int64)
    c = torch.as_tensor(context_lens, dtype=torch.int64)
    _check_lens(q, c)
    if local_block_table_BW.shape[0] != q.numel():
        raise InvalidRequestError(f"local block table has {local_block_table_BW.shape[0]} rows for "
                                  f"{q.numel()} requests")
    qsl = _query_start_loc(q)
    local_ctx = dcp_local_seq_lens(c, world_size, rank, interleave)
    positions = torch.arange(int(qsl[-1])) - qsl[:-1].repeat_interleave(q) + c.repeat_interleave(q)
    owned = dcp_owner_rank(positions, world_size, interleave) == rank
    # Slots of the tokens this rank owns only (1/N of a prefill's), the rest PAD_SLOT_ID: a 32K prefill's plan
    # computes each token's slot once across the ranks, not once per rank.
    mine = owned.nonzero().flatten()
    req_of_tok = torch.repeat_interleave(torch.arange(q.numel()), q)
    slots = torch.full_like(positions, PAD_SLOT_ID)
    slots[mine] = compute_slot_mapping(local_block_table_BW, dcp_local_position(positions[mine], world_size, interleave),
                                       req_of_tok[mine], block_size)
    seq_lens = local_ctx
    if fold_decodes:
        # A decode's one token is row qsl[r]; the rank owning it reads it back from its cache.
        decodes = (q == 1).nonzero().flatten()
        seq_lens = local_ctx.clone()
        seq_lens[decodes] += owned[qsl[decodes]].to(torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        context_lens_cpu=local_ctx.clone(), block_table_tensor=local_block_table_BW.to(torch.int64),
        slot_mapping=slots, num_reqs=q.numel(), num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q.max()) if q.numel() else 0,
        max_seq_len=int(seq_lens.max()) if q.numel() else 0, causal=False, query_positions_cpu=positions,
        dcp_world_size=world_size, dcp_rank=rank, dcp_interleave=interleave)
