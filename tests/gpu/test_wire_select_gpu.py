"""A prefill's per-rank wire on two GPUs (issue 18, cluster/wire_select.py): the shard on the client's GPU in-process,
the other over NCCL getting only its query rows and the new K/V it needs (prefill_wire auto) or the whole q|k|v
(broadcast); both against the float64 oracle, with the bytes each way sent, and a per-rank prefill stopped after
its first layer (the NCCL shard ran ahead: every enqueued layer is released) followed by exact steps."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_data_plane_gpu import REQUESTS, _checked_step, _config, _usable

pytestmark = pytest.mark.gpu


def _needs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON"])
@pytest.mark.parametrize("wire", ["auto", "broadcast"])
def test_two_gpus_prefill_per_rank_or_broadcast_is_exact(ray_session, backend, wire):
    import cpattn
    from service_oracle import Oracle

    _needs_two_gpus()
    why = _usable(backend)
    if why:
        pytest.skip(why)
    cfg = _config(num_shards=2, num_gpus_per_shard=1, backend=backend, prefill_wire=wire,
                  collective_timeout_s=300.0, rpc_timeout_s=300.0)
    svc = cpattn.start(cfg)
    try:
        assert svc.gateway.plane.backend == "nccl" and sorted(svc.gateway.local) == [0]
        oracle = Oracle(cfg, seed=11)
        ids = {name: svc.add_sequence() for name in "abc"}
        whole = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_size * 2   # bytes of one token's q|k|v
        for named in REQUESTS:
            request = {ids[n]: t for n, t in named.items()}
            _checked_step(svc, cfg, oracle, request)
            sent = svc.gateway.last_step_timings["sent_bytes"] / cfg.num_layers
            broadcast = 32 + sum(request.values()) * whole
            if wire == "broadcast" or max(named.values()) == 1:
                assert sent == broadcast, (named, sent)
            else:   # rank 1 computes only its rows and gets only the K/V it needs
                assert sent < broadcast, (named, sent, broadcast)
    finally:
        svc.shutdown()


def test_two_gpus_per_rank_prefill_stopped_early_changes_nothing(ray_session):
    import cpattn
    from service_oracle import Oracle

    _needs_two_gpus()
    cfg = _config(num_shards=2, num_gpus_per_shard=1, backend="TRITON")
    svc = cpattn.start(cfg)
    try:
        assert svc.gateway.runs_ahead
        oracle = Oracle(cfg, seed=12)
        ids = {name: svc.add_sequence() for name in "ab"}
        q, k, v = (x.cuda() for x in oracle.random_qkv(200))
        with pytest.raises(RuntimeError, match="caller stopped"):
            with svc.step({ids["a"]: 200}) as step:
                step.attend(0, q, k, v)
                raise RuntimeError("caller stopped")
        assert svc.sequences() == {ids["a"]: 0, ids["b"]: 0}
        for request in ({ids["a"]: 200}, {ids["a"]: 30, ids["b"]: 90}, {ids["a"]: 1, ids["b"]: 1}):
            _checked_step(svc, cfg, oracle, request)
    finally:
        svc.shutdown()
