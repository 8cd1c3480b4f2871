"""Seed 000's invariants, as property tests where they apply to the kvstore and attention layers.

1/2 one plan serves every layer unchanged; 3 query_start_loc; 4 seq_len - query_len = context;
5 block ids belong to their request with the KV tensor's page geometry; 6 slots fall in owned pages;
7 the decode/prefill reorder is one permutation. (8 CUDA-graph addresses and 9 device-truth lengths
concern GPU backends and are not exercised on CPU.)
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn.attention import AttentionSpec, make_causal_metadata, make_dcp_context_metadata
from cpattn.attention.backends.torch_ref import TorchReferenceBackend
from cpattn.attention.batch_split import split_decodes_and_prefills
from cpattn.errors import InvalidRequestError
from cpattn.kvstore import PAD_BLOCK_ID, PAD_SLOT_ID, BlockPool, BlockTable, dcp_local_seq_lens
from tests.reference import reference_attention

PROPS = settings(max_examples=30, deadline=None)

# A batch: per request (context_len, query_len); query 0 allowed (a request idle this step).
batches = st.lists(st.tuples(st.integers(0, 80), st.integers(0, 20)), min_size=1, max_size=6)


def _allocate_interleaved(batch, block_size, pool, table, rnd):
    """Grow each request's row in random order, a page or two at a time, so ids interleave."""
    rows = [table.add_row() for _ in batch]
    owned = {row: [] for row in rows}
    need = {row: -(-(c + q) // block_size) for row, (c, q) in zip(rows, batch)}
    while any(len(owned[r]) < need[r] for r in rows):
        r = rnd.choice([r for r in rows if len(owned[r]) < need[r]])
        got = pool.allocate(min(rnd.randint(1, 2), need[r] - len(owned[r])))
        table.append(r, got)
        owned[r] += got
    return rows, owned


@PROPS
@given(batches, st.sampled_from([1, 4, 16]), st.randoms(use_true_random=False))
def test_causal_metadata_invariants(batch, block_size, rnd):
    pool, table = BlockPool(1000), BlockTable(8, 110)
    # Another request holds (and frees) pages first, so reused ids are in play.
    other = table.add_row()
    table.append(other, pool.allocate(rnd.randint(0, 10)))
    rows, owned = _allocate_interleaved(batch, block_size, pool, table, rnd)
    pool.free(table.remove_row(other))
    ctx = [c for c, _ in batch]
    ql = [q for _, q in batch]
    md = make_causal_metadata(ql, ctx, table.gather(rows), block_size)

    # 3. query_start_loc starts at 0, never decreases, ends at the real token count.
    qsl = md.query_start_loc_cpu.tolist()
    assert qsl[0] == 0 and qsl[-1] == sum(ql) == md.num_actual_tokens
    assert all(a <= b for a, b in zip(qsl, qsl[1:]))
    assert torch.equal(md.query_start_loc, md.query_start_loc_cpu)
    assert md.query_lens_cpu.tolist() == ql and md.max_query_len == max(ql)
    # 4. seq_len - query_len = context readable before the step.
    assert (md.seq_lens_cpu - md.query_lens_cpu).tolist() == ctx == md.context_lens_cpu.tolist()
    assert md.max_seq_len == max(c + q for c, q in batch)
    # 5. Every valid id belongs to the request, and covers its tokens at block_size per page.
    for i, row in enumerate(rows):
        ids = [b for b in md.block_table_tensor[i].tolist() if b != PAD_BLOCK_ID]
        assert ids == owned[row]
        assert len(ids) * block_size >= int(md.seq_lens_cpu[i]) > (len(ids) - 1) * block_size or not ids
    # 6. Every non-padding slot falls in a page its request owns, at the token's offset; slots distinct.
    slots = md.slot_mapping.tolist()
    assert md.slot_mapping.dtype == torch.int64 and len(slots) == sum(ql)
    t = 0
    for i, (c, q) in enumerate(batch):
        for j in range(q):
            s = slots[t]
            assert s != PAD_SLOT_ID and s // block_size in owned[rows[i]]
            assert s // block_size == owned[rows[i]][(c + j) // block_size] and s % block_size == (c + j) % block_size
            t += 1
    assert len(set(slots)) == len(slots)


@PROPS
@given(batches, st.integers(1, 5), st.sampled_from([1, 2, 8]), st.data())
def test_dcp_metadata_invariants(batch, world, interleave, data):
    block_size = 8
    rank = data.draw(st.integers(0, world - 1))
    ctx = [c for c, _ in batch]
    ql = [q for _, q in batch]
    after = dcp_local_seq_lens([c + q for c, q in batch], world, rank, interleave).tolist()
    pool, table = BlockPool(200), BlockTable(8, 100)
    rows = [table.add_row() for _ in batch]
    for row, n in zip(rows, after):
        table.append(row, pool.allocate(-(-n // block_size)))
    md = make_dcp_context_metadata(ql, ctx, table.gather(rows), block_size, world, rank, interleave)
    qsl = md.query_start_loc_cpu.tolist()
    assert qsl[0] == 0 and qsl[-1] == sum(ql) and all(a <= b for a, b in zip(qsl, qsl[1:]))
    assert not md.causal
    # Local context = the context tokens this rank owns (brute force).
    local_ctx = [sum((p // interleave) % world == rank for p in range(c)) for c in ctx]
    assert md.seq_lens_cpu.tolist() == local_ctx == md.context_lens_cpu.tolist()
    # Slots: exactly the owned new tokens get one, inside their request's pages, at the next local offsets.
    slots = md.slot_mapping.tolist()
    t = 0
    for i, (c, q) in enumerate(batch):
        local = local_ctx[i]
        for j in range(q):
            p = c + j
            if (p // interleave) % world == rank:
                assert slots[t] // block_size == table.row(rows[i])[local // block_size]
                assert slots[t] % block_size == local % block_size
                local += 1
            else:
                assert slots[t] == PAD_SLOT_ID
            t += 1
        assert local == after[i]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=6),
       st.sampled_from([1, 2]), st.integers(0, 2**31 - 1))
def test_batch_reorder_is_one_permutation(batch, threshold, seed):
    """Reorder q/k/v, rows and block table; run; un-reorder the output == running without reorder."""
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, bs = 4, 2, 16, 4
    ctx = [c for c, _ in batch]
    ql = [q for _, q in batch]
    seq = [c + q for c, q in batch]
    pages = [-(-n // bs) for n in seq]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(batch), max(max(pages), 1)), PAD_BLOCK_ID, dtype=torch.int64)
    for r, p in enumerate(pages):
        table[r, :p] = torch.tensor([perm.pop() for _ in range(p)], dtype=torch.int64)
    keys = [torch.randn(n, hk, d, generator=g, dtype=torch.float64) for n in seq]
    values = [torch.randn(n, hk, d, generator=g, dtype=torch.float64) for n in seq]
    cache = torch.full((2, num_blocks, bs, hk, d), math.nan, dtype=torch.float64)
    for r, c in enumerate(ctx):
        for p in range(c):
            cache[0, table[r, p // bs], p % bs] = keys[r][p]
            cache[1, table[r, p // bs], p % bs] = values[r][p]
    q = torch.randn(sum(ql), hq, d, generator=g, dtype=torch.float64)
    k_new = torch.cat([k[c:] for k, c in zip(keys, ctx)])
    v_new = torch.cat([v[c:] for v, c in zip(values, ctx)])
    spec = AttentionSpec(hq, hk, d, torch.float64, bs)
    impl = TorchReferenceBackend.get_impl_cls()(spec)

    cache_a = cache.clone()
    out_a, lse_a = impl.forward(0, q, k_new, v_new, cache_a, make_causal_metadata(ql, ctx, table, bs))

    qsl = torch.zeros(len(batch) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(ql), 0)
    split = split_decodes_and_prefills(qsl, decode_threshold=threshold)
    order = split.request_order.tolist()
    tok = split.token_order
    assert sorted(order) == list(range(len(batch))) and sorted(tok.tolist()) == list(range(sum(ql)))
    new_ql = [ql[r] for r in order]
    assert all(n <= threshold for n in new_ql[:split.num_decodes])
    assert all(n > threshold for n in new_ql[split.num_decodes:])
    assert split.num_decode_tokens == sum(new_ql[:split.num_decodes])
    assert split.num_prefill_tokens == sum(new_ql[split.num_decodes:])
    assert split.query_start_loc[-1] == sum(ql)
    assert split.prefill_qo_indptr.tolist() == [x - int(split.query_start_loc[split.num_decodes])
                                                for x in split.query_start_loc[split.num_decodes:].tolist()]
    # token_order is the request permutation applied to token ranges (one permutation for everything).
    assert tok.tolist() == [t for r in order for t in range(int(qsl[r]), int(qsl[r + 1]))]
    decodes = [r for r in range(len(batch)) if ql[r] <= threshold]
    assert order == decodes + [r for r in range(len(batch)) if ql[r] > threshold]   # stable

    cache_b = cache.clone()
    md_b = make_causal_metadata(new_ql, [ctx[r] for r in order], table[split.request_order], bs)
    assert torch.equal(md_b.query_start_loc_cpu, split.query_start_loc)
    out_b, lse_b = impl.forward(0, q[tok], k_new[tok], v_new[tok], cache_b, md_b)
    out_back = torch.empty_like(out_b)
    lse_back = torch.empty_like(lse_b)
    out_back[tok] = out_b
    lse_back[tok] = lse_b
    assert torch.equal(out_back, out_a) and torch.equal(lse_back, lse_a)
    assert torch.equal(cache_a.nan_to_num(7.0), cache_b.nan_to_num(7.0))   # KV written to the same slots
    ref_out, ref_lse = reference_attention(q, keys, values, ql)
    torch.testing.assert_close(out_a, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse_a, ref_lse, atol=1e-10, rtol=1e-10)


def test_one_plan_serves_every_layer_unchanged():
    """Invariants 1/2: the builder plans once; each layer (own cache, own q/k/v) reuses the plan unchanged."""
    g = torch.Generator().manual_seed(99)
    hq, hk, d, bs = 8, 2, 32, 16
    ctx, ql = [20, 0, 33], [1, 6, 2]
    seq = [c + q for c, q in zip(ctx, ql)]
    table = torch.tensor([[4, 0, PAD_BLOCK_ID], [2, PAD_BLOCK_ID, PAD_BLOCK_ID], [5, 1, 3]], dtype=torch.int64)
    spec = AttentionSpec(hq, hk, d, torch.float64, bs)
    plan = TorchReferenceBackend.get_builder_cls()(spec).build(0, make_causal_metadata(ql, ctx, table, bs))
    snapshot = {k: v.clone() for k, v in vars(plan).items() if isinstance(v, torch.Tensor)}
    impl = TorchReferenceBackend.get_impl_cls()(spec)
    for layer in range(3):
        keys = [torch.randn(n, hk, d, generator=g, dtype=torch.float64) for n in seq]
        values = [torch.randn(n, hk, d, generator=g, dtype=torch.float64) for n in seq]
        cache = torch.zeros(2, 6, bs, hk, d, dtype=torch.float64)
        for r, c in enumerate(ctx):
            for p in range(c):
                cache[0, table[r, p // bs], p % bs] = keys[r][p]
                cache[1, table[r, p // bs], p % bs] = values[r][p]
        q = torch.randn(sum(ql), hq, d, generator=g, dtype=torch.float64)
        out, lse = impl.forward(layer, q, torch.cat([k[c:] for k, c in zip(keys, ctx)]),
                                torch.cat([v[c:] for v, c in zip(values, ctx)]), cache, plan)
        ref_out, ref_lse = reference_attention(q, keys, values, ql)
        torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
        for name, before in snapshot.items():
            assert torch.equal(getattr(plan, name), before), name


@pytest.mark.parametrize("call, match", [
    (lambda t: make_causal_metadata([1, -1], [0, 3], t, 16), r"query_lens must be >= 0, got \[1, -1\]"),
    (lambda t: make_causal_metadata([1, 1], [-2, 3], t, 16), r"context_lens must be >= 0, got \[-2, 3\]"),
    (lambda t: make_causal_metadata([1], [0, 3], t, 16), r"query_lens \(1\) and context_lens \(2\)"),
    (lambda t: make_causal_metadata([1, 1, 1], [0, 3, 0], t, 16), r"block_table rows \(2\)"),
    (lambda t: make_causal_metadata([1, 100], [0, 3], t, 16), r"position 32 needs page 2.*width is 2"),
    (lambda t: make_dcp_context_metadata([1, -1], [0, 3], t, 16, 2, 0, 1), r"query_lens must be >= 0"),
    (lambda t: make_dcp_context_metadata([1, 1], [0, 3], t, 16, 2, 2, 1), "rank 2 out of range for world_size 2"),
    (lambda t: make_dcp_context_metadata([1], [0], t, 16, 2, 0, 1), r"2 rows for 1 requests"),
])
def test_metadata_bad_inputs(call, match):
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    with pytest.raises(InvalidRequestError, match=match):
        call(table)
