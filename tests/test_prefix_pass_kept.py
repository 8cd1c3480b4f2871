"""A forked batch's prefix pass planned once while it does not change (issue 24: opening a fork step cost ~25 device
copies and launches more than one question's): PrefixSplitter hands every step of a decode run, and the next run
whose table holds the same prefix, the same prefix metadata object; ShardLayerRunner plans its pass once for it,
DecodeGraphs refills its buffers once; a changed prefix is a new pass. Every step exact against float64."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.attention.cascade_plan import PrefixSplitter, split_shared_prefixes
from cpattn.attention.metadata import make_dcp_context_metadata
from cpattn.cluster.decode_graphs import DecodeGraphs
from cpattn.cluster.decode_run_plans import plan_decode_run
from cpattn.cluster.layer_runner import ShardLayerRunner
from cpattn.cluster.step_planner import table_gatherer
from cpattn.kvstore.run_growth import grow_decode_run
from cpattn.kvstore.sharded_allocator import ShardedKVAllocator
from tests.test_cascade_decode_runs import _same_metadata, assert_rows_match_float64

BLOCK = 4


def _runs(num_shards, interleave, lengths, steps, num_runs, block=BLOCK, num_blocks=256):
    """Forks of one source at ``lengths`` (the first the source itself) and ``num_runs`` decode runs of ``steps`` steps
    one after another, each with its own block tables (gathered afresh, as each run's are)."""
    alloc = ShardedKVAllocator(num_shards, num_blocks, block, interleave, max_rows=32)
    source = alloc.add_rows()
    alloc.finish(alloc.grow([(source, max(lengths))], [0]))
    rows = [source] + [alloc.fork_rows(source, n) for n in lengths[1:]]
    runs, lengths = [], list(lengths)
    for i in range(num_runs):
        growths = grow_decode_run(alloc, rows, lengths, steps, first_step=0)
        assert len(growths) == steps
        first = dataclasses.replace(growths[0], copies=[c for g in growths for c in g.copies])
        runs.append(plan_decode_run(alloc, rows, lengths, list(range(i * steps, (i + 1) * steps)),
                                    table_gatherer(alloc, rows, {}), 0, None, None, first, False, 8))
        lengths = [n + steps for n in lengths]
    return runs


@pytest.mark.parametrize("num_shards,interleave,lengths", [(3, 1, [45, 45, 45, 45]), (2, 4, [45, 45, 45, 30, 13, 45]),
                                                           (1, 1, [40, 40, 40])])
def test_runs_of_forks_plan_their_prefix_pass_once_per_prefix_and_stay_exact(num_shards, interleave, lengths):
    """Three runs of four steps through one runner per rank: the pass is built again exactly when a fresh split's
    prefix differs from the last step's (a member's keys grew past a page, or never: the same forks), and every
    request's partial equals float64 attention over the keys its block-table row holds in the cache."""
    from conftest import service_config

    cfg = service_config(num_shards=num_shards, dcp_interleave=interleave, num_layers=1, block_size=BLOCK,
                         num_blocks_per_shard=256)
    runs = _runs(num_shards, interleave, lengths, 4, 3)
    g = torch.Generator().manual_seed(num_shards * 10 + interleave)
    for rank in range(num_shards):
        cache = torch.randn(2, 256, BLOCK, cfg.num_kv_heads, cfg.head_size, generator=g, dtype=torch.float64)
        runner = ShardLayerRunner(cfg, TorchReferenceBackend, [cache], torch.device("cpu"))
        runner.split_prefixes = True   # the split block-table kernels get
        built, build = [], runner._build_prefix
        runner._build_prefix = lambda split: built.append(split) or build(split)
        changes, last, passes = 0, None, set()
        for run in runs:
            for j in range(len(run)):
                plan = run.ranks[rank].plan(j)
                fresh = split_shared_prefixes(plan.metadata, BLOCK)
                assert fresh is not None
                key = (tuple(fresh.rows.tolist()), tuple(fresh.prefix.seq_lens_cpu.tolist()),
                       tuple(fresh.prefix.query_start_loc_cpu.tolist()), tuple(fresh.prefix.block_table_tensor.flatten().tolist()))
                changes += key != last
                last = key
                planned = runner.plan(plan)
                passes.add(id(planned.prefix_pass))
                t = plan.num_tokens
                q, k, v = (torch.randn(t, h, cfg.head_size, generator=g, dtype=torch.float64)
                           for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads))
                out, lse = runner.run_layer(planned, 0, q, k, v)
                assert_rows_match_float64(plan, cache, q, out, lse)
        assert len(built) == changes >= 1   # planned once per distinct prefix, not once per step
        assert len(passes) <= changes


def test_a_new_table_with_the_same_prefix_keeps_the_pass_and_another_prefix_does_not():
    table = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 7], [3, 4, 9, 8]])
    splitter = PrefixSplitter(BLOCK)

    def split(tab, context):
        md = make_dcp_context_metadata([1, 1, 1], context, tab, BLOCK, 1, 0, 1)
        md.block_table_tensor = tab
        kept, fresh = splitter.split(md), split_shared_prefixes(md, BLOCK)
        _same_metadata(kept.suffix, fresh.suffix)
        _same_metadata(kept.prefix, fresh.prefix)
        assert torch.equal(kept.rows, fresh.rows)
        return kept

    first = split(table, [12, 12, 12])
    assert first.prefix.seq_lens_cpu.tolist() == [2 * BLOCK]
    assert split(table, [13, 13, 13]).prefix is first.prefix   # the run's next step
    grown = torch.tensor([[3, 4, 5, 6, 11], [3, 4, 5, 7, 12], [3, 4, 9, 8, 13]])   # the next run: a new, wider table
    again = split(grown, [14, 14, 14])
    assert again.prefix is first.prefix and again.rows is first.rows
    other = split(torch.tensor([[3, 2, 5, 6], [3, 2, 5, 7], [3, 2, 9, 8]]), [12, 12, 12])   # other pages
    assert other.prefix is not first.prefix and other.prefix.block_table_tensor.tolist() == [[3, 2]]
    fewer = split(torch.tensor([[3, 2, 5, 6], [3, 2, 5, 7], [1, 2, 9, 8]]), [12, 12, 12])   # other members
    assert fewer.prefix is not other.prefix and fewer.rows.tolist() == [0, 1]


class _CountingBuilder:
    """A stand-in for a graphed backend's builder: counts what DecodeGraphs.prepare refills."""

    def __init__(self):
        self.refilled = []

    def graph_key(self, md):
        return (md.t, 1, 64)

    def make_static(self, md, key):
        return SimpleNamespace(t=md.t, name="static")

    def refill(self, static, md):
        self.refilled.append(md.name)


def test_graph_buffers_take_a_prefix_pass_once_until_another_comes():
    from cpattn.attention.cascade_plan import PrefixPass

    cfg = SimpleNamespace(num_q_heads=2, num_kv_heads=1, head_size=4, kv_scales=None, block_size=BLOCK,
                          num_layers=1)
    runner = SimpleNamespace(builder=_CountingBuilder(), config=cfg, dtype=torch.float64, device=torch.device("cpu"),
                             kv_format=None)
    graphs = DecodeGraphs(runner)
    graphs._capture = lambda md, key, pp=None: (graphs.make_buffers(md, key, pp), setattr(graphs, "key", key))
    step = SimpleNamespace(t=3, name="step", slot_mapping=torch.zeros(3, dtype=torch.int64))
    one = PrefixPass(SimpleNamespace(t=2, name="prefix-1"), torch.tensor([0, 1]), 0, True)
    two = PrefixPass(SimpleNamespace(t=2, name="prefix-2"), torch.tensor([1, 2]), 1, True)
    none = torch.zeros(0, 3)
    for prefix_pass in (one, one, one, two, two, one):
        assert graphs.prepare(step, None, none, None, prefix_pass)
        assert torch.equal(graphs.prefix.rows, prefix_pass.rows)
    assert runner.builder.refilled == ["step", "prefix-1", "step", "step", "step", "prefix-2", "step", "step",
                                       "prefix-1"]
    graphs.make_buffers(step, graphs.key, one)   # new buffers (a capture) are filled again
    assert graphs.prepare(step, None, none, None, one)
    assert runner.builder.refilled[-2:] == ["step", "prefix-1"] and torch.equal(graphs.prefix.rows, one.rows)


def test_device_metadata_keeps_its_host_slots():
    """A builder asks whether a step writes here from the host slots (a bool() of device slots syncs the GPU)."""
    md = make_dcp_context_metadata([1, 1], [5, 9], torch.tensor([[1, 2, 3], [4, 5, 6]]), BLOCK, 1, 0, 1,
                                   fold_decodes=True)
    moved = md.to("meta")
    assert moved.slot_mapping.device.type == "meta" and moved.slots_on_host() is md.slot_mapping
    assert md.slots_on_host() is md.slot_mapping and moved.to("meta").slots_on_host() is md.slot_mapping


def test_triton_builder_plans_without_reading_device_slots():
    pytest.importorskip("triton")
    from cpattn.attention import AttentionSpec
    from cpattn.attention.backends.triton_attn import TritonMetadataBuilder

    spec = AttentionSpec(4, 2, 16, torch.float16, 16, "meta", (None,), (None,))
    for context, writes in (([5, 9], True), ([0, 0], True)):
        md = make_dcp_context_metadata([1, 1], context, torch.tensor([[1, 2, 3], [4, 5, 6]]), 16, 1, 0, 1,
                                       fold_decodes=True)
        built = TritonMetadataBuilder(spec).build(0, md.to("meta"))   # meta tensors cannot be read: no sync
        assert built.has_writes == writes == bool((md.slot_mapping >= 0).any())
    md = make_dcp_context_metadata([1, 1], [5, 9], torch.tensor([[1, 2, 3], [4, 5, 6]]), 16, 2, 1, 1,
                                   fold_decodes=True)
    md.slot_mapping.fill_(-1)
    assert TritonMetadataBuilder(spec).build(0, md.to("meta")).has_writes is False
