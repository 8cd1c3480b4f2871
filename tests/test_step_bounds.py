"""Issue 12 item 6: one step cannot take a shard out of memory. The TORCH backend attends in query tiles
(checked exact against the float64 reference, and its peak memory measured in a fresh process), and a step
above max_tokens_per_step is an InvalidRequestError before anything changes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cpattn.attention.ops import reference as ref_ops
from reference import attention_with_visibility


def _visible(lq: int, lk: int, offset: int | None) -> torch.Tensor:
    if offset is None:
        return torch.ones(lq, lk, dtype=torch.bool)
    return torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + offset


@pytest.mark.parametrize("lq,lk,offset", [(37, 37, 0), (37, 60, 23), (50, 50, None), (9, 200, 191), (40, 12, None),
                                          (33, 40, -3)])
def test_tiled_dense_attention_is_exact(monkeypatch, lq, lk, offset):
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    q = torch.randn(lq, 4, 8, dtype=torch.float64, generator=g)
    k = torch.randn(lk, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(lk, 2, 8, dtype=torch.float64, generator=g)
    ref_out, ref_lse = attention_with_visibility(q, k, v, _visible(lq, lk, offset), 8 ** -0.5)
    for tile_bytes in (1, 3 * lk * 4 * 8 * 5, 1 << 30):          # one query per tile, 5 per tile, untiled
        monkeypatch.setattr(ref_ops, "TILE_BYTES", tile_bytes)
        out, lse = ref_ops.dense_attention(q, k, v, 8 ** -0.5, offset)
        assert torch.allclose(out, ref_out, atol=1e-12, rtol=0)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-12, rtol=0)


PEAK = """
import resource, torch
from cpattn.attention.ops.reference import dense_attention
torch.set_num_threads(1)
t = 4096
q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, lse = dense_attention(q, k, v, 0.125, 0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_a_4096_token_prefill_does_not_materialise_its_scores():
    """Untiled, the scores of a 4,096-token causal prefill with 4 heads take 256 MB (the peak grew ~780 MB with
    probabilities and the mask); tiled, it grows ~120-160 MB (tiles of TILE_BYTES plus allocator slack)."""
    grown_mb = float(subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True,
                                    timeout=300).stdout.split()[-1])
    print(f"\npeak memory growth of a 4096-token prefill (4 heads): {grown_mb:.0f} MB")
    assert grown_mb < 300


def test_a_step_above_max_tokens_per_step_is_refused_before_anything_changes(start_service):
    from cpattn.errors import InvalidRequestError
    from reliability_common import snapshot
    from service_oracle import Oracle, run_step

    svc = start_service(num_shards=3, max_tokens_per_step=20, num_blocks_per_shard=64)
    oracle = Oracle(svc.config, 61)
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 12, b: 8})                        # exactly the cap
    before = snapshot(svc)
    for request in ({a: 21}, {a: 11, b: 10}, {a: 700}):
        with pytest.raises(InvalidRequestError, match=r"exceeds max_tokens_per_step=20: split the prefill"):
            with svc.step(request):
                pytest.fail("the step must not open")
        assert snapshot(svc) == before
    run_step(svc, oracle, {a: 20})
    run_step(svc, oracle, {a: 1, b: 1})
