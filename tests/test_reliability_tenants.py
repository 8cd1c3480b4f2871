"""Issue 12, several tenants on one service: open steps cannot starve the health check, a client is one
thread, a broken data plane is rebuilt, malformed ids and tensors are typed rejections, dead clients'
resources come back. Every output is checked against the float64 oracle (service_oracle).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

import cpattn
from conftest import service_config
from cpattn.errors import CapacityError, CpattnError, InvalidRequestError, ServiceError
from reliability_common import RPC_S, current_shards, snapshot, wait_for
from service_oracle import Oracle, checked_step, run_step

TOL = 1e-10


def _open_step(svc, oracle, request):
    """Enter a step and attend its first layer (checked); returns (step, pending history) with the step open."""
    step = svc.step(request).__enter__()
    q, k, v = oracle.random_qkv(sum(request.values()))
    out = step.attend(0, q, k, v)
    ref, new_kv = oracle.reference(request, 0, q, k, v)
    assert (out.double() - ref).abs().max().item() <= TOL
    return step, new_kv


def _finish_step(svc, oracle, step, request, pending):
    for layer in range(1, svc.config.num_layers):
        q, k, v = oracle.random_qkv(sum(request.values()))
        out = step.attend(layer, q, k, v)
        ref, new_kv = oracle.reference(request, layer, q, k, v)
        assert (out.double() - ref).abs().max().item() <= TOL
        pending.update(new_kv)
    step.__exit__(None, None, None)
    oracle.commit(pending)


def test_open_steps_are_capped_and_never_starve_the_health_check(ray_session):
    """Item 3: every open step holds a thread on every shard. More open steps than max_open_steps are refused
    with CapacityError (nothing changes); with the cap reached, pings (own concurrency group) keep answering
    well past shard_hang_timeout_s, so no shard is replaced and an idle sequence keeps its KV."""
    cfg = service_config(num_shards=3, max_open_steps=2, health_check_interval_s=0.2, shard_hang_timeout_s=1.0,
                         rpc_timeout_s=RPC_S, collective_timeout_s=60.0)
    svc = cpattn.start(cfg)
    clients = [cpattn.connect(name=cfg.name, namespace=cfg.namespace) for _ in range(3)]
    try:
        oracle = Oracle(cfg, 31)
        idle = svc.add_sequence()
        run_step(svc, oracle, {idle: 9})
        seqs = [c.add_sequence() for c in clients]
        open_steps = [_open_step(c, oracle, {s: 4}) for c, s in zip(clients[:2], seqs[:2])]
        before = snapshot(svc, clients, with_kv=True)
        with pytest.raises(CapacityError, match=r"2 steps are open .*max_open_steps=2.*finish open steps"):
            with clients[2].step({seqs[2]: 3}):
                pytest.fail("a third open step must be refused")
        assert clients[2]._step is None
        time.sleep(3 * cfg.shard_hang_timeout_s)          # many health rounds with every step thread busy
        assert snapshot(svc, clients, with_kv=True) == before
        assert svc.stats()["shards_replaced"] == 0
        for (step, pending), c, s in zip(open_steps, clients, seqs):
            _finish_step(c, oracle, step, {s: 4}, pending)
        checked_step(clients[2], oracle, {seqs[2]: 3}, tol=TOL)   # capacity is back
        checked_step(svc, oracle, {idle: 1, seqs[0]: 2}, tol=TOL)  # nothing lost, everything exact
    finally:
        for c in clients:
            c.close()
        svc.shutdown()
