"""Independent float64 oracle for the test suite: dense attention over each sequence's full K/V history.

Uses no cpattn code, on purpose: plain torch softmax, one query head at a time, GQA by mapping query
head h to KV head h // (Hq / Hk). Everything is computed in float64.
Legend: L keys of one sequence, Q query heads, K kv heads, D head size.
"""

from __future__ import annotations

import math

import torch


def attention_with_visibility(q_LQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor,
                              visible_LqLk: torch.Tensor, scale: float | None = None,
                              soft_cap: float | None = None, sinks_Q: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query attends to the keys ``visible[i]`` marks. Returns out [Lq, Q, D] and natural-log lse [Lq, Q],
    float64; a query that sees no key gets out 0 and lse -inf (or lse = its sink with sinks).

    ``soft_cap``: scaled scores s become cap * tanh(s / cap). ``sinks_Q``: one extra logit per head in the
    softmax denominator, with no value (gpt-oss attention sinks)."""
    lq, hq, d = q_LQD.shape
    hk = k_LKD.shape[1]
    group = hq // hk
    scale = d ** -0.5 if scale is None else scale
    q = q_LQD.double()
    k = k_LKD.double()
    v = v_LKD.double()
    out = torch.zeros(lq, hq, d, dtype=torch.float64)
    lse = torch.full((lq, hq), -math.inf, dtype=torch.float64)
    if lq == 0 or k.shape[0] == 0:
        return out, lse
    vis = visible_LqLk.bool()
    any_key = vis.any(dim=1)
    for h in range(hq):
        kh = h // group
        s = (q[:, h] @ k[:, kh].T) * scale                              # [Lq, Lk]
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        if sinks_Q is not None:                                          # one more column: the sink, no value
            s = torch.cat([s, torch.full((lq, 1), float(sinks_Q[h]), dtype=torch.float64)], dim=1)
            s = s.masked_fill(~torch.cat([vis, torch.ones(lq, 1, dtype=torch.bool)], dim=1), -math.inf)
            m = s.max(dim=1).values
            p = torch.exp(s - m[:, None])
            denom = p.sum(dim=1)
            out[:, h] = (p[:, :-1] @ v[:, kh]) / denom[:, None]
            lse[:, h] = m + torch.log(denom)
            continue
        s = s.masked_fill(~vis, -math.inf)
        m = s.max(dim=1).values
        m = torch.where(any_key, m, torch.zeros_like(m))
        p = torch.exp(s - m[:, None])                                   # exp(-inf) = 0 off the mask
        denom = p.sum(dim=1)
        safe = torch.where(any_key, denom, torch.ones_like(denom))
        out[:, h] = torch.where(any_key[:, None], (p @ v[:, kh]) / safe[:, None], 0.0)
        lse[:, h] = torch.where(any_key, m + torch.log(safe), -math.inf)
    return out, lse


def causal_visibility(num_queries: int, num_keys: int) -> torch.Tensor:
    """Queries are the last ``num_queries`` of ``num_keys`` positions; query i sees keys <= its position."""
    pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
    return torch.arange(num_keys)[None, :] <= pos


def window_visibility(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      window: int | None) -> torch.Tensor:
    """[Lq, Lk] bool: causal (key position <= query position) and, with a window W, key position > query - W."""
    qp, kp = query_positions[:, None], key_positions[None, :]
    vis = kp <= qp
    if window is not None:
        vis &= kp > qp - window
    return vis


def reference_attention(q_TQD: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch step: request r's queries are the last query_lens[r] positions of its full history
    keys[r] / values[r] ([L_r, K, D]), causal. Returns out [T, Q, D], lse [T, Q] float64."""
    outs, lses = [], []
    start = 0
    for k, v, ql in zip(keys, values, query_lens):
        vis = causal_visibility(ql, k.shape[0])
        o, l = attention_with_visibility(q_TQD[start:start + ql], k, v, vis)
        outs.append(o)
        lses.append(l)
        start += ql
    hq, d = q_TQD.shape[1], q_TQD.shape[2]
    if not outs:
        return torch.zeros(0, hq, d, dtype=torch.float64), torch.zeros(0, hq, dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)
