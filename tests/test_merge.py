"""merge_attn_states against float64 full attention split into key subsets (tests/reference.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpattn.attention import LseBase, merge_attn_states, to_natural_lse
from cpattn.errors import InvalidRequestError
from tests.reference import attention_with_visibility

LOG2E = 1.0 / math.log(2.0)


def _split_partials(q, k, v, assignment, num_parts):
    """Full attention restricted to each key subset: the partials a shard set would produce."""
    outs, lses = [], []
    for n in range(num_parts):
        vis = (assignment == n)[None, :].expand(q.shape[0], -1)
        o, l = attention_with_visibility(q, k, v, vis)
        outs.append(o)
        lses.append(l)
    return outs, lses


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.sampled_from([(2, 1), (4, 2), (8, 2)]),
       st.sampled_from([LseBase.E, LseBase.TWO]), st.integers(0, 2**31 - 1))
def test_merge_equals_full_attention(num_parts, num_keys, heads, base, seed):
    """Any number of partials, some possibly empty; base 2 LSEs converted before merging."""
    g = torch.Generator().manual_seed(seed)
    hq, hk = heads
    t, d = 3, 16
    q = torch.randn(t, hq, d, dtype=torch.float64, generator=g)
    k = torch.randn(num_keys, hk, d, dtype=torch.float64, generator=g) * 2
    v = torch.randn(num_keys, hk, d, dtype=torch.float64, generator=g)
    assignment = torch.randint(0, num_parts, (num_keys,), generator=g)
    outs, lses = _split_partials(q, k, v, assignment, num_parts)
    if base is LseBase.TWO:
        lses = [l * LOG2E for l in lses]             # what FlashInfer would report
    full_o, full_l = attention_with_visibility(q, k, v, torch.ones(t, num_keys, dtype=torch.bool))
    out, lse = merge_attn_states(outs, lses, lse_base=base)
    torch.testing.assert_close(out, full_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, full_l, atol=1e-12, rtol=1e-12)    # natural log whatever the input base


def test_merge_stacked_tensor_input_float32():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(4, 4, 32, dtype=torch.float64, generator=g)
    k = torch.randn(50, 2, 32, dtype=torch.float64, generator=g)
    v = torch.randn(50, 2, 32, dtype=torch.float64, generator=g)
    outs, lses = _split_partials(q, k, v, torch.arange(50) % 3, 3)
    full_o, full_l = attention_with_visibility(q, k, v, torch.ones(4, 50, dtype=torch.bool))
    out, lse = merge_attn_states(torch.stack(outs).float(), torch.stack(lses).float())
    assert out.dtype == torch.float32 and out.shape == (4, 4, 32) and lse.shape == (4, 4)
    torch.testing.assert_close(out.double(), full_o, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), full_l, atol=2e-6, rtol=1e-6)


def test_empty_partials_contribute_nothing_and_nan_does_not_leak():
    g = torch.Generator().manual_seed(5)
    o1 = torch.randn(3, 2, 8, dtype=torch.float64, generator=g)
    l1 = torch.randn(3, 2, dtype=torch.float64, generator=g)
    empty_o = torch.full((3, 2, 8), math.nan, dtype=torch.float64)     # garbage in an empty partial
    empty_l = torch.full((3, 2), -math.inf, dtype=torch.float64)
    for base in (LseBase.E, LseBase.TWO):
        out, lse = merge_attn_states([empty_o, o1, empty_o], [empty_l, l1, empty_l], lse_base=base)
        expect_l = l1 * (math.log(2.0) if base is LseBase.TWO else 1.0)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, o1, atol=1e-15, rtol=0)
        torch.testing.assert_close(lse, expect_l, atol=1e-15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_empty_rows_give_zero_and_neg_inf(dtype):
    outs = torch.full((3, 2, 4, 8), math.inf, dtype=dtype)
    outs[1] = math.nan
    lses = torch.full((3, 2, 4), -math.inf)
    # Row 1, head 0 has one real partial; everything else is empty.
    outs[2, 1, 0] = 0.5
    lses[2, 1, 0] = 1.25
    out, lse = merge_attn_states(outs, lses)
    assert out.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    expect_out = torch.zeros(2, 4, 8, dtype=dtype)
    expect_out[1, 0] = 0.5
    expect_lse = torch.full((2, 4), -math.inf)
    expect_lse[1, 0] = 1.25
    assert torch.equal(out, expect_out)
    assert torch.equal(lse.float(), expect_lse)


@pytest.mark.parametrize("gap", [1e2, 1e4, 1e6])
def test_large_lse_gaps_stay_exact(gap):
    """Weights exp(l_n - max): the dominant partial is returned exactly, no overflow or NaN."""
    o_big = torch.full((1, 1, 4), 2.0, dtype=torch.float64)
    o_small = torch.full((1, 1, 4), -7.0, dtype=torch.float64)
    l_big = torch.tensor([[gap]], dtype=torch.float64)
    l_small = torch.tensor([[gap - 1e4]], dtype=torch.float64)
    out, lse = merge_attn_states([o_small, o_big], [l_small, l_big])
    assert torch.equal(out, o_big) and float(lse) == gap
    # Two partials at the same huge LSE: exact average and +log 2.
    out, lse = merge_attn_states([o_small, o_big], [l_big, l_big])
    torch.testing.assert_close(out, (o_small + o_big) / 2, atol=0, rtol=0)
    torch.testing.assert_close(lse, l_big + math.log(2.0), atol=0, rtol=1e-15)
    # Base 2 at the same gap.
    out, lse = merge_attn_states([o_small, o_big], [l_small * LOG2E, l_big * LOG2E], lse_base=LseBase.TWO)
    torch.testing.assert_close(out, o_big, atol=0, rtol=0)
    torch.testing.assert_close(lse, l_big, atol=0, rtol=1e-12)


def test_to_natural_lse():
    lse2 = torch.tensor([3.0, -math.inf, 0.0], dtype=torch.float64)
    got = to_natural_lse(lse2, LseBase.TWO)
    assert got[0].item() == pytest.approx(3.0 * math.log(2.0), rel=1e-15)
    assert math.isinf(got[1].item()) and got[1].item() < 0 and got[2].item() == 0.0
    assert torch.equal(to_natural_lse(lse2, LseBase.E), lse2)
    with pytest.raises(InvalidRequestError, match="lse_base must be an LseBase.*'2'"):
        to_natural_lse(lse2, "2")


@pytest.mark.parametrize("outs, lses, match", [
    (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 5), r"\(2, 3, 4, 5\) and \(2, 3, 5\)"),
    (torch.zeros(2, 3, 4, 5), torch.zeros(3, 3, 4), r"\(2, 3, 4, 5\) and \(3, 3, 4\)"),
    (torch.zeros(3, 4, 5), torch.zeros(3, 4), r"\(3, 4, 5\) and \(3, 4\)"),
    (torch.zeros(0, 3, 4, 5), torch.zeros(0, 3, 4), "at least one partial"),
])
def test_merge_bad_shapes(outs, lses, match):
    with pytest.raises(InvalidRequestError, match=match):
        merge_attn_states(outs, lses)


def test_merge_bad_base():
    with pytest.raises(InvalidRequestError, match="lse_base"):
        merge_attn_states(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1), lse_base=2)
