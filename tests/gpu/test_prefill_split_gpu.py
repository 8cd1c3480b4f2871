"""Issue 18 on the GPU: the causal part split by time between the client's in-process rank and remote ones, remote
ranks attending their compact message (FLASH_ATTN: one kernel call per piece on slices; TRITON: the default path,
q placed among its keys), all against float64; on two GPUs, the service with each wire cost."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_data_plane_gpu import _checked_step, _config, _usable

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON"])
@pytest.mark.parametrize("num_pieces", [1, 2, 6])
def test_compact_pieces_on_the_gpu_match_float64(backend, num_pieces):
    from cpattn.attention import get_attn_backend
    from cpattn.attention.ops.reference import ragged_causal_pieces

    why = _usable(backend)
    if why:
        pytest.skip(why)
    cls = get_attn_backend(backend, head_size=128, dtype=torch.bfloat16, block_size=16, num_q_heads=8,
                           num_kv_heads=2, device="cuda")
    from cpattn.attention.backend import AttentionSpec

    impl = cls.get_impl_cls()(AttentionSpec(8, 2, 128, torch.bfloat16, 16, "cuda"))
    g = torch.Generator().manual_seed(num_pieces)
    rows_q, rows_k, pieces = 0, 0, []
    for _ in range(num_pieces):   # each piece: 300..1500 queries at the end of 0..2000 more keys (a rank's share)
        lq, extra = int(torch.randint(300, 1500, (), generator=g)), int(torch.randint(0, 2000, (), generator=g))
        pieces.append((rows_q, rows_q + lq, rows_k, rows_k + lq + extra))
        rows_q, rows_k = rows_q + lq, rows_k + lq + extra + int(torch.randint(0, 50, (), generator=g))
    q = torch.randn(rows_q, 8, 128, generator=g, dtype=torch.float64)
    k, v = (torch.randn(rows_k, 2, 128, generator=g, dtype=torch.float64) for _ in range(2))
    pieces_P4 = torch.tensor(pieces, dtype=torch.int64)
    out, lse = impl.forward_causal_pieces(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), pieces_P4)
    ref_out, ref_lse = ragged_causal_pieces(*(x.to(torch.bfloat16).double() for x in (q, k, v)), pieces_P4,
                                            impl.spec.scale)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    rel = ((out.double().cpu() - ref_out).norm() / ref_out.norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON"])
@pytest.mark.parametrize("flops_per_byte", [0.0, 1.0, 3000.0])
def test_split_prefill_in_process_matches_float64(backend, flops_per_byte):
    """Three shards on one GPU, rank 0 the client's, ranks 1 and 2 fed their own packed messages (tests/split_service)."""
    from cpattn.config import ServiceConfig
    from split_service import SplitService
    from test_fp8_kv_cache import _oracle

    why = _usable(backend)
    if why:
        pytest.skip(why)
    cfg = ServiceConfig(num_shards=3, num_layers=2, num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                        dtype="bfloat16", device="cuda", backend=backend, num_blocks_per_shard=512, pcp_min_tokens=64,
                        dcp_interleave=16)
    svc = SplitService(cfg, (0,), flops_per_byte)
    g = torch.Generator().manual_seed(3)
    a, b = svc.add(), svc.add()
    history, sinks = {}, [None, None]
    for j, request in enumerate([{a: 3000}, {a: 700, b: 1200}, {a: 1, b: 1}]):
        t = sum(request.values())
        layers = [tuple(torch.randn(t, h, 128, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
                        for h in (8, 2, 2)) for _ in range(cfg.num_layers)]
        expected = _oracle(cfg, history, request, layers, sinks)
        got = svc.step(request, layers, sinks)
        for layer, (o, e) in enumerate(zip(got, expected)):
            rel = ((o.double().cpu() - e).norm() / e.norm()).item()
            assert rel < 1e-2, f"step {j} layer {layer}: {rel:.2e}"
        if j == 0:
            remote = [pl.new_tokens_only for r, pl in enumerate(svc.last_planned) if r]
            assert all(new is not None and new.compact for new in remote)


@pytest.mark.parametrize("flops_per_byte", [0.0, 1.0, 3000.0])
def test_two_gpus_split_prefill_is_exact(ray_session, flops_per_byte):
    """The service on two GPUs (rank 0 in the client, rank 1 over NCCL) with each wire cost: a remote rank with
    an equal share (0), a large one (1), the default (3000), against the float64 oracle."""
    import cpattn
    from service_oracle import Oracle

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cfg = _config(num_shards=2, num_gpus_per_shard=1, backend="FLASH_ATTN", pcp_wire_flops_per_byte=flops_per_byte,
                  num_blocks_per_shard=1024, collective_timeout_s=300.0, rpc_timeout_s=300.0)
    svc = cpattn.start(cfg)
    try:
        assert sorted(svc.gateway.local) == [0]
        oracle = Oracle(cfg, seed=21)
        ids = {name: svc.add_sequence() for name in "ab"}
        for named in ({"a": 4096}, {"a": 512, "b": 2000}, {"a": 1, "b": 1}):
            _checked_step(svc, cfg, oracle, {ids[n]: t for n, t in named.items()})
    finally:
        svc.shutdown()
