"""A context pass's few-query requests through the split-KV decode kernel, all of a request's queries at once.

Legend: R requests of n queries each, Q query heads, K kv heads, G = Q / K, D head size.
In a context pass (causal=False) every query of a request sees the same keys. The decode kernel's program
holds the G query heads of one kv head as the rows of its tile and reads each K/V tile once for them; here
a request's n queries (consecutive rows) share one program, its n * G tile rows addressing q and the output
directly (query-major within the kv head: no gathered or transposed copies), so each tile is read once for all
n queries and all G heads: a shared prefix's pass (N forks' queries over one long prefix,
attention/cascade_plan.py) costs about one decode, not N. Requests are batched by n, one launch each (its split
partials merged in place where the group is the whole step: the prefix pass); n * G is kept within MAX_ROWS (the
tile's rows: registers). The launch configuration is triton_decode.CONFIG_OVERRIDES["query_groups"]
(benchmarks/prefix_pass_sweep.py).
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
    all_rows: bool = False
    """The group's rows are the step's rows 0 .. T-1 in order (a prefix pass): partials merge in place."""


def plan_query_groups(qsl: list[int], q_lens: list[int], seq: list[int], requests: list[int], num_kv_heads: int,
                      device: torch.device) -> list[QueryGroups]:
    """QueryGroups of ``requests`` (each with 1 < n <= MAX_ROWS // G queries), batched by n."""
    from cpattn.attention.backends.triton_decode import decode_config, decode_num_splits

    by_n: dict[int, list[int]] = {}
    for r in requests:
        by_n.setdefault(q_lens[r], []).append(r)
    i32 = dict(dtype=torch.int32)
    groups = []
    for n, reqs in sorted(by_n.items()):
        kv = [seq[r] for r in reqs]
        cfg = decode_config(query_groups=True)
        splits = decode_num_splits(len(reqs), num_kv_heads, max(kv), device, config=cfg) if max(kv) > 0 else 1
        firsts = [qsl[r] for r in reqs]
        all_rows = firsts == list(range(0, n * len(reqs), n)) and n * len(reqs) == qsl[-1]
        groups.append(QueryGroups(n, torch.tensor(firsts, **i32).to(device, non_blocking=True),
                                  torch.tensor(reqs, **i32).to(device, non_blocking=True),
                                  torch.tensor(kv, **i32).to(device, non_blocking=True), splits, all_rows))
    return groups


def max_queries(num_q_heads: int, num_kv_heads: int) -> int:
    """The most queries of one request a program holds (MAX_ROWS rows of n x G)."""
    return max(1, MAX_ROWS // (num_q_heads // num_kv_heads))


def attend_query_groups(groups: list[QueryGroups], q_TQD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor,
                        **features) -> None:
    """Rows of each group's requests into ``out_TQD`` / ``lse_TQ`` (natural-log LSE)."""
    from cpattn.attention.backends.triton_decode import paged_decode

    for grp in groups:
        paged_decode(q_TQD, k_cache, v_cache, block_table, grp.first_tok, grp.req, grp.kv_len, grp.splits, scale,
                     out_TQD, lse_TQ, all_rows=grp.all_rows, queries=grp.n, **features)
