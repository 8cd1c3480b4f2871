"""A context pass's few-query requests through the split-KV decode kernel, all of a request's queries at once.

Legend: R requests of n queries each, Q query heads, K kv heads, G = Q / K, D head size.
In a context pass (causal=False) every query of a request sees the same keys. The decode kernel's program
holds the G query heads of one kv head as the rows of its tile and reads each K/V tile once for them; here
a request's n queries become one "token" with n * G heads per kv head (rows ordered query-major within
the kv head), so each tile is read once for all n queries and all G heads: a shared prefix's pass (N forks'
queries over one long prefix, attention/cascade_plan.py) costs about one decode, not N. Requests are
batched by n, one launch each; n * G is kept within MAX_ROWS (the tile's rows: registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ROWS = 64
"""Query rows (queries x G) of one kernel program."""


@dataclass
class QueryGroups:
    """Requests of one query count ``n``, on the device: first token (R,), request (R,), keys (R,) int32."""

    n: int
    first_tok: torch.Tensor
    req: torch.Tensor
    kv_len: torch.Tensor
    splits: int


def plan_query_groups(qsl: list[int], q_lens: list[int], seq: list[int], requests: list[int], num_kv_heads: int,
                      device: torch.device) -> list[QueryGroups]:
    """QueryGroups of ``requests`` (each with 1 < n <= MAX_ROWS // G queries), batched by n."""
    from cpattn.attention.backends.triton_decode import decode_num_splits

    by_n: dict[int, list[int]] = {}
    for r in requests:
        by_n.setdefault(q_lens[r], []).append(r)
    i32 = dict(dtype=torch.int32)
    groups = []
    for n, reqs in sorted(by_n.items()):
        kv = [seq[r] for r in reqs]
        splits = decode_num_splits(len(reqs), num_kv_heads, max(kv), device) if max(kv) > 0 else 1
        groups.append(QueryGroups(n, torch.tensor([qsl[r] for r in reqs], **i32).to(device, non_blocking=True),
                                  torch.tensor(reqs, **i32).to(device, non_blocking=True),
                                  torch.tensor(kv, **i32).to(device, non_blocking=True), splits))
    return groups


def max_queries(num_q_heads: int, num_kv_heads: int) -> int:
    """The most queries of one request a program holds (MAX_ROWS rows of n x G)."""
    return max(1, MAX_ROWS // (num_q_heads // num_kv_heads))


def attend_query_groups(groups: list[QueryGroups], q_TQD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor,
                        **features) -> None:
    """Rows of each group's requests into ``out_TQD`` / ``lse_TQ`` (natural-log LSE)."""
    from cpattn.attention.backends.triton_decode import paged_decode

    t, hq, d = q_TQD.shape
    hk = k_cache.shape[2]
    g = hq // hk
    for grp in groups:
        r = grp.req.numel()
        rows = (grp.first_tok.long()[:, None] + torch.arange(grp.n, device=q_TQD.device)).flatten()   # (R n,)
        # [R, n, K, G, D] -> [R, K, n, G, D]: one "token" per request with n * G heads per kv head.
        q_virtual = q_TQD.index_select(0, rows).view(r, grp.n, hk, g, d).transpose(1, 2).reshape(r, hk * grp.n * g, d)
        out_v = torch.empty(r, hk * grp.n * g, d, dtype=out_TQD.dtype, device=out_TQD.device)
        lse_v = torch.empty(r, hk * grp.n * g, dtype=torch.float32, device=out_TQD.device)
        tok = torch.arange(r, dtype=torch.int32, device=q_TQD.device)
        paged_decode(q_virtual.contiguous(), k_cache, v_cache, block_table, tok, grp.req, grp.kv_len, grp.splits,
                     scale, out_v, lse_v, all_rows=True, **features)
        out_TQD.index_copy_(0, rows, out_v.view(r, hk, grp.n, g, d).transpose(1, 2).reshape(r * grp.n, hq, d))
        lse_TQ.index_copy_(0, rows, lse_v.view(r, hk, grp.n, g).transpose(1, 2).reshape(r * grp.n, hq))
