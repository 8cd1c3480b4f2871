"""The client's graphed decode layer (cluster.client_graphs) over NCCL on two GPUs, and with every shard in the
client's process on one GPU: every output vs the float64 oracle, through decode runs, batch changes (a new bucket),
a step left mid-way, and NaN input rejected."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_data_plane_gpu import _checked_step, _config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _new_bucket_a_stopped_step_and_nan(svc, cfg, oracle, a):
    """Decodes of ``a`` alone (another batch size: another bucket), a step the caller leaves mid-way, and a step
    whose q holds NaN in one layer (rejected, rolled back): each leaves the cache as the oracle has it."""
    from cpattn.errors import InvalidRequestError

    for _ in range(4):
        _checked_step(svc, cfg, oracle, {a: 1})
    assert svc.gateway.client_graphs.key[0] == 1
    q, k, v = (x.cuda() for x in oracle.random_qkv(1))
    with pytest.raises(RuntimeError, match="caller stopped"):
        with svc.step({a: 1}) as step:
            step.attend(0, q, k, v)
            raise RuntimeError("caller stopped")
    with pytest.raises(InvalidRequestError, match="NaN or inf"):
        with svc.step({a: 1}) as step:
            for layer in range(cfg.num_layers):
                step.attend(layer, q * float("nan") if layer == 2 else q, k, v)


@pytest.mark.parametrize("shards, interleave", [(1, 1), (3, 16)])
def test_in_process_client_layers_replay_one_graph_each(ray_session, shards, interleave):
    """Every shard on the client's GPU (no data plane): each decode layer is one replay of the client's graph (the
    NaN norm, each shard's KV write and attention, their merge), against the float64 oracle; a bucket change, a
    step left mid-way, NaN rejected and a layer with sinks (eager, beside the graphs) keep every output exact."""
    import cpattn
    from service_oracle import Oracle

    cfg = _config(num_shards=shards, num_gpus_per_shard=0.25, backend="TRITON", num_layers=4,
                  dcp_interleave=interleave)
    svc = cpattn.start(cfg)
    try:
        gw = svc.gateway
        assert gw.plane is None and len(gw.local) == shards and gw.client_graphs is not None
        oracle = Oracle(cfg, seed=29 + shards)
        a, b = svc.add_sequence(), svc.add_sequence()
        _checked_step(svc, cfg, oracle, {a: 300, b: 40})
        replayed, run = [], gw.client_graphs.run
        gw.client_graphs.run = lambda layer, *qkv: (replayed.append(layer), run(layer, *qkv))[1]
        for _ in range(6):   # the first decode step of the bucket is eager; the next ones replay
            _checked_step(svc, cfg, oracle, {a: 1, b: 1})
        assert gw.client_graphs.key is not None and gw.client_graphs.key[0] == 2, gw.client_graphs.key
        assert len(replayed) >= 4 * cfg.num_layers, replayed
        _new_bucket_a_stopped_step_and_nan(svc, cfg, oracle, a)
        oracle.sinks = {layer: torch.randn(cfg.num_q_heads, dtype=torch.float32) for layer in range(cfg.num_layers)}
        _checked_step(svc, cfg, oracle, {a: 1, b: 1}, sinks=True)   # sinks enter in the eager merge beside the graphs
        oracle.sinks = {}
        for _ in range(3):
            _checked_step(svc, cfg, oracle, {a: 1})
        assert svc.sequences() == {a: oracle.length(a), b: oracle.length(b)}
    finally:
        svc.shutdown()


@two_gpus
def test_graphed_client_layers_match_float64(ray_session):
    import cpattn
    from service_oracle import Oracle

    cfg = _config(num_shards=2, num_gpus_per_shard=1, backend="TRITON", num_layers=4)
    svc = cpattn.start(cfg)
    try:
        gw = svc.gateway
        assert gw.client_graphs is not None and gw.plane.backend == "nccl"
        oracle = Oracle(cfg, seed=17)
        a, b = svc.add_sequence(), svc.add_sequence()
        _checked_step(svc, cfg, oracle, {a: 300, b: 40})
        for _ in range(5):   # the first decode step of the bucket is eager; the next ones replay
            _checked_step(svc, cfg, oracle, {a: 1, b: 1})
        assert gw.client_graphs.key is not None and gw.client_graphs.key[0] == 2, gw.client_graphs.key
        svc.stats()   # ends the decode run: its shards report, among others how many steps were one graph replay
        assert gw.last_step_timings.get("shard_graphed_steps", 0) >= 1, gw.last_step_timings
        _new_bucket_a_stopped_step_and_nan(svc, cfg, oracle, a)
        for _ in range(3):
            _checked_step(svc, cfg, oracle, {a: 1})
        assert svc.sequences() == {a: oracle.length(a), b: oracle.length(b)}
    except BaseException:
        traceback.print_exc()   # now: a shutdown that hangs on a broken NCCL group would hide it
        sys.stderr.flush()
        raise
    finally:
        svc.shutdown()


@two_gpus
def test_forks_decode_graphed_with_their_prefix_read_once(ray_session):
    """Forks of one document on two GPUs (TRITON): their decode steps take the cascade split (a prefix pass per
    layer) and still replay the client's and the remote shard's graphs; every output vs the float64 oracle."""
    import cpattn
    from service_oracle import Oracle

    cfg = _config(num_shards=2, num_gpus_per_shard=1, backend="TRITON", num_layers=3)
    svc = cpattn.start(cfg)
    try:
        gw = svc.gateway
        oracle = Oracle(cfg, seed=23)
        doc = svc.add_sequence()
        _checked_step(svc, cfg, oracle, {doc: 700})
        forks = []
        for _ in range(5):
            forks.append(svc.fork(doc))
            oracle.fork(doc, forks[-1], 700)
        for _ in range(7):   # a bucket's first step is eager; the run's next ones replay
            _checked_step(svc, cfg, oracle, {f: 1 for f in forks})
        for local in gw.local_graphs.values():   # an in-process shard's graphs hold the prefix pass
            assert local is not None and local.key is not None and local.key[4] is not None, local and local.key
        assert gw.client_graphs.key is not None and gw.client_graphs.key[0] == len(forks), gw.client_graphs.key
        svc.stats()   # ends the decode run: its shards report how many steps were one graph replay
        assert gw.last_step_timings.get("shard_graphed_steps", 0) >= 1, gw.last_step_timings
        assert svc.sequences()[forks[0]] == oracle.length(forks[0]) == 707
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        svc.shutdown()
