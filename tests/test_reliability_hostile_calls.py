"""A tenant calling the coordinator and the shards directly (its own credential and tickets only), as a hostile
client would: the same end_step sent many times at once cannot hold the coordinator's threads or let another
client's lease lapse, and a service whose shards must stay out of clients' processes refuses them itself (not
only in the client's code). Outputs are checked against the float64 oracle (service_oracle).
"""

from __future__ import annotations

import time

import pytest
import ray

import cpattn
from conftest import service_config
from cpattn.cluster.authority import CONTROL_GROUP
from cpattn.cluster.coordinator import RemoteCoordinator
from cpattn.cluster.service import COORDINATOR_MAX_CONCURRENCY, coordinator_threads
from cpattn.errors import AccessDeniedError, InvalidRequestError
from reliability_common import RPC_S, current_shards, snapshot
from service_oracle import Oracle, run_step


def _cause(ref, timeout: float):
    """The call's answer, or the type of the error it raised."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        return exc.cause


def test_heartbeats_and_stop_have_threads_of_their_own():
    assert RemoteCoordinator.renew.__ray_concurrency_group__ == CONTROL_GROUP
    assert RemoteCoordinator.shutdown.__ray_concurrency_group__ == CONTROL_GROUP
    assert not hasattr(RemoteCoordinator.end_step, "__ray_concurrency_group__")
    # Every open step may wait in one end_step and 16 threads stay for the rest, whatever max_open_steps is.
    assert coordinator_threads(service_config(max_open_steps=8)) == COORDINATOR_MAX_CONCURRENCY
    assert coordinator_threads(service_config(max_open_steps=200)) == 216


def test_one_step_ended_many_times_at_once_holds_one_thread_and_no_lease_lapses(ray_session):
    """A client begins a step on its own group, never serves it, and sends 80 end_steps for it at once (more
    than the coordinator's 64 threads). One waits for the shards (up to the collective timeout); the others are
    refused at once, typed. Meanwhile another client's heartbeats answer at once, its lease never lapses, its
    KV stays and its steps stay exact; afterwards the service goes on (nothing replaced)."""
    cfg = service_config(num_shards=2, client_lease_s=3.0, collective_timeout_s=6.0, rpc_timeout_s=RPC_S)
    svc = cpattn.start(cfg)
    victim = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    hostile = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oracle = Oracle(cfg, 53)
        mine = victim.add_sequence()
        run_step(victim, oracle, {mine: 9})
        theirs = hostile.add_sequence()
        coordinator = hostile.gateway.coordinator
        reply = ray.get(coordinator.begin_step.remote(hostile.credential, hostile.gateway.group_name, {theirs: 1},
                                                      hostile.gateway.epoch), timeout=RPC_S)
        t0 = time.monotonic()
        ends = [coordinator.end_step.remote(reply.step_id, True, None, hostile.credential) for _ in range(80)]
        renew_s = []
        while time.monotonic() - t0 < cfg.collective_timeout_s + 2 * cfg.client_lease_s:
            t = time.monotonic()
            ray.get(victim.gateway.coordinator.renew.remote(victim.credential), timeout=RPC_S)
            renew_s.append(time.monotonic() - t)
            if len(ray.wait(ends, num_returns=len(ends), timeout=0)[0]) == len(ends):
                break
            time.sleep(0.3)
        answers = [_cause(ref, RPC_S) for ref in ends]
        refused = [a for a in answers if isinstance(a, InvalidRequestError) and "already being ended" in str(a)]
        assert len(refused) == len(ends) - 1, answers[:3]
        assert max(renew_s) < cfg.client_lease_s / 2, renew_s   # (queued behind the end_steps: 20 s)
        assert victim.sequences() == {mine: 9}
        run_step(victim, oracle, {mine: 3})                        # exact, the KV untouched
        newcomer = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
        try:
            run_step(newcomer, Oracle(cfg, 59), {newcomer.add_sequence(): 4})   # the service goes on
        finally:
            newcomer.close()
        assert svc.stats()["shards_replaced"] == 0
    finally:
        hostile.close()
        victim.close()
        svc.shutdown()


@pytest.mark.parametrize("setting", ["off", "auto"])
def test_shards_in_a_clients_process_are_refused_by_the_service_itself(ray_session, setting):
    """local_shards='off' (or shards on the CPU): a client asking begin_step for local ranks anyway is refused
    (nothing changes), and a shard refuses its cache's handles under a genuine ticket."""
    cfg = service_config(num_shards=2, local_shards=setting)
    svc = cpattn.start(cfg)
    tenant = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oracle = Oracle(cfg, 61)
        seq = tenant.add_sequence()
        run_step(tenant, oracle, {seq: 6})
        coordinator = tenant.gateway.coordinator
        name = f"{tenant.client_id}-export"
        ticket = ray.get(coordinator.group_ticket.remote(tenant.credential, name), timeout=RPC_S)
        answer = _cause(current_shards(svc)[0].export_kv.remote(name, ticket), RPC_S)
        why = "local_shards='off'" if setting == "off" else "only CUDA caches can be opened by a client"
        assert isinstance(answer, AccessDeniedError) and why in str(answer), answer
        before = snapshot(svc, [tenant])
        with pytest.raises(AccessDeniedError, match=f"local_ranks .*{why}"):
            ray.get(coordinator.begin_step.remote(tenant.credential, tenant.gateway.group_name, {seq: 1},
                                                  tenant.gateway.epoch, [0]), timeout=RPC_S)
        assert snapshot(svc, [tenant]) == before
        run_step(tenant, oracle, {seq: 2})                          # the client's own wire steps go on, exact
    finally:
        tenant.close()
        svc.shutdown()


def test_which_services_keep_shards_out_of_clients_processes():
    assert service_config(local_shards="auto", device="cuda").in_process_refusal() is None
    assert "only CUDA caches" in service_config(local_shards="auto").in_process_refusal()   # shards on the CPU
    assert "local_shards='off'" in service_config(local_shards="off").in_process_refusal()
    assert "detached" in service_config(detached=True).in_process_refusal()
