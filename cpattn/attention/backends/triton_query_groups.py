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

import dataclasses
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
    firsts: tuple[int, ...] = ()
    """``first_tok`` on the host, as planned (rows of the pass's q)."""
    out_rows: torch.Tensor | None = None
    """Set by ``into_step_rows``: (R_group,) int64, the step row each of the group's query rows merges into."""
    q_step_rows: bool = False
    """``first_tok`` holds step rows (each request's rows are consecutive there): q is read from the step's q."""


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
                                  torch.tensor(kv, **i32).to(device, non_blocking=True), splits, all_rows,
                                  tuple(firsts)))
    return groups


def into_step_rows(groups: list[QueryGroups], rows_R: torch.Tensor, device: torch.device) -> list[QueryGroups]:
    """``groups`` of a pass over the step's rows ``rows_R`` (CPU int64: pass row i is step row rows_R[i], a cascade's
    prefix pass) addressing the step directly: each group's partials merge into its step rows (``out_rows``), and a
    group whose requests' rows are consecutive in the step reads q there (``q_step_rows``), so neither q nor the
    outputs are gathered or scattered."""
    step = rows_R.tolist()
    out = []
    for grp in groups:
        rows = [step[f + j] for f in grp.firsts for j in range(grp.n)]
        direct = all(rows[i * grp.n:(i + 1) * grp.n] == list(range(rows[i * grp.n], rows[i * grp.n] + grp.n))
                     for i in range(len(grp.firsts)))
        first_tok = grp.first_tok
        if direct:
            first_tok = torch.tensor(rows[::grp.n], dtype=torch.int32).to(device, non_blocking=True)
        out.append(dataclasses.replace(grp, first_tok=first_tok, all_rows=False, q_step_rows=direct,
                                       out_rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)))
    return out


def max_queries(num_q_heads: int, num_kv_heads: int) -> int:
    """The most queries of one request a program holds (MAX_ROWS rows of n x G)."""
    return max(1, MAX_ROWS // (num_q_heads // num_kv_heads))


def attend_query_groups(groups: list[QueryGroups], q_TQD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, scale: float, out_TQD: torch.Tensor, lse_TQ: torch.Tensor,
                        rows_R: torch.Tensor | None = None, **features) -> None:
    """Rows of each group's requests into ``out_TQD`` / ``lse_TQ`` (natural-log LSE). Groups of ``into_step_rows``
    merge into the step's rows of ``out_TQD`` / ``lse_TQ`` (which hold the suffix pass) instead, ``q_TQD`` the step's
    q; ``rows_R`` (the pass's step rows, int64 on the device) gathers q for a group not ``q_step_rows``."""
    from cpattn.attention.backends.triton_decode import paged_decode

    gathered = None
    for grp in groups:
        q = q_TQD
        if grp.out_rows is not None and not grp.q_step_rows:
            gathered = q = q_TQD.index_select(0, rows_R) if gathered is None else gathered
        paged_decode(q, k_cache, v_cache, block_table, grp.first_tok, grp.req, grp.kv_len, grp.splits, scale,
                     out_TQD, lse_TQ, all_rows=grp.all_rows, queries=grp.n, into_rows=grp.out_rows, **features)
