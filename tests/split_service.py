"""A prefill step's data path when the client computes some ranks in its own process, without Ray (issue 18).

What the service runs, in one process: the coordinator's planner with the remote ranks' wire cost (the causal part
split by time, attention/pcp.py), select_wire per rank, the client's ranks on the step's full q/k/v, each remote
rank's own message packed (wire_select.pack_own_message) and handed over as its receiver would (OwnLayers, compact
where the runner planned the step so), and the client's row merge. Used by tests/test_prefill_split.py (CPU, float64)
and tests/gpu/test_prefill_split_gpu.py.
"""

from __future__ import annotations

import torch

from cpattn.attention.ops.merge import merge_rows
from cpattn.attention.pcp import WireCost
from cpattn.cluster.data_plane import CMD_ATTEND
from cpattn.cluster.shard import ShardWorker
from cpattn.cluster.step_planner import StepRequest, plan_step
from cpattn.cluster.wire_select import OwnLayers, layer_header, pack_own_message, rows_disjoint, select_wire
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator


class SplitService:
    def __init__(self, cfg, local: tuple[int, ...] = (0,), flops_per_byte: float = 1.0, wire: str = "per_rank"):
        threads = torch.get_num_threads()
        self.cfg = cfg
        self.workers = [ShardWorker(cfg, r) for r in range(cfg.num_shards)]
        torch.set_num_threads(threads)       # ShardWorker pins its process to num_cpus_per_shard threads
        self.device = self.workers[0].device
        self.alloc = ShardedKVAllocator(cfg.num_shards, cfg.blocks_per_shard(), cfg.block_size,
                                        cfg.dcp_interleave, max_rows=4, replicas=cfg.kv_replicas)
        self.local, self.wire = tuple(local), wire
        self.cost = WireCost.of([r for r in range(cfg.num_shards) if r not in local], cfg.num_q_heads,
                                cfg.num_kv_heads, cfg.head_size, cfg.torch_dtype.itemsize, flops_per_byte)
        self.rows, self.lens, self.step_id = [], [], 0
        self.last_plans, self.last_planned = None, None

    def add(self) -> int:
        self.rows.append(self.alloc.add_rows())
        self.lens.append(0)
        return len(self.rows) - 1

    def step(self, request: dict[int, int], layers_qkv, sinks) -> list[torch.Tensor]:
        cfg = self.cfg
        reqs = [StepRequest(self.rows[s], self.lens[s], n) for s, n in request.items()]
        self.alloc.grow([(self.rows[s], self.lens[s] + n) for s, n in request.items()])
        self.step_id += 1
        plans = plan_step(self.alloc, reqs, self.step_id, cfg.pcp_enabled, cfg.pcp_min_tokens,
                          row_window=cfg.row_window(), wire_cost=self.cost)
        t = plans[0].num_tokens
        select_wire(plans, self.local, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.torch_dtype.itemsize,
                    self.wire, "nccl")   # broadcast: every remote rank gets the step's q/k/v whole
        planned = [w.runner.plan(p, compact=r not in self.local and p.selected)
                   for r, (w, p) in enumerate(zip(self.workers, plans))]
        own = {r: OwnLayers(p, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size, cfg.torch_dtype, self.device,
                            compact=pl.new_tokens_only is not None and pl.new_tokens_only.compact)
               for r, (p, pl) in enumerate(zip(plans, planned)) if r not in self.local and p.selected}
        self.last_plans, self.last_planned = plans, planned
        disjoint = rows_disjoint([p.rows for p in plans if p.num_rows], t)
        outs = []
        for layer, qkv in enumerate(layers_qkv):
            q, k, v = (x.to(self.device, cfg.torch_dtype) for x in qkv)
            parts = []
            for r, (w, p, pl) in enumerate(zip(self.workers, plans, planned)):
                inputs = (q, k, v)
                if r in own:
                    header = layer_header(CMD_ATTEND, layer, self.step_id, t, self.device)
                    message = pack_own_message(header, q, k, v, None if p.rows is None else p.rows.to(self.device),
                                               None if p.kv_rows is None else p.kv_rows.to(self.device))
                    inputs = own[r].unpack(message)[1:]
                out, lse = w.runner.run_layer(pl, layer, *inputs)
                if p.num_rows:
                    parts.append((None if p.rows is None else p.rows.to(self.device), out, lse))
            outs.append(merge_rows(parts, t, sinks[layer], disjoint))
        for s, n in request.items():
            self.lens[s] += n
        return outs
