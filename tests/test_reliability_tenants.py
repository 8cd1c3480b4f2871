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
from user_env import user_env
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
    # The commit went without waiting (async_commit): read its answer, so the coordinator has closed the step
    # before another client's begin_step counts open steps (calls from different handles are not ordered).
    svc.gateway.flush()
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
        assert clients[2].gateway.open_step is None
        time.sleep(3 * cfg.shard_hang_timeout_s)          # many health rounds with every step thread busy
        assert snapshot(svc, clients, with_kv=True) == before
        assert svc.stats()["shards_replaced"] == 0
        for (step, pending), c, s in zip(open_steps, clients, seqs):
            _finish_step(c, oracle, step, {s: 4}, pending)
        checked_step(clients[2], oracle, {seqs[2]: 3}, tol=TOL)   # capacity is back
        checked_step(svc, oracle, {idle: 1}, tol=TOL)               # nothing lost, everything exact
        checked_step(clients[0], oracle, {seqs[0]: 2}, tol=TOL)
    finally:
        for c in clients:
            c.close()
        svc.shutdown()


def test_a_client_stalled_mid_step_holds_no_shard_thread_once_its_shards_gave_up(ray_session):
    """A client whose model stalls between two layers (its heartbeat alive) held one of max_open_steps for good:
    its shards stopped waiting for its next layer after collective_timeout_s, but the coordinator still counted
    the step, and every other client's step was refused until the stalled one's lease ended. An open step now
    counts while its shard calls run: once they gave up, another client's step is admitted; the stalled client's
    next layer fails with ServiceError (its step rolled back, nothing written) and its retry is exact."""
    cfg = service_config(num_shards=3, max_open_steps=1, collective_timeout_s=3.0, rpc_timeout_s=RPC_S)
    svc = cpattn.start(cfg)
    other = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oracle = Oracle(cfg, 37)
        a, b = svc.add_sequence(), other.add_sequence()
        run_step(svc, oracle, {a: 6})
        stalled, _ = _open_step(svc, oracle, {a: 4})
        with pytest.raises(CapacityError, match=r"1 steps are open .*max_open_steps=1"):
            with other.step({b: 3}):
                pytest.fail("the shards still serve the stalled step")
        time.sleep(cfg.collective_timeout_s + 3)          # the shards' wait for layer 1 runs out
        checked_step(other, oracle, {b: 3}, tol=TOL)       # admitted: the stalled step holds no shard thread
        q, k, v = oracle.random_qkv(4)
        with pytest.raises(ServiceError):
            stalled.attend(1, q, k, v)
        stalled.__exit__(None, None, None)
        assert svc.sequences() == {a: 6} and other.sequences() == {b: 3}
        checked_step(svc, oracle, {a: 4}, tol=TOL)          # the retry, exact over the old history
        checked_step(other, oracle, {b: 2}, tol=TOL)
        assert svc.stats()["shards_replaced"] == 0
    finally:
        other.close()
        svc.shutdown()


class _EvilId(str):
    """Equal to the id it wraps, with a hash of its own: a dict can hold it next to that id."""

    def __hash__(self):
        return hash(("evil", str.__str__(self)))


@pytest.fixture(scope="module")
def plain_service(ray_session):
    """One plain 3-shard service for the tests that only need one (a start each was most of their time)."""
    svc = cpattn.start(service_config(num_shards=3, rpc_timeout_s=RPC_S))
    yield svc
    svc.shutdown()


@pytest.fixture
def shared_svc(plain_service):
    """The module's plain service, as if fresh: the sequences a test added are freed after it."""
    assert plain_service.sequences() == {} and plain_service.gateway.open_step is None
    yield plain_service
    for sid in plain_service.sequences():
        plain_service.free(sid)


def test_sparse_tensors_and_str_subclass_ids_are_typed_rejections_that_change_nothing(shared_svc):
    """Item 7: a sparse q/k/v is an InvalidRequestError (it was NotImplementedError); a str subclass equal to
    an id cannot put one sequence twice into a step; a subclass id on its own means that sequence."""
    svc = shared_svc
    cfg = svc.config
    oracle = Oracle(cfg, 32)
    a, b = svc.add_sequence(), svc.add_sequence()
    run_step(svc, oracle, {a: 6, b: 2})
    before = snapshot(svc)
    request = {a: 1, _EvilId(a): 1}
    assert len(request) == 2
    with pytest.raises(InvalidRequestError, match=f"sequence {a} appears twice"):
        with svc.step(request):
            pytest.fail("one sequence twice in a step must be refused")
    assert snapshot(svc) == before and svc.gateway.open_step is None
    for layout in ("coo", "csr"):
        for which in range(3):
            q, k, v = oracle.random_qkv(2)
            args = [q, k, v]
            args[which] = args[which].to_sparse() if layout == "coo" else args[which][:, 0].to_sparse_csr()
            with pytest.raises(InvalidRequestError, match="dense"):
                with svc.step({a: 1, b: 1}) as step:
                    step.attend(0, *args)
            assert snapshot(svc) == before and svc.gateway.open_step is None
    assert svc.sequence_length(_EvilId(a)) == 6      # a subclass id on its own names that sequence
    pending = {}
    with svc.step({_EvilId(a): 2, b: 1}) as step:
        for layer in range(cfg.num_layers):
            q, k, v = oracle.random_qkv(3)
            ref, new_kv = oracle.reference({a: 2, b: 1}, layer, q, k, v)
            assert (step.attend(layer, q, k, v).double() - ref).abs().max().item() <= TOL
            pending.update(new_kv)
    oracle.commit(pending)
    assert svc.sequences() == {a: 8, b: 3}
    run_step(svc, oracle, {a: 1, b: 1})


def _attend_all(svc, oracle, step, request):
    """Attend every layer of an open step, each checked against the oracle; returns the pending history."""
    pending = {}
    for layer in range(svc.config.num_layers):
        q, k, v = oracle.random_qkv(sum(request.values()))
        ref, new_kv = oracle.reference(request, layer, q, k, v)
        assert (step.attend(layer, q, k, v).double() - ref).abs().max().item() <= TOL
        pending.update(new_kv)
    return pending


def test_a_client_is_one_thread_and_a_second_thread_is_refused_cleanly(shared_svc):
    """Item 4: two threads opening steps on one client at the same moment: exactly one gets the step (its
    outputs exact), the other an InvalidRequestError; attending from another thread is refused; the client
    stays usable."""
    svc = shared_svc
    cfg = svc.config
    oracle = Oracle(cfg, 33)
    seqs = [svc.add_sequence(), svc.add_sequence()]
    run_step(svc, oracle, {seqs[0]: 5, seqs[1]: 3})
    for _ in range(3):
        barrier, refused = threading.Barrier(2), threading.Event()
        outcome: dict = {}

        def worker(sid):
            barrier.wait()
            try:
                with svc.step({sid: 1}) as step:
                    refused.wait(10)                  # keep the step open until the other was refused
                    pending = _attend_all(svc, oracle, step, {sid: 1})
                oracle.commit(pending)
                outcome[sid] = "committed"
            except BaseException as exc:   # reported below
                outcome[sid] = exc
                refused.set()

        threads = [threading.Thread(target=worker, args=(s,)) for s in seqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(map(str, outcome.values())).count("committed") == 1, outcome
        (err,) = [e for e in outcome.values() if e != "committed"]
        assert isinstance(err, InvalidRequestError) and "one thread" in str(err), repr(err)
        assert svc.gateway.open_step is None
    with svc.step({seqs[0]: 2}) as step:
        box = []
        t = threading.Thread(target=lambda: box.append(pytest.raises(InvalidRequestError, step.attend, 0,
                                                                     *oracle.random_qkv(2))))
        t.start()
        t.join(30)
        assert box and "one thread" in str(box[0].value)
        pending = _attend_all(svc, oracle, step, {seqs[0]: 2})
    oracle.commit(pending)
    assert svc.sequences() == {s: oracle.length(s) for s in seqs}
    run_step(svc, oracle, {seqs[0]: 1, seqs[1]: 1})


def test_a_collective_timeout_without_shard_loss_rebuilds_the_group_and_the_retry_works(ray_session):
    """Item 4: a shard paused 6 s (SIGSTOP, under shard_hang_timeout_s) makes the step's collective time out;
    the error says to run the step again, nothing is replaced, and the retry on the same client is exact."""
    cfg = service_config(num_shards=3, rpc_timeout_s=RPC_S, collective_timeout_s=2.0, shard_hang_timeout_s=30.0,
                         health_check_interval_s=0.5)
    svc = cpattn.start(cfg)
    try:
        oracle = Oracle(cfg, 34)
        a = svc.add_sequence()
        run_step(svc, oracle, {a: 7})
        pid = ray.get(current_shards(svc)[1].info.remote(svc.operator_credential), timeout=RPC_S).pid
        os.kill(pid, signal.SIGSTOP)   # a shard actor this test started
        resume = threading.Timer(6.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            with pytest.raises(ServiceError, match="run the step again"):
                run_step(svc, oracle, {a: 2})
        finally:
            resume.join()
            os.kill(pid, signal.SIGCONT)
        for request in ({a: 2}, {a: 1}, {a: 3}):
            run_step(svc, oracle, request)
        assert svc.sequences() == {a: 13} and svc.stats()["shards_replaced"] == 0
    finally:
        svc.shutdown()


DYING_CLIENT = """
import logging, sys, time, ray, torch, cpattn
svc = cpattn.connect(name=sys.argv[2], namespace=sys.argv[3], address=sys.argv[1], on_lapse=sys.argv[4])
cfg = svc.config
a, b = svc.add_sequence(), svc.add_sequence()
svc.fill_synthetic(a, 10, seed=1)
step = svc.step({a: 5, b: 3}).__enter__()
g = torch.Generator().manual_seed(0)
step.attend(0, *(torch.randn(8, h, cfg.head_size, dtype=torch.float64, generator=g)
                 for h in (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads)))
print("READY", svc.credential, a, b, flush=True)
time.sleep(600)
"""


def _shard_usage(svc) -> dict:
    shards = current_shards(svc)
    pids = [i.pid for i in ray.get([h.info.remote(svc.operator_credential) for h in shards], timeout=RPC_S)]
    stats = svc.stats()
    return {"blocks": [s["blocks_used"] for s in stats["shards"]], "num_sequences": stats["num_sequences"],
            "open_steps": stats["open_steps"], "num_clients": stats["num_clients"],
            "groups": [len(g) for g in ray.get([h.group_names.remote(svc.operator_credential) for h in shards], timeout=RPC_S)],
            "fds": [len(os.listdir(f"/proc/{pid}/fd")) for pid in pids]}


def test_a_dead_clients_step_groups_and_sequences_come_back_within_two_lease_periods(ray_session):
    """Item 2: two client processes are SIGKILLed mid-step (one connected with on_lapse='free', one 'keep').
    Within two lease periods their steps are rolled back, their groups (and fds) are gone from every shard,
    the 'free' client's sequences are freed and the 'keep' client's stay (and can be freed by id); everything
    else is untouched and exact."""
    import select
    import subprocess
    import sys

    lease = 2.0
    cfg = service_config(num_shards=3, client_lease_s=lease, health_check_interval_s=0.2, rpc_timeout_s=RPC_S,
                         collective_timeout_s=60.0)
    svc = cpattn.start(cfg)
    procs = {}
    try:
        oracle = Oracle(cfg, 35)
        mine = svc.add_sequence()
        run_step(svc, oracle, {mine: 6})
        base = _shard_usage(svc)
        gcs = ray.get_runtime_context().gcs_address
        env = user_env()
        for mode in ("free", "keep"):
            procs[mode] = subprocess.Popen([sys.executable, "-c", DYING_CLIENT, gcs, cfg.name, cfg.namespace, mode],
                                           stdout=subprocess.PIPE, text=True, env=env)
        ids = {}
        for mode, proc in procs.items():
            assert select.select([proc.stdout], [], [], 180)[0], f"client {mode} did not get its step open"
            line = proc.stdout.readline().split()
            assert line[:1] == ["READY"], line
            ids[mode] = line[1:]   # credential, sequence a, sequence b
        during = _shard_usage(svc)
        assert during["open_steps"] == 2 and during["num_clients"] == base["num_clients"] + 2
        assert all(g == b + 2 for g, b in zip(during["groups"], base["groups"]))
        for proc in procs.values():
            proc.kill()                                  # processes this test started
            proc.wait(30)
        t0 = time.monotonic()

        def reclaimed():
            now = _shard_usage(svc)
            return now if (now["open_steps"] == 0 and now["groups"] == base["groups"]
                           and now["num_sequences"] == base["num_sequences"] + 2
                           and now["num_clients"] == base["num_clients"]) else None
        after = wait_for(reclaimed, 10 * lease, "the dead clients' resources to come back", 0.05)
        elapsed = time.monotonic() - t0
        print(f"\ndead clients reclaimed in {elapsed:.2f}s (lease {lease}s); fds {base['fds']} -> "
              f"{during['fds']} -> {after['fds']}")
        assert elapsed <= 2 * lease
        # The groups' sockets close once the shard threads that served the dead clients' steps have let go
        # of them (their peers are gone, so that is prompt, but later than the bookkeeping above).
        wait_for(lambda: all(f <= b + 1 for f, b in zip(_shard_usage(svc)["fds"], base["fds"])), 30,
                 f"shard fds back to {base['fds']} (+1)", 0.2)
        # The 'keep' client's sequences stay at their committed lengths (its step rolled back): its credential
        # resumes it. The 'free' client's are gone, and so is its credential.
        cred, keep_a, keep_b = ids["keep"]
        keeper = cpattn.connect(name=cfg.name, namespace=cfg.namespace, credential=cred)
        assert keeper.sequences() == {keep_a: 10, keep_b: 0}
        keeper.free(keep_a)
        keeper.free(keep_b)
        keeper.close()
        with pytest.raises(InvalidRequestError, match="unknown credential"):
            cpattn.connect(name=cfg.name, namespace=cfg.namespace, credential=ids["free"][0])
        assert _shard_usage(svc)["blocks"] == base["blocks"]
        run_step(svc, oracle, {mine: 3})
        assert svc.sequences() == {mine: 9}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        svc.shutdown()


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses listening on ``port`` (from /proc/net/tcp, state 0A = LISTEN)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_clients_cannot_see_read_or_touch_each_other(shared_svc):
    """Item 5: each client proves an unguessable credential; another client's sequence ids are exactly as
    unknown as ids that never existed (list, step, length, fill, free), its step cannot be ended by others,
    stats show other clients only in aggregate (admin lists public ids, never credentials), shards refuse
    KV reads, plans and group joins that do not come from the coordinator, and the data-plane store listens
    on the node IP only. A closed client's credential resumes it with its sequences."""
    from cpattn.cluster.step_planner import ShardStepPlan

    svc = shared_svc
    cfg = svc.config
    spy = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oracle = Oracle(cfg, 36)
        mine = svc.add_sequence()
        run_step(svc, oracle, {mine: 9})
        assert svc.credential != spy.credential and len(svc.credential) >= 40
        before = snapshot(svc, [spy])
        never = "seq-" + "A" * 22
        messages = {}
        for sid in (mine, never):
            for name, call in (("step", lambda: spy.step({sid: 1}).__enter__()),
                               ("length", lambda: spy.sequence_length(sid)),
                               ("fill", lambda: spy.fill_synthetic(sid, 2)), ("free", lambda: spy.free(sid))):
                with pytest.raises(InvalidRequestError, match="unknown or freed sequence") as info:
                    call()
                messages[sid, name] = str(info.value).replace(sid, "<id>")
        for name in ("step", "length", "fill", "free"):      # mine is exactly as unknown as one never issued
            assert messages[mine, name] == messages[never, name]
        assert spy.sequences() == {} and spy.gateway.open_step is None
        assert snapshot(svc, [spy]) == before
        # The coordinator itself refuses calls without (or with another client's) credential.
        with pytest.raises(ray.exceptions.RayTaskError, match="unknown client credential"):
            ray.get(svc.gateway.coordinator.list_sequences.remote(svc.client_id), timeout=RPC_S)   # the public id is no key
        with svc.step({mine: 2}) as step:
            with pytest.raises(ray.exceptions.RayTaskError, match="is not open"):
                ray.get(svc.gateway.coordinator.end_step.remote(step._info.step_id, False, "spy", spy.credential),
                        timeout=RPC_S)
            pending = _attend_all(svc, oracle, step, {mine: 2})
        oracle.commit(pending)
        assert svc.sequences() == {mine: 11}
        # Stats: my own client, the others only in aggregate; the admin view by public id, no credential anywhere.
        seen_by_spy = spy.stats()
        assert seen_by_spy["clients"] == {} and seen_by_spy["other_clients"] == {"clients": 1, "sequences": 1,
                                                                                  "tokens": 11}
        admin = svc.stats(admin=True)
        assert set(admin["clients"]) == {svc.client_id}
        for text in (repr(admin), repr(seen_by_spy), repr(svc.info())):
            assert svc.credential not in text and spy.credential not in text
        # Shards: no KV read, plan or group join without the coordinator's secret / ticket.
        shard = current_shards(svc)[0]
        with pytest.raises(ray.exceptions.RayTaskError, match="read_blocks refused"):
            ray.get(shard.read_blocks.remote([0]), timeout=RPC_S)
        with pytest.raises(ray.exceptions.RayTaskError, match="refused: no valid ticket"):
            ray.get(shard.join_group.remote(svc.gateway.group_name + "x", "127.0.0.1", 1, 1, 4, "gloo"), timeout=RPC_S)
        with pytest.raises(ray.exceptions.RayTaskError, match="refused: no valid ticket"):
            ray.get(shard.leave_group.remote(svc.gateway.group_name), timeout=RPC_S)
        with pytest.raises(ray.exceptions.RayTaskError, match="refused: no valid ticket"):
            ray.get(shard.export_kv.remote(svc.gateway.group_name), timeout=RPC_S)   # the KV cache by CUDA IPC
        forged = ShardStepPlan(step_id=1, num_tokens=1, metadata=None, causal_pieces=torch.zeros(0, 3))
        with pytest.raises(ray.exceptions.RayTaskError, match="run_step refused"):
            ray.get(shard.run_step.remote(spy.gateway.group_name, forged), timeout=RPC_S)
        with pytest.raises(InvalidRequestError, match="not this client's"):
            ray.get(svc.gateway.coordinator.group_ticket.remote(spy.credential, svc.gateway.group_name), timeout=RPC_S)
        # The rendezvous store listens on the node IP only.
        assert _listening_addresses(svc.gateway._store.port) == {ray.util.get_node_ip_address()}
        # close() keeps the sequences; the credential resumes the client, exactly.
        cred = spy.credential
        theirs = spy.add_sequence()
        run_step(spy, oracle, {theirs: 5})
        spy.close()
        spy = cpattn.connect(name=cfg.name, namespace=cfg.namespace, credential=cred)
        assert spy.sequences() == {theirs: 5}
        run_step(spy, oracle, {theirs: 1})
        with pytest.raises(InvalidRequestError, match="still connected"):
            cpattn.connect(name=cfg.name, namespace=cfg.namespace, credential=cred)
        run_step(svc, oracle, {mine: 1})
        spy.free(theirs)
    finally:
        spy.close()


def test_joins_that_never_finish_cannot_hold_the_shards_threads(ray_session):
    """Issue 20: forty joins under a client's own valid tickets whose handshake never finishes. A shard admits
    at most MAX_JOINS_PER_CLIENT of them at once (the rest are refused at once, typed), a ticket admits one join,
    the admitted ones give their thread back after join_timeout_s, and meanwhile the shard's default group, the
    health check and another client's steps go on: nothing is declared hung or replaced."""
    from cpattn.cluster.netstore import make_bound_store
    from cpattn.cluster.shard_groups import MAX_JOINS_PER_CLIENT

    cfg = service_config(num_shards=2, max_open_steps=1, health_check_interval_s=0.2, shard_hang_timeout_s=1.0,
                         rpc_timeout_s=RPC_S, collective_timeout_s=10.0, join_timeout_s=2.0)
    svc = cpattn.start(cfg)
    hostile = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    try:
        oracle = Oracle(cfg, 37)
        a = svc.add_sequence()
        run_step(svc, oracle, {a: 5})
        shard = current_shards(svc)[1]
        host = ray.util.get_node_ip_address()
        names = [f"{hostile.client_id}-block{i}" for i in range(40)]
        tickets = ray.get([hostile.gateway.coordinator.group_ticket.remote(hostile.credential, n) for n in names],
                          timeout=RPC_S)
        stores = [make_bound_store(host, 2, cfg.collective_timeout_s) for _ in names]
        t0 = time.monotonic()
        joins = [shard.join_group.remote(n, host, st.port, 1, 2, "gloo", t) for n, st, t in zip(names, stores, tickets)]
        replayed = [shard.join_group.remote(names[0], host, stores[0].port, 1, 2, "gloo", tickets[0]) for _ in range(5)]
        outcomes = []
        for ref in joins + replayed:
            try:
                outcomes.append(ray.get(ref, timeout=RPC_S))
            except ray.exceptions.RayTaskError as exc:
                outcomes.append(type(exc.cause).__name__)
        took = time.monotonic() - t0
        assert outcomes.count("ServiceError") == MAX_JOINS_PER_CLIENT   # admitted, then given up after 2 s
        assert outcomes.count("CapacityError") + outcomes.count("AccessDeniedError") == 45 - MAX_JOINS_PER_CLIENT
        assert took < cfg.join_timeout_s + 10
        ray.get(shard.kv_checksum.remote(svc.operator_credential), timeout=5.0)   # the default group answers
        run_step(svc, oracle, {a: 2})                                          # another client's step: exact
        assert svc.stats()["shards_replaced"] == 0
    finally:
        hostile.close()
        svc.shutdown()
