"""kvstore: block pool, block table, slot mapping, DCP sharding, CSR, kernel-block views.

Every check compares against a brute-force model written here (plain Python lists and loops).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn.errors import CapacityError, CpattnError, InvalidRequestError
from cpattn.kvstore import (PAD_BLOCK_ID, PAD_SLOT_ID, BlockPool, BlockTable, MultipleOf, block_table_to_csr,
                            compute_slot_mapping, dcp_local_position, dcp_local_seq_len, dcp_local_seq_lens, dcp_owner_rank,
                            expand_block_table, kernel_kv_view, select_common_kernel_block_size)

FAST = settings(max_examples=40, deadline=None)


# Block pool --------------------------------------------------------------------------------------

def test_pool_allocate_free_roundtrip():
    pool = BlockPool(8)
    assert pool.can_allocate(8) and not pool.can_allocate(9) and not pool.can_allocate(-1)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and set(a).isdisjoint(b)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 8
    assert pool.allocate(0) == []
    pool.free(a)
    assert pool.num_free_blocks == 3 and all(pool.ref_count(x) == 0 for x in a)
    assert sorted(pool.allocate(3)) == sorted(a)


def test_pool_capacity_error_names_asked_and_free_and_changes_nothing():
    pool = BlockPool(10, shard=3)
    held = pool.allocate(7)
    with pytest.raises(CapacityError, match=r"shard 3.*needs 5 KV blocks, 3 free of 10") as info:
        pool.allocate(5)
    assert (info.value.shard, info.value.needed, info.value.free) == (3, 5, 3)
    assert pool.num_free_blocks == 3 and all(pool.ref_count(b) == 1 for b in held)
    assert len(pool.allocate(3)) == 3


def test_pool_double_free_raises_and_changes_nothing():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    pool.free(blocks[:1])
    before = ([pool.ref_count(b) for b in range(6)], pool.num_free_blocks)
    with pytest.raises(CpattnError, match=f"block {blocks[0]}"):
        pool.free([blocks[1], blocks[0]])          # one good id, one already free
    with pytest.raises(CpattnError, match=f"double free of block {blocks[2]}"):
        pool.free([blocks[2], blocks[2]])          # the same id twice in one call, refcount 1
    assert ([pool.ref_count(b) for b in range(6)], pool.num_free_blocks) == before
    with pytest.raises(CpattnError, match="block 17"):
        pool.free([17])


def test_pool_refcounts_shared_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.incref(blocks[:1])
    assert [pool.ref_count(b) for b in blocks] == [3, 2]
    pool.free(blocks)
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 3 and pool.ref_count(blocks[0]) == 1
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(CpattnError, match="free"):
        pool.incref(blocks[:1])


def test_pool_bad_arguments():
    with pytest.raises(InvalidRequestError, match="num_blocks 0"):
        BlockPool(0)
    with pytest.raises(InvalidRequestError, match="-2"):
        BlockPool(4).allocate(-2)


@FAST
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "incref"]), st.integers(0, 6), st.integers(0, 99)),
                max_size=40))
def test_pool_matches_refcount_model(ops):
    num_blocks = 12
    pool = BlockPool(num_blocks)
    refs = [0] * num_blocks
    held: list[int] = []
    for op, n, pick in ops:
        if op == "alloc":
            free_now = refs.count(0)
            assert pool.can_allocate(n) == (n <= free_now)
            if n <= free_now:
                got = pool.allocate(n)
                assert len(set(got)) == n and all(refs[b] == 0 for b in got)
                for b in got:
                    refs[b] = 1
                held += got
            else:
                with pytest.raises(CapacityError):
                    pool.allocate(n)
        elif held:
            b = held[pick % len(held)]
            if op == "free":
                pool.free([b])
                refs[b] -= 1
                held.remove(b)
            else:
                pool.incref([b])
                refs[b] += 1
                held.append(b)
        assert [pool.ref_count(b) for b in range(num_blocks)] == refs
        assert pool.num_free_blocks == refs.count(0)


# Block table -------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "shrink", "remove"]), st.integers(0, 99),
                          st.integers(0, 40)), min_size=1, max_size=60))
def test_block_table_never_shows_stale_ids(ops):
    """Growing, truncating, freeing and reusing rows: a row shows exactly its own ids, then padding.

    Block ids come from a pool, so an id another request held and freed is the likeliest stale value.
    """
    max_rows, width = 20, 90            # beyond the table's initial 16 x 64, so it grows too
    table = BlockTable(max_rows, width)
    pool = BlockPool(400)
    model: dict[int, list[int]] = {}
    for op, pick, n in ops:
        live = sorted(model)
        if op == "add" or not live:
            if table.can_add_row():
                row = table.add_row()
                assert row not in model
                model[row] = []
            continue
        row = live[pick % len(live)]
        if op == "grow":
            n = min(n, width - len(model[row]), pool.num_free_blocks)
            assert table.can_append(row, n)
            new = pool.allocate(n)
            table.append(row, new)
            model[row] += new
        elif op == "shrink":
            keep = min(n, len(model[row]))
            dropped = table.truncate(row, keep)
            assert dropped == model[row][keep:]
            pool.free(dropped)
            model[row] = model[row][:keep]
        else:
            dropped = table.remove_row(row)
            assert dropped == model.pop(row)
            pool.free(dropped)
        for r, ids in model.items():
            assert table.row(r) == ids
            full = table.gather([r], width=width)[0].tolist()
            assert full == ids + [PAD_BLOCK_ID] * (width - len(ids))
        if model:
            rows = sorted(model)
            batch = table.gather(rows)
            for i, r in enumerate(rows):
                valid = [b for b in batch[i].tolist() if b != PAD_BLOCK_ID]
                assert valid == model[r]
    assert not table.can_append(0, width + 1)


def test_block_table_reused_row_starts_empty():
    table = BlockTable(1, 8)
    row = table.add_row()
    table.append(row, [5, 6, 7])
    assert table.remove_row(row) == [5, 6, 7]
    again = table.add_row()
    assert again == row and table.row(again) == []
    assert table.gather([again], width=8)[0].tolist() == [PAD_BLOCK_ID] * 8
    assert not table.can_add_row()
    with pytest.raises(InvalidRequestError, match="all 1 rows in use"):
        table.add_row()


def test_block_table_bad_arguments():
    table = BlockTable(2, 3)
    row = table.add_row()
    with pytest.raises(InvalidRequestError, match="4 more exceed the width 3"):
        table.append(row, [1, 2, 3, 4])
    with pytest.raises(InvalidRequestError, match="-1"):
        table.truncate(row, -1)
    with pytest.raises(InvalidRequestError, match="0 x 3"):
        BlockTable(0, 3)


# Slot mapping ------------------------------------------------------------------------------------

@FAST
@given(st.integers(1, 4), st.sampled_from([1, 4, 16]), st.randoms(use_true_random=False))
def test_slot_mapping_brute_force(num_reqs, block_size, rnd):
    width = 5
    ids = list(range(num_reqs * width))
    rnd.shuffle(ids)
    table = torch.tensor(ids, dtype=torch.int64).view(num_reqs, width)
    positions, reqs = [], []
    for _ in range(rnd.randint(0, 12)):
        reqs.append(rnd.randrange(num_reqs))
        positions.append(rnd.choice([-1, rnd.randrange(width * block_size)]))
    slots = compute_slot_mapping(table, torch.tensor(positions, dtype=torch.int64),
                                 torch.tensor(reqs, dtype=torch.int64), block_size)
    expect = [PAD_SLOT_ID if p < 0 else ids[r * width + p // block_size] * block_size + p % block_size
              for p, r in zip(positions, reqs)]
    assert slots.dtype == torch.int64 and slots.tolist() == expect


def test_slot_mapping_int64_beyond_2_pow_31():
    """Regression: int32 block ids times block_size must not wrap past 2**31 slots."""
    block_size = 256
    big = 2**26 + 7                                  # big * 256 > 2**33
    table = torch.tensor([[3, big], [big + 1, 2]], dtype=torch.int32)
    positions = torch.tensor([block_size + 5, 255, 1], dtype=torch.int32)
    reqs = torch.tensor([0, 1, 1], dtype=torch.int32)
    slots = compute_slot_mapping(table, positions, reqs, block_size)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [big * 256 + 5, (big + 1) * 256 + 255, (big + 1) * 256 + 1]
    assert all(s > 2**31 for s in slots.tolist())


def test_slot_mapping_bad_inputs():
    table = torch.tensor([[4, PAD_BLOCK_ID]], dtype=torch.int64)
    with pytest.raises(InvalidRequestError, match="position 20 has no block"):
        compute_slot_mapping(table, torch.tensor([20]), torch.tensor([0]), 16)
    with pytest.raises(InvalidRequestError, match="position 40 needs page 2.*width is 2"):
        compute_slot_mapping(table, torch.tensor([40]), torch.tensor([0]), 16)
    with pytest.raises(InvalidRequestError, match="request 3.*1 rows"):
        compute_slot_mapping(table, torch.tensor([0]), torch.tensor([3]), 16)


# DCP sharding ------------------------------------------------------------------------------------

def _brute_owner(p, n, i):
    return (p // i) % n


@FAST
@given(st.lists(st.integers(0, 300), max_size=6), st.integers(1, 8), st.sampled_from([1, 2, 3, 16, 32]),
       st.data())
def test_dcp_local_seq_lens_brute_force(lens, world, interleave, data):
    rank = data.draw(st.integers(0, world - 1))
    got = dcp_local_seq_lens(lens, world, rank, interleave)
    assert got.dtype == torch.int64
    assert got.tolist() == [sum(_brute_owner(p, world, interleave) == rank for p in range(n)) for n in lens]
    total = sum(dcp_local_seq_lens(lens, world, r, interleave) for r in range(world)) if lens else None
    if lens:
        assert total.tolist() == lens


@FAST
@given(st.integers(0, 300), st.integers(1, 8), st.sampled_from([1, 2, 3, 16, 32]), st.data())
def test_dcp_local_seq_len_scalar_brute_force(length, world, interleave, data):
    """The plain-int form the coordinator uses per step counts the same tokens."""
    rank = data.draw(st.integers(0, world - 1))
    assert dcp_local_seq_len(length, world, rank, interleave) == \
        sum(_brute_owner(p, world, interleave) == rank for p in range(length))


@FAST
@given(st.integers(0, 400), st.integers(1, 8), st.sampled_from([1, 2, 5, 16]))
def test_dcp_positions_are_dense_per_rank(length, world, interleave):
    """Local positions on each rank are 0..n-1 in global order: the rank's pages fill in order."""
    pos = torch.arange(length)
    owner = dcp_owner_rank(pos, world, interleave)
    local = dcp_local_position(pos, world, interleave)
    assert owner.tolist() == [_brute_owner(p, world, interleave) for p in range(length)]
    for r in range(world):
        mine = local[owner == r].tolist()
        assert mine == list(range(len(mine)))


@pytest.mark.parametrize("call, match", [
    (lambda: dcp_local_seq_lens([4], 2, 2, 1), "rank 2 out of range for world_size 2"),
    (lambda: dcp_local_seq_lens([4], 2, -1, 1), "rank -1"),
    (lambda: dcp_local_seq_lens([4], 0, 0, 1), "world_size 0"),
    (lambda: dcp_local_seq_lens([4], 2, 0, 0), "interleave 0"),
    (lambda: dcp_local_seq_lens([4, -3], 2, 0, 1), r"seq_lens must be >= 0, got \[4, -3\]"),
    (lambda: dcp_owner_rank(torch.arange(3), 0, 1), "world_size 0"),
    (lambda: dcp_local_position(torch.arange(3), 2, 0), "interleave 0"),
])
def test_sharding_bad_inputs(call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call()


# CSR ---------------------------------------------------------------------------------------------

@FAST
@given(st.lists(st.integers(0, 70), max_size=6), st.sampled_from([1, 4, 16]), st.integers(0, 3),
       st.randoms(use_true_random=False))
def test_block_table_to_csr_brute_force(lens, block_size, extra_width, rnd):
    pages = [-(-n // block_size) for n in lens]
    width = max(pages, default=0) + extra_width
    width = max(width, 1)
    table = torch.full((len(lens), width), PAD_BLOCK_ID, dtype=torch.int64)
    ids = list(range(sum(pages) + 5))
    rnd.shuffle(ids)
    rows = []
    for r, p in enumerate(pages):
        row = [ids.pop() for _ in range(p)]
        rows.append(row)
        table[r, :p] = torch.tensor(row, dtype=torch.int64)
    indptr, indices, last = block_table_to_csr(table, lens, block_size)
    exp_indptr = [0]
    for p in pages:
        exp_indptr.append(exp_indptr[-1] + p)
    assert indptr.tolist() == exp_indptr
    assert indices.tolist() == [b for row in rows for b in row]
    exp_last = []
    for n in lens:
        if n == 0:
            exp_last.append(0)
        elif n % block_size == 0:
            exp_last.append(block_size)     # a full last page is block_size long, not 0
        else:
            exp_last.append(n % block_size)
    assert last.tolist() == exp_last
    assert all(t.dtype == torch.int64 for t in (indptr, indices, last))


def test_csr_bad_inputs():
    table = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(InvalidRequestError, match=r"width 2 is too small for seq_lens \[5, 33\]"):
        block_table_to_csr(table, [5, 33], 16)
    with pytest.raises(InvalidRequestError, match=r"seq_lens must be >= 0, got \[5, -1\]"):
        block_table_to_csr(table, [5, -1], 16)
    with pytest.raises(InvalidRequestError, match="block_size 0"):
        block_table_to_csr(table, [5, 1], 0)
    with pytest.raises(InvalidRequestError, match=r"\(2, 2\).*= 3"):
        block_table_to_csr(table, [1, 2, 3], 16)


# Kernel-block view -------------------------------------------------------------------------------

def _brute_common(manager, lists):
    def ok(spec, k):
        return k % spec.base == 0 if isinstance(spec, MultipleOf) else spec == k
    good = [k for k in range(1, manager + 1) if manager % k == 0 and all(any(ok(s, k) for s in lst) for lst in lists)]
    return max(good) if good else None


@FAST
@given(st.sampled_from([16, 32, 48, 64, 128, 12]),
       st.lists(st.lists(st.one_of(st.sampled_from([8, 16, 32, 64, 3]),
                                   st.builds(MultipleOf, st.sampled_from([1, 8, 16, 32]))),
                         min_size=1, max_size=3), min_size=1, max_size=3))
def test_select_common_kernel_block_size_brute_force(manager, lists):
    expect = _brute_common(manager, lists)
    if expect is None:
        with pytest.raises(InvalidRequestError, match=f"block_size {manager}"):
            select_common_kernel_block_size(manager, lists)
    else:
        assert select_common_kernel_block_size(manager, lists) == expect


def test_select_common_kernel_block_size_examples():
    assert select_common_kernel_block_size(64, [[MultipleOf(16)], [16, 32]]) == 32
    assert select_common_kernel_block_size(64, [[MultipleOf(16)], [64, 128]]) == 64
    with pytest.raises(InvalidRequestError, match="block_size 24"):
        select_common_kernel_block_size(24, [[MultipleOf(16)]])


@pytest.mark.parametrize("manager, kernel", [(64, 16), (32, 8), (16, 16), (48, 16)])
def test_kernel_view_reads_same_bytes_as_manager_view(manager, kernel):
    g = torch.Generator().manual_seed(manager * 7 + kernel)
    num_blocks, hk, d = 9, 2, 8
    cache = torch.randn(2, num_blocks, manager, hk, d, generator=g)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:4], torch.randperm(num_blocks, generator=g)[:4]])
    table[1, 3] = PAD_BLOCK_ID
    view = kernel_kv_view(cache, manager, kernel)
    assert view.data_ptr() == cache.data_ptr()                  # a view, never a copy
    ktable = expand_block_table(table, manager, kernel)
    r = manager // kernel
    assert ktable.shape == (2, 4 * r)
    for b in range(2):
        for pos in range(4 * manager):
            mb = int(table[b, pos // manager])
            kb = int(ktable[b, pos // kernel])
            if mb == PAD_BLOCK_ID:
                assert kb == PAD_BLOCK_ID
                continue
            for kv in range(2):
                assert torch.equal(view[kv, kb, pos % kernel], cache[kv, mb, pos % manager])
    # Writing through the kernel view lands in the manager page.
    view[0, int(ktable[0, r - 1]), kernel - 1] = 123.0
    assert bool((cache[0, int(table[0, 0]), manager - 1] == 123.0).all())


@pytest.mark.parametrize("call, match", [
    (lambda: expand_block_table(torch.zeros(1, 1, dtype=torch.int64), 16, 0), "kernel block size 0"),
    (lambda: expand_block_table(torch.zeros(1, 1, dtype=torch.int64), 16, 5), "kernel block size 5 .* 16"),
    (lambda: kernel_kv_view(torch.zeros(2, 3, 16, 1, 1), 16, 5), "kernel block size 5"),
    (lambda: kernel_kv_view(torch.zeros(2, 3, 8, 1, 1), 16, 8), r"\(2, 3, 8, 1, 1\)"),
    (lambda: select_common_kernel_block_size(0, [[16]]), "manager block size 0"),
])
def test_kernel_block_bad_inputs(call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call()
