"""Every GPU backend against the TORCH float64 oracle; DCP on one GPU; merge kernel; auto order.

Legend: T tokens, Q query heads, K kv heads, D head size, N shards.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpattn.attention import LseBase, merge_attn_states, to_natural_lse
from cpattn.attention.ops.reference import ragged_causal_attention
from cpattn.attention.registry import PRIORITY, load_backend_class
from cpattn.attention.selector import clear_selector_cache, get_attn_backend
from cpattn.errors import BackendUnavailableError
from .batches import (SHAPES, causal_md, dcp_shards, lse_err, new_token_pieces, oracle, page_sizes,
                               random_batch, rel_err, run_backend, spec_for)

pytestmark = pytest.mark.gpu
BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
LSE_TOL = 2e-2
DEVICE = "cuda"


def _backend_or_skip(name, head_size, dtype, block_size, hq, hk):
    try:
        return get_attn_backend(name, head_size=head_size, dtype=dtype, block_size=block_size, num_q_heads=hq,
                                num_kv_heads=hk, device=DEVICE)
    except BackendUnavailableError as exc:
        pytest.skip(f"{name} unavailable here: {exc.reasons}")


def _check(name, shape, gqa, head_size, dtype, block_size, seed=0):
    hk = 2
    hq = hk * gqa if gqa > 1 else 4
    hk = hq // gqa
    cls = _backend_or_skip(name, head_size, dtype, block_size, hq, hk)
    q_lens, ctx = SHAPES[shape]
    b = random_batch(q_lens, ctx, hq, hk, head_size, block_size, dtype, DEVICE, seed=seed)
    md = causal_md(b, DEVICE)
    out, lse = run_backend(cls, spec_for(b, dtype, DEVICE), md, b.q, b.k, b.v, b.kv_cache)
    ref_out, ref_lse = oracle(b, md)
    assert out.shape == b.q.shape and out.dtype == dtype
    assert lse.shape == b.q.shape[:2] and lse.dtype == torch.float32
    err = rel_err(out, ref_out)
    lerr = lse_err(to_natural_lse(lse.double(), cls.lse_base), ref_lse)
    assert err < TOL[dtype], f"{name} {shape} gqa={gqa} D={head_size} page={block_size}: rel err {err:.2e}"
    assert lerr < LSE_TOL, f"{name} {shape}: lse err {lerr:.2e} (base {cls.lse_base})"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_backend_vs_torch_shapes(name, shape, gqa):
    """Every named shape and GQA ratio at each declared page size (D=128, bf16)."""
    for ps in page_sizes(load_backend_class(name)):
        _check(name, shape, gqa, 128, torch.bfloat16, ps)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype,head_size", [(torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float16, 128)])
def test_backend_vs_torch_dtypes_heads(name, dtype, head_size):
    ps = page_sizes(load_backend_class(name))[0]
    _check(name, "mixed", 4, head_size, dtype, ps, seed=3)


@pytest.mark.parametrize("name", BACKENDS)
def test_lse_base_declared_matches_kernel(name):
    """The declared base is the kernel's: natural LSE from it matches the oracle, the other base does not."""
    cls = _backend_or_skip(name, 128, torch.bfloat16, page_sizes(load_backend_class(name))[0], 8, 2)
    b = random_batch([1, 5], [300, 20], 8, 2, 128, page_sizes(cls)[0], torch.bfloat16, DEVICE, seed=5)
    md = causal_md(b, DEVICE)
    _, lse = run_backend(cls, spec_for(b, torch.bfloat16, DEVICE), md, b.q, b.k, b.v, b.kv_cache)
    _, ref = oracle(b, md)
    other = LseBase.E if cls.lse_base is LseBase.TWO else LseBase.TWO
    assert lse_err(to_natural_lse(lse.double(), cls.lse_base), ref) < LSE_TOL
    assert lse_err(to_natural_lse(lse.double(), other), ref) > 0.1


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("shape", ["mixed", "long_decode"])
def test_dcp_one_gpu_equals_single_call(name, world, shape):
    """N shards each run the backend on their local context (causal=False), the new tokens' causal
    part runs once (forward_new_tokens), the GPU merge combines them: equals single-call attention."""
    from cpattn.attention.ops.merge import merge_partials

    dtype, hq, hk, d = torch.bfloat16, 8, 2, 128
    cls = _backend_or_skip(name, d, dtype, 16, hq, hk)
    ps = page_sizes(cls)[0]
    q_lens, ctx = SHAPES[shape]
    b = random_batch(q_lens, ctx, hq, hk, d, ps, dtype, DEVICE, seed=11)
    interleave = 1 if world != 4 else ps
    shards = dcp_shards(b, world, interleave, DEVICE)
    spec = spec_for(b, dtype, DEVICE)
    outs, lses = [], []
    for sh in shards:
        o, l = run_backend(cls, spec, sh.md, b.q, b.k, b.v, sh.kv_cache)
        outs.append(o)
        lses.append(to_natural_lse(l, cls.lse_base))
    impl = cls.get_impl_cls()(spec)
    o_new, l_new = impl.forward_new_tokens(b.q, b.k, b.v, new_token_pieces(q_lens))
    outs.append(o_new)
    lses.append(l_new.float())
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses), LseBase.E)
    ref_out, ref_lse = oracle(b, causal_md(b, DEVICE))
    assert rel_err(out, ref_out) < TOL[dtype]
    assert lse_err(lse, ref_lse) < LSE_TOL


@pytest.mark.parametrize("name", BACKENDS)
def test_forward_new_tokens_vs_torch(name):
    dtype, hq, hk, d = torch.bfloat16, 8, 2, 128
    cls = _backend_or_skip(name, d, dtype, page_sizes(load_backend_class(name))[0], hq, hk)
    g = torch.Generator().manual_seed(2)
    t = 700
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(DEVICE) for h in (hq, hk, hk))
    pieces = torch.tensor([[0, 100, 0], [100, 400, 100], [500, 700, 0]])   # rows 400..499 uncovered
    impl = cls.get_impl_cls()(spec_for(random_batch([1], [0], hq, hk, d, 16, dtype, DEVICE), dtype, DEVICE))
    out, lse = impl.forward_new_tokens(q, k, v, pieces)
    ref_out, ref_lse = ragged_causal_attention(q.double(), k.double(), v.double(), pieces, d ** -0.5)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert lse_err(lse, ref_lse) < LSE_TOL
    assert bool((out[400:500] == 0).all())


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("base", [LseBase.E, LseBase.TWO])
def test_merge_triton_matches_float64(n, t, dtype, base):
    from cpattn.attention.merge_triton import merge_attn_states_triton

    g = torch.Generator().manual_seed(n * 7 + t)
    h, d = 8, 128
    outs = torch.randn(n, t, h, d, generator=g).to(dtype)
    lses = torch.randn(n, t, h, generator=g) * 20
    lses[0, : t // 2] = -math.inf                    # a partial with no keys
    if n > 1:
        outs[0, : t // 2] = float("nan")             # garbage under -inf must not leak
    lses[:, t - 1, 0] = -math.inf                    # a row no partial covers
    ref_out, ref_lse = merge_attn_states(outs.double(), lses.double(), base)
    out, lse = merge_attn_states_triton(outs.to(DEVICE), lses.to(DEVICE), base)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any())
    assert rel_err(out.cpu(), ref_out) < (1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-5)
    assert lse_err(lse.cpu(), ref_lse) < 1e-4 * 20
    assert bool((out[t - 1, 0] == 0).all()) and bool(torch.isneginf(lse[t - 1, 0]))


def test_cuda_auto_selection_order():
    """auto takes the first backend of the CUDA priority list that validates, and says why for the rest."""
    clear_selector_cache()
    kw = dict(head_size=128, dtype=torch.bfloat16, block_size=16, num_q_heads=32, num_kv_heads=8, device=DEVICE)
    chosen = get_attn_backend("auto", **kw)
    for name in PRIORITY["cuda"]:
        try:
            cls = load_backend_class(name)
        except BackendUnavailableError:
            continue
        if not cls.validate(_config(**kw)):
            assert chosen is cls, f"auto chose {chosen.get_name()}, first valid in {PRIORITY['cuda']} is {name}"
            break
    assert PRIORITY["cuda"][-1] == "TORCH"


def _config(head_size, dtype, block_size, num_q_heads, num_kv_heads, device):
    from cpattn.attention.backend import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=head_size, dtype="bfloat16", kv_cache_dtype="auto", block_size=block_size,
                                   num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, device_type="cuda",
                                   device_capability=torch.cuda.get_device_capability())


def test_explicit_flash_attn_reports_every_generation():
    """A page size no generation accepts: explicit FLASH_ATTN fails naming each generation's reason."""
    with pytest.raises(BackendUnavailableError) as info:
        get_attn_backend("FLASH_ATTN", head_size=128, dtype=torch.bfloat16, block_size=8, num_q_heads=8,
                         num_kv_heads=2, device=DEVICE)
    text = " ".join(info.value.reasons["FLASH_ATTN"])
    for gen in ("FA4", "FA3", "FA2"):
        assert gen in text
