"""Independent float64 oracle and bookkeeping for the service tests; uses no cpattn code on purpose.

Legend: T tokens of a step, L keys of one sequence, Q query heads, K kv heads, D head size.
"""

from __future__ import annotations

import itertools
import math

import torch

_names = itertools.count()


def unique_name(prefix: str) -> str:
    """A service name no other test uses, so services never collide in the shared Ray instance."""
    return f"{prefix}-{next(_names)}-{torch.randint(0, 10**9, ()).item()}"


def causal_attention(q_TQD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, window: int | None = None,
                     soft_cap: float | None = None, sinks_Q: torch.Tensor | None = None) -> torch.Tensor:
    """Full causal attention of the last T positions of a sequence of L keys; float64, GQA by repeat.

    ``window`` W: query at position p sees keys p - W < j <= p. ``soft_cap`` c: scaled scores s -> c tanh(s / c).
    ``sinks_Q``: one extra logit per head in the softmax denominator, with no value (gpt-oss).
    """
    t, hq, d = q_TQD.shape
    l, hk, _ = k_LKD.shape
    k = k_LKD.double().repeat_interleave(hq // hk, dim=1)          # [L, Q, D]
    v = v_LKD.double().repeat_interleave(hq // hk, dim=1)
    scores_QTL = torch.einsum("tqd,lqd->qtl", q_TQD.double(), k) / math.sqrt(d)
    if soft_cap is not None:
        scores_QTL = soft_cap * torch.tanh(scores_QTL / soft_cap)
    query_pos = torch.arange(l - t, l)[:, None]
    key_pos = torch.arange(l)[None, :]
    mask_TL = key_pos <= query_pos
    if window is not None:
        mask_TL = mask_TL & (key_pos > query_pos - window)
    scores_QTL = scores_QTL.masked_fill(~mask_TL, -math.inf)
    if sinks_Q is not None:
        sink_col = sinks_Q.double()[:, None, None].expand(hq, t, 1)
        probs = torch.softmax(torch.cat([scores_QTL, sink_col], dim=-1), dim=-1)[..., :l]
    else:
        probs = torch.softmax(scores_QTL, dim=-1)
    return torch.einsum("qtl,lqd->tqd", probs, v)


def _per_layer(value, num_layers: int) -> list:
    """A config's per-layer setting read as written: one value for all layers, a list, or None."""
    return list(value) if isinstance(value, list) else [value] * num_layers


class Oracle:
    """Every committed token's K/V per (sequence, layer); the reference of a step is computed from it."""

    def __init__(self, cfg, seed: int = 0):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.windows = _per_layer(getattr(cfg, "sliding_window", None), cfg.num_layers)
        self.soft_caps = _per_layer(getattr(cfg, "logits_soft_cap", None), cfg.num_layers)
        self.sinks: dict[int, torch.Tensor] = {}
        """Layer -> sink logits [Q] passed to attend (set by a test); layers absent have none."""

    def length(self, sid: str) -> int:
        k, _ = self.kv.get((sid, 0), (None, None))
        return 0 if k is None else k.shape[0]

    def drop(self, sid: str) -> None:
        for layer in range(self.cfg.num_layers):
            self.kv.pop((sid, layer), None)

    def fork(self, source: str, fork: str, num_tokens: int) -> None:
        """``fork``'s history is the first ``num_tokens`` of ``source``'s (what svc.fork promises)."""
        for layer in range(self.cfg.num_layers):
            k, v = self.kv[(source, layer)]
            self.kv[(fork, layer)] = (k[:num_tokens].clone(), v[:num_tokens].clone())

    def random_qkv(self, t: int):
        cfg = self.cfg
        dt = cfg.torch_dtype
        q = torch.randn(t, cfg.num_q_heads, cfg.head_size, generator=self.gen, dtype=torch.float64).to(dt)
        k = torch.randn(t, cfg.num_kv_heads, cfg.head_size, generator=self.gen, dtype=torch.float64).to(dt)
        v = torch.randn(t, cfg.num_kv_heads, cfg.head_size, generator=self.gen, dtype=torch.float64).to(dt)
        return q, k, v

    def reference(self, request: dict[str, int], layer: int, q, k, v):
        """Expected output [T, Q, D] (float64) and the K/V histories the step would commit."""
        cfg = self.cfg
        outs, new_kv, start = [], {}, 0
        for sid, n in request.items():
            empty = torch.zeros(0, cfg.num_kv_heads, cfg.head_size, dtype=torch.float64)
            k0, v0 = self.kv.get((sid, layer), (empty, empty))
            kk = torch.cat([k0, k[start:start + n].double()])
            vv = torch.cat([v0, v[start:start + n].double()])
            outs.append(causal_attention(q[start:start + n], kk, vv, self.windows[layer], self.soft_caps[layer],
                                         self.sinks.get(layer)))
            new_kv[(sid, layer)] = (kk, vv)
            start += n
        return torch.cat(outs), new_kv

    def commit(self, new_kv: dict) -> None:
        self.kv.update(new_kv)


def tolerance(cfg) -> float:
    return {"float64": 1e-10, "float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2}[cfg.dtype]


def checked_step(svc, oracle: Oracle, request: dict[str, int], after_layer=None, tol: float | None = None,
                 check: bool = True):
    """One full step (every layer) checked layer by layer against the oracle; ``after_layer(step, layer)``
    runs between layers (fault injection). Commits the oracle's history; returns (step, max error)."""
    tol = tolerance(oracle.cfg) if tol is None else tol
    t = sum(request.values())
    pending, worst = {}, 0.0
    with svc.step(request) as step:
        for layer in range(oracle.cfg.num_layers):
            q, k, v = oracle.random_qkv(t)
            sinks = oracle.sinks.get(layer)
            out = step.attend(layer, q, k, v) if sinks is None else step.attend(layer, q, k, v, sinks=sinks)
            ref, new_kv = oracle.reference(request, layer, q, k, v)
            assert out.shape == ref.shape and out.dtype == oracle.cfg.torch_dtype
            err = (out.double() - ref).abs().max().item()
            worst = max(worst, err)
            if check:
                assert bool(out.isfinite().all()) and err <= tol, f"layer {layer} of {request}: max error {err} > {tol}"
            pending.update(new_kv)
            if after_layer is not None:
                after_layer(step, layer)
    svc.gateway.flush()   # reads a commit sent without waiting (async_commit): a late rollback raises here
    oracle.commit(pending)
    for sid in request:
        assert svc.sequence_length(sid) == oracle.length(sid)
    return step, worst


def relative_step(svc, oracle: Oracle, request: dict[str, int], bound: float, where: str, device: str = "cuda"):
    """One full step with q/k/v on ``device`` (the GPU tests'), each layer's output within ``bound`` relative error
    (norm) of the float64 oracle, the oracle's history committed; returns the step. ``where`` names the case."""
    t = sum(request.values())
    pending = {}
    with svc.step(request) as step:
        for layer in range(oracle.cfg.num_layers):
            q, k, v = oracle.random_qkv(t)
            sinks = oracle.sinks.get(layer)
            extra = {} if sinks is None else {"sinks": sinks.float().to(device)}
            out = step.attend(layer, q.to(device), k.to(device), v.to(device), **extra)
            ref, new_kv = oracle.reference(request, layer, q, k, v)
            rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
            assert rel < bound, f"{where}: {request} layer {layer}: relative error {rel:.2e}"
            pending.update(new_kv)
    oracle.commit(pending)
    return step


def run_step(svc, oracle: Oracle, request: dict[str, int], check: bool = True) -> float:
    """checked_step without fault injection; returns the max error."""
    return checked_step(svc, oracle, request, check=check)[1]


def local_tokens(seq_len: int, num_shards: int, rank: int, interleave: int) -> int:
    """Tokens of a sequence of ``seq_len`` on ``rank`` by counting positions: token p lives on (p // I) mod N."""
    return sum(1 for p in range(seq_len) if (p // interleave) % num_shards == rank)
