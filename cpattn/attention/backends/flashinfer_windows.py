"""FLASHINFER's sliding windows: each query's window on global positions, as plans FlashInfer runs exactly.

FlashInfer keeps key k of a request with m queries and n keys for query i iff k >= n - m + i - window_left (and, when
causal, k <= n - m + i): one key count per plan, counted back from the bottom-right corner. A DCP shard's local
keys interleave global positions, so a window of W positions covers a different number of a shard's keys for each
query (``CommonAttentionMetadata.window_key_start`` gives query j its first local key s_j; it sees [s_j, e_j)). So a
windowed layer's queries are planned as *virtual requests*, each exact under that rule, and each reads its keys from
the page holding its first visible key on (pages wholly before every window are not read):
- a decode (one query) is one, with window_left = e - 1 - s; decodes are grouped by that count, one decode plan per
  value (with one shard every decode past its window shares W - 1);
- a request of several queries whose first keys rise one per query (one shard: s_j = max(0, p_j - W + 1), the
  rule's own shape) is one, in a prefill plan per window_left;
- any other (a DCP shard's chunk: its first keys rise by one every N queries) is a masked prefill plan of its own:
  FlashInfer's custom mask, one bit per query and key from the request's first visible key on (m x keys bits,
  built and packed on the device once per step). One request per masked plan, so the mask's offsets are 0 whether
  FlashInfer counts them in bits or bytes, and FlashInfer's own packing (a kernel that wants the host-planned
  indptr on the mask's device) is not needed.
A query that sees no key here (its window lies wholly on other ranks) is in no plan: out 0, lse -inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpattn.attention.metadata import CommonAttentionMetadata


@dataclass
class VirtualRequest:
    request: int
    """The step's request whose pages it reads."""
    first_row: int
    """The step's token index of its first query; its m queries are the step's rows first_row .. first_row + m - 1."""
    num_rows: int
    key_start: int
    """Its first local key (a page boundary): the plan's key 0."""
    key_end: int
    """One past its last local key."""
    mask: tuple[torch.Tensor, torch.Tensor] | None = None
    """A masked request: (first, end) (m,) int64, CPU, each query's visible local keys [first, end)."""


@dataclass
class WindowGroups:
    """One window's virtual requests by plan: (kind, window_left) -> requests, kind decode or prefill; ("masked",
    r) -> [request r's], one masked plan per request (window_left -1, its mask says it all)."""

    by_plan: dict = field(default_factory=dict)

    def add(self, kind: str, window_left: int, vr: VirtualRequest) -> None:
        self.by_plan.setdefault((kind, window_left), []).append(vr)


def window_groups(common: CommonAttentionMetadata, window: int, page_size: int) -> WindowGroups:
    """Every query of the step under a window of ``window`` global positions, as virtual requests (module docstring)."""
    groups = WindowGroups()
    first_T = common.window_key_start(window)
    qsl = common.query_start_loc_cpu.to(torch.int64)
    lens = common.seq_lens_cpu.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    # Decodes at once (a decode step's B requests: no per-request tensor work): a query sees [s, n).
    decodes = ((q_lens == 1) & (lens > 0)).nonzero().flatten()
    s, n = first_T[qsl[decodes]], lens[decodes]
    start = s // page_size * page_size
    left = torch.where(s == start, -1, n - 1 - s)
    for r, row, st, e, wl, live in zip(decodes.tolist(), qsl[decodes].tolist(), start.tolist(), n.tolist(),
                                       left.tolist(), (s < n).tolist()):
        if live:
            groups.add("decode", wl, VirtualRequest(r, row, 1, st, e))
    for r in ((q_lens > 1) & (lens > 0)).nonzero().flatten().tolist():
        _add_chunk(groups, common.causal, r, int(qsl[r]), int(q_lens[r]), int(lens[r]), first_T, page_size)
    return groups


def _add_chunk(groups: WindowGroups, causal: bool, r: int, qs: int, m: int, n: int, first_T: torch.Tensor,
               page_size: int) -> None:
    """Request ``r``'s m > 1 queries (from step row ``qs``, over its n local keys): one prefill virtual request
    where FlashInfer's rule gives each its window, else one masked one."""
    first = first_T[qs:qs + m]
    end = n - m + 1 + torch.arange(m) if causal else torch.full((m,), n, dtype=torch.int64)
    live = (first < end).nonzero().flatten()   # a prefix (not causal) or a suffix (causal): contiguous
    if live.numel() == 0:
        return
    a, b = int(live[0]), int(live[-1]) + 1
    first, end = first[a:b], end[a:b]
    start = int(first[0]) // page_size * page_size
    e, k = int(end[-1]), b - a
    left = e - 1 - int(first[-1])   # the last query's count sets the plan's; the others must follow the rule
    by_rule = (e - k + torch.arange(k) - left).clamp(min=start)
    if torch.equal(by_rule, first.clamp(min=start)):
        groups.add("prefill", -1 if int(first[-1]) <= start else left, VirtualRequest(r, qs + a, k, start, e))
    else:
        groups.add("masked", r, VirtualRequest(r, qs + a, k, start, e, mask=(first, end)))


def plan_inputs(vrs: list[VirtualRequest], table_BW: torch.Tensor, page_size: int):
    """FlashInfer's CSR of ``vrs`` on the host: qo_indptr, page indptr, cache page ids (int64), last_page_len,
    and the step rows of the plan's queries in order (no per-request tensor work: a decode step's B at once)."""
    req, first_row, num_rows, key_start, key_end = torch.tensor(
        [(vr.request, vr.first_row, vr.num_rows, vr.key_start, vr.key_end) for vr in vrs], dtype=torch.int64).T
    qo = torch.zeros(len(vrs) + 1, dtype=torch.int64)
    torch.cumsum(num_rows, 0, out=qo[1:])
    rows = torch.repeat_interleave(first_row - qo[:-1], num_rows) + torch.arange(int(qo[-1]))
    first_page = key_start // page_size
    num_pages = -(-key_end // page_size) - first_page
    indptr = torch.zeros(len(vrs) + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    # Each page's index into the flattened table, built as one run per request (a 1-D gather: a 2-D boolean-masked
    # one cost 0.74 ms against 0.50 for B=64 decodes under W=4096, one thread, 2026-12-05).
    flat = torch.repeat_interleave(req * table_BW.shape[1] + first_page - indptr[:-1], num_pages)
    ids = table_BW.reshape(-1)[flat + torch.arange(int(indptr[-1]))].to(torch.int64)
    last = (key_end - key_start - 1) % page_size + 1
    return qo, indptr, ids, last, rows


MASK_BLOCK_BYTES = 64 << 20
"""packed_mask builds its bits this many at a time (a chunk of 32K queries over 20K local keys is 640M bits)."""


def packed_mask(vr: VirtualRequest, device: torch.device) -> torch.Tensor:
    """A masked request's custom mask as FlashInfer reads it: bit qo_idx * keys + kv_idx over its keys
    [key_start, key_end), little-endian within each byte (``custom_mask_ptr[offset / 8] >> (offset % 8)``), uint8 on
    ``device`` (m x keys bits), built a block of rows at a time (a multiple of 8 rows: each block whole bytes)."""
    first, end = (x.to(device, non_blocking=True) for x in vr.mask)
    keys = torch.arange(vr.key_start, vr.key_end, device=device)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    rows = max(8, MASK_BLOCK_BYTES // max(keys.numel(), 1) // 8 * 8)
    packed = []
    for r0 in range(0, first.numel(), rows):
        bits = ((keys[None, :] >= first[r0:r0 + rows, None]) & (keys[None, :] < end[r0:r0 + rows, None])).flatten()
        bits = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % 8)).view(-1, 8)
        packed.append((bits * weights).sum(-1, dtype=torch.uint8))
    return torch.cat(packed)
