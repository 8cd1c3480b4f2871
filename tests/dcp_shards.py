"""DCP shards in one process, each attending through the library's ShardLayerRunner (what a shard actor runs).

Each shard has its own block pool, block table (pages at ids permuted by the test's generator) and a paged
cache whose unused pages are NaN. A test drives the steps and checks against tests/reference.py; the
per-layer work (KV write, context partial, causal pieces, local merge) is the library's, not a copy.
"""

from __future__ import annotations

import math

import torch

from cpattn.attention import make_dcp_context_metadata
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.config import ServiceConfig
from cpattn.kvstore import BlockPool, BlockTable, dcp_local_seq_lens
from tests.reference import attention_with_visibility, window_visibility


def owner(position: int, world: int, interleave: int) -> int:
    return (position // interleave) % world


def shard_config(world: int, interleave: int, block_size: int, hq: int, hk: int, d: int, dtype: torch.dtype,
                 num_blocks: int, window: int | None = None, soft_cap: float | None = None) -> ServiceConfig:
    return ServiceConfig(num_shards=world, dcp_interleave=interleave, block_size=block_size, num_layers=1,
                         num_q_heads=hq, num_kv_heads=hk, head_size=d, dtype=str(dtype).removeprefix("torch."),
                         num_blocks_per_shard=num_blocks, sliding_window=window, logits_soft_cap=soft_cap)


class LocalShard:
    def __init__(self, rank: int, config: ServiceConfig, num_reqs: int, g: torch.Generator):
        self.rank, self.world, self.interleave = rank, config.num_shards, config.dcp_interleave
        self.block_size = config.block_size
        num_blocks = config.blocks_per_shard()
        self.pool = BlockPool(num_blocks, shard=rank)
        self.perm = torch.randperm(num_blocks, generator=g).tolist()     # pool id -> physical page
        self.table = BlockTable(num_reqs, 64)
        self.rows = [self.table.add_row() for _ in range(num_reqs)]
        shape = TorchReferenceBackend.get_kv_cache_shape(num_blocks, config.block_size, config.num_kv_heads,
                                                         config.head_size)
        self.cache = torch.full(shape, math.nan, dtype=config.torch_dtype)
        self.runner = ShardLayerRunner(config, TorchReferenceBackend, [self.cache], torch.device("cpu"))

    def allocate_for(self, seq_lens_after: list[int]) -> None:
        """Pages for the tokens this shard owns once the step's tokens are in."""
        local = dcp_local_seq_lens(seq_lens_after, self.world, self.rank, self.interleave).tolist()
        for row, n in zip(self.rows, local):
            need = -(-n // self.block_size) - self.table.num_blocks[row]
            self.table.append(row, [self.perm[b] for b in self.pool.allocate(need)])

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, query_lens: list[int],
               context_lens: list[int], pieces_P3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V this shard owns, then its partial over its context keys and its causal pieces."""
        md = make_dcp_context_metadata(query_lens, context_lens, self.table.gather(self.rows), self.block_size,
                                       self.world, self.rank, self.interleave)
        plan = ShardStepPlan(step_id=0, num_tokens=q.shape[0], metadata=md, causal_pieces=pieces_P3)
        return self.runner.run_layer(self.runner.plan(plan), 0, q, k_new, v_new)


def expected_partial(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], context_lens: list[int],
                     query_lens: list[int], rank: int, world: int, interleave: int, pieces_P3: torch.Tensor,
                     window: int | None = None, soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 oracle of one shard's partial: each query sees the context keys the shard owns and, for the
    rows of its causal pieces (q_start, q_end, k_start), the new keys k_start <= j <= row; all in the window."""
    outs, lses, start = [], [], 0
    for k, v, c, n in zip(keys, values, context_lens, query_lens):
        vis = window_visibility(torch.arange(c, c + n), torch.arange(c + n), window)
        vis[:, :c] &= torch.tensor([owner(p, world, interleave) == rank for p in range(c)], dtype=torch.bool)
        piece = torch.zeros(n, n, dtype=torch.bool)                    # new-token rows x new-token keys
        for qs, qe, ks in pieces_P3.tolist():
            if start <= qs < start + n:
                piece[qs - start:qe - start, ks - start:] = True
        vis[:, c:] &= piece
        # Only the rows and keys this shard can see (a query seeing nothing: out 0, lse -inf): same answer, less work.
        rows, cols = vis.any(dim=1), vis.any(dim=0)
        o = torch.zeros(n, q.shape[1], q.shape[2], dtype=torch.float64)
        l = torch.full((n, q.shape[1]), -math.inf, dtype=torch.float64)
        o[rows], l[rows] = attention_with_visibility(q[start:start + n][rows], k[:c + n][cols], v[:c + n][cols],
                                                     vis[rows][:, cols], soft_cap=soft_cap)
        outs.append(o)
        lses.append(l)
        start += n
    return torch.cat(outs), torch.cat(lses)
