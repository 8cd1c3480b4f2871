"""The FLASHINFER backend's own work on the CPU, FlashInfer's two wrappers replaced by a float64 model of them.

What runs here is cpattn's side: the CSR page table and its request order, decodes before prefills, the plans per
soft cap, the rows of requests with no key, the base-2 LSE, and an fp8 cache's pages dequantised into a scratch the
plans address by renumbered page ids. The model checks what FlashInfer requires of its inputs (the cache's dtype is
the planned kv_data_type, every page id lies inside the cache handed to run) and computes what its kernels define:
each request's paged keys, causal bottom-right for prefills, ``logits_soft_cap`` on the scaled logits, LSE in base
2. Against the TORCH backend in float64 on the same values (``same``) and exact float64 attention before fp8
rounding (``exact``), single rank and DCP shards (tests/kernel_feature_cases.run_case). The kernels themselves are
checked on the GPU (tests/gpu/test_backend_features_gpu.py).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from tests.kernel_feature_cases import check_cpu_model_case, outlier_batch, rel

MIXED = ([1, 7, 1, 33, 5, 1, 30], [40, 0, 500, 10, 250, 0, 300])
EXACT_BOUND = {None: 1e-6, "fp8_e4m3": 1e-1, "fp8_e5m2": 2e-1}


class _Wrapper:
    """One planned FlashInfer wrapper: the page table it was planned with, then attention over it in float64."""

    prefill = False

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.plan_args = None

    def _plan(self, qo_indptr, indptr, indices, last_page_len, hq, hk, d, page_size, causal, q_data_type,
              kv_data_type, sm_scale, logits_soft_cap=None, window_left=-1, packed_custom_mask=None):
        assert indices.dtype == indptr.dtype == last_page_len.dtype == torch.int32
        mask = None
        if packed_custom_mask is not None:   # one request: its bits little-endian in bytes (variants.cuh)
            assert packed_custom_mask.dtype == torch.uint8 and not causal and qo_indptr.numel() == 2
            bits = (packed_custom_mask.cpu()[:, None].long() >> torch.arange(8)) & 1
            mask = bits.flatten().bool()
        self.plan_args = dict(qo=qo_indptr.long().tolist(), indptr=indptr.long().tolist(), indices=indices.long(),
                              last=last_page_len.long().tolist(), hq=hq, hk=hk, d=d, ps=page_size, causal=causal,
                              kv_dtype=kv_data_type, scale=sm_scale, cap=logits_soft_cap, left=window_left,
                              mask=mask)

    def run(self, q, paged, return_lse=False):
        p = self.plan_args
        k_cache, v_cache = paged
        assert k_cache.dtype == v_cache.dtype == p["kv_dtype"], "the cache handed to run is not the planned dtype"
        assert not p["indices"].numel() or int(p["indices"].max()) < k_cache.shape[0], "a planned page lies outside"
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
        mask_at = 0
        for r in range(len(p["last"])):
            pages = p["indices"][p["indptr"][r]:p["indptr"][r + 1]]
            n = (pages.numel() - 1) * p["ps"] + p["last"][r]
            k = k_cache[pages].reshape(-1, p["hk"], p["d"])[:n].double().repeat_interleave(p["hq"] // p["hk"], 1)
            v = v_cache[pages].reshape(-1, p["hk"], p["d"])[:n].double().repeat_interleave(p["hq"] // p["hk"], 1)
            q0, q1 = p["qo"][r], p["qo"][r + 1]
            s = torch.einsum("tqd,lqd->qtl", q[q0:q1].double(), k) * p["scale"]
            if p["cap"] is not None:
                s = p["cap"] * torch.tanh(s / p["cap"])
            m, keys, rows = q1 - q0, torch.arange(n)[None, :], torch.arange(q1 - q0)[:, None]
            if p["causal"]:   # bottom-right: query i of m sees keys j <= n - m + i
                s = s.masked_fill(keys > n - m + rows, -math.inf)
            if p["left"] >= 0:   # variants.cuh: kept iff kv_idx + qo_len + window_left >= kv_len + qo_idx
                s = s.masked_fill(keys + m + p["left"] < n + rows, -math.inf)
            if p["mask"] is not None:   # row-major per request, requests one after another
                s = s.masked_fill(~p["mask"][mask_at:mask_at + m * n].view(m, n).cpu(), -math.inf)
                mask_at += m * n
            assert bool((s > -math.inf).any(-1).all()), "a planned query sees no key (FlashInfer's row would be NaN)"
            out[q0:q1] = torch.einsum("qtl,lqd->tqd", s.softmax(-1), v)
            lse[q0:q1] = (s.logsumexp(-1) / math.log(2)).T   # FlashInfer's LSE is base 2
        return out.to(q.dtype), lse.float()


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last_page_len, hq, hk, d, page_size, **kw):
        self._plan(torch.arange(indptr.numel()), indptr, indices, last_page_len, hq, hk, d, page_size, False, **kw)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, hq, hk, d, page_size, causal, **kw):
        self._plan(qo_indptr, indptr, indices, last_page_len, hq, hk, d, page_size, causal, **kw)


@pytest.fixture
def flashinfer_model(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper, fake.BatchPrefillWithPagedKVCacheWrapper = _Decode, _Prefill
    fake.__version__ = "model"
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from cpattn.attention.backends import flashinfer

    monkeypatch.setattr(flashinfer, "WORKSPACE_BYTES", 1024)
    return flashinfer.FlashInferBackend


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("cap, window", [(None, None), (5.0, None), (None, 37), (5.0, 100)])
@pytest.mark.parametrize("world, interleave", [(1, 1), (3, 1), (2, 16)])
def test_flashinfer_backend_vs_float64(flashinfer_model, fmt, cap, window, world, interleave):
    """Decodes and prefills in one step, random page placement, GQA; an fp8 cache read through its dequantised
    pages; DCP shards (one with no key of some requests) merged by LSE after the base-2 conversion; sliding windows
    on global positions (a shard's per-query windows as plans by window_left, or a custom mask)."""
    check_cpu_model_case(flashinfer_model, MIXED, window, cap, fmt, world, interleave, EXACT_BOUND[fmt])


def test_an_fp8_plan_addresses_only_the_pages_the_step_reads(flashinfer_model):
    """The scratch holds the step's distinct pages once each (not the whole cache), in the plans' numbering."""
    from tests.kernel_feature_cases import spec, to_fp8
    from cpattn.attention import make_causal_metadata

    b = outlier_batch([1, 1, 4], [40, 17, 30], 8, 2, 16, 16, torch.float32, "cpu", seed=3)
    md = make_causal_metadata(b.query_lens, b.context_lens, b.block_table, b.block_size)
    cache, scales = to_fp8(b.kv_cache, md.slot_mapping, b.k, b.v, "fp8_e4m3")
    s = spec(b, torch.float32, "cpu", None, None, "fp8_e4m3")
    plan = flashinfer_model.get_builder_cls()(s).build(0, md)
    read = sorted({int(x) for row, n in zip(b.block_table.tolist(), [41, 18, 34]) for x in row[:-(-n // 16)]})
    assert plan.fp8_pages.tolist() == read and len(read) < cache.shape[1]
    for wrapper in (*plan.decode_wrapper.values(), *plan.prefill_wrapper.values()):
        assert wrapper.plan_args["kv_dtype"] == torch.float32
        assert set(wrapper.plan_args["indices"].tolist()) <= set(range(len(read)))


def _seen_by_plan(kind, left, causal, vr, i, m):
    """The local keys FlashInfer's rule lets query i (of m) of a virtual request see (flashinfer_windows)."""
    n = vr.key_end - vr.key_start
    keys = torch.arange(n)
    keep = torch.ones(n, dtype=torch.bool)
    if kind == "masked":
        assert vr is not None and left == vr.request
        first, end = vr.mask
        keep &= (keys + vr.key_start >= first[i]) & (keys + vr.key_start < end[i])
    else:
        if causal and kind == "prefill":
            keep &= keys <= n - m + i
        if left >= 0:   # variants.cuh's rule
            keep &= keys + m + left >= n + i
    return set((keys[keep] + vr.key_start).tolist())


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (3, 1), (2, 4), (3, 16)])
def test_window_plans_give_each_query_exactly_its_window(world, interleave):
    """Each query's visible local keys under the plans (decode/prefill by window_left, or masked) are exactly those
    of its window on global positions; a query that sees none here is in no plan; no page wholly before every
    window of a request is read; single-rank chunks need no mask."""
    from cpattn.attention import make_causal_metadata
    from cpattn.attention.backends.flashinfer_windows import window_groups
    from cpattn.attention.metadata import make_dcp_context_metadata

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    b, ps = int(torch.randint(1, 7, (), generator=g)), int(torch.tensor([1, 4, 16])[torch.randint(3, (), generator=g)])
    q_lens = [int(x) if torch.rand((), generator=g) < 0.6 else 1 for x in torch.randint(0, 70, (b,), generator=g)]
    c_lens = torch.randint(0, 400, (b,), generator=g).tolist()
    q_lens, c_lens = q_lens + [1, 20], c_lens + [300, 300]   # a decode and a chunk past the window, always
    window = int(torch.randint(1, 120, (), generator=g))
    table = torch.arange((b + 2) * 512).view(b + 2, 512)
    mds = ([make_causal_metadata(q_lens, c_lens, table, ps)] if world == 1 else [])
    mds += [make_dcp_context_metadata(q_lens, c_lens, table, ps, world, r, interleave) for r in range(world)]
    what = f"q={q_lens} c={c_lens} W={window} ps={ps} N={world} I={interleave}"
    for md in mds:
        first = md.window_key_start(window)
        qsl, lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
        want = {}
        for r in range(md.num_reqs):
            m = qsl[r + 1] - qsl[r]
            for j in range(m):
                end = lens[r] - m + 1 + j if md.causal else lens[r]
                want[qsl[r] + j] = set(range(int(first[qsl[r] + j]), end))
        got = {}
        groups = window_groups(md, window, ps)
        for (kind, left), vrs in groups.by_plan.items():
            for vr in vrs:
                assert vr.key_start % ps == 0 and vr.key_start <= int(first[vr.first_row]) < vr.key_start + ps, what
                for i in range(vr.num_rows):
                    assert vr.first_row + i not in got, what
                    got[vr.first_row + i] = _seen_by_plan(kind, left, md.causal, vr, i, vr.num_rows)
        for row, keys in want.items():
            assert got.get(row, set()) == keys, f"{what}: row {row}"
        if md.dcp_world_size == 1 or interleave * world == 1:
            assert not any(kind == "masked" for kind, _ in groups.by_plan), what


def test_which_plans_a_window_takes(monkeypatch):
    """One shard: decodes share one count and a chunk follows FlashInfer's rule (no mask); two shards at interleave 1:
    a chunk's first keys rise every other query, so it is masked, one plan of its own, its bits packed as FlashInfer
    reads them (the same when built a few rows at a time)."""
    from cpattn.attention import make_causal_metadata
    from cpattn.attention.backends import flashinfer_windows
    from cpattn.attention.backends.flashinfer_windows import packed_mask, window_groups
    from cpattn.attention.metadata import make_dcp_context_metadata

    q, c, table = [1, 1, 20, 9], [300, 5000, 300, 4000], torch.arange(4 * 400).view(4, 400)
    one = window_groups(make_causal_metadata(q, c, table, 16), 100, 16).by_plan
    assert {key: [vr.request for vr in vrs] for key, vrs in one.items()} == {("decode", 99): [0, 1],
                                                                            ("prefill", 99): [2, 3]}
    two = window_groups(make_dcp_context_metadata(q, c, table, 16, 2, 0, 1), 100, 16).by_plan
    assert sorted(two) == [("decode", 48), ("masked", 2), ("masked", 3)]   # even positions of [p - 99, p)
    vr = two[("masked", 2)][0]
    whole = packed_mask(vr, torch.device("cpu"))
    monkeypatch.setattr(flashinfer_windows, "MASK_BLOCK_BYTES", 8 * 30)   # blocks of 8 rows
    assert torch.equal(packed_mask(vr, torch.device("cpu")), whole)
    bits = (whole[:, None].long() >> torch.arange(8)) & 1
    first, end = vr.mask
    keys = torch.arange(vr.key_start, vr.key_end)
    want = (keys[None] >= first[:, None]) & (keys[None] < end[:, None])
    bits = bits.flatten()
    assert torch.equal(bits[:want.numel()].view_as(want).bool(), want) and not bits[want.numel():].any()


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
@pytest.mark.parametrize("world", [1, 3])
def test_full_and_windowed_layers_share_one_plan(flashinfer_model, fmt, world):
    """Layers (None, 64) planned once per step: the full layer on the plain plans, the windowed one on its own, an fp8
    cache's scratch holding the pages of both (renumbered once); each layer vs TORCH in float64 on the same values."""
    from cpattn.attention import AttentionSpec, make_causal_metadata
    from cpattn.attention.backends.torch_ref import TorchAttentionImpl, TorchMetadataBuilder
    from tests.gpu.batches import dcp_shards
    from tests.kernel_feature_cases import to_fp8

    b = outlier_batch([1, 20, 1], [300, 100, 40], 8, 2, 16, 16, torch.float32, "cpu", seed=9)
    shards = ([(make_causal_metadata(b.query_lens, b.context_lens, b.block_table, b.block_size), b.kv_cache)]
              if world == 1 else [(sh.md, sh.kv_cache) for sh in dcp_shards(b, world, 1, "cpu")])
    for md, cache in shards:
        scales = None
        if fmt is not None:
            cache, scales = to_fp8(cache, md.slot_mapping, b.k, b.v, fmt)
        s = AttentionSpec(8, 2, 16, torch.float32, 16, "cpu", sliding_windows=(None, 64), kv_cache_dtype=fmt or "auto")
        plan = flashinfer_model.get_builder_cls()(s).build(0, md)
        impl = flashinfer_model.get_impl_cls()(s)
        extra = {} if scales is None else {"kv_scale": scales}
        for layer, window in enumerate((None, 64)):
            out, _ = impl.forward(layer, b.q, b.k, b.v, cache.clone(), plan, **extra)
            s64 = AttentionSpec(8, 2, 16, torch.float64, 16, "cpu", sliding_windows=(window,))
            ref, _ = TorchAttentionImpl(s64).forward(0, b.q.double(), b.k.double(), b.v.double(),
                                                     cache.clone() if scales is not None else cache.double(),
                                                     TorchMetadataBuilder(s64).build(0, md), **extra)
            assert rel(out, ref) < 1e-5, f"layer {layer} world {world} fmt {fmt}"
