"""A shard's data-plane groups (cluster/shard_groups.py) on a plain shard surface, without Ray: real gloo groups on
loopback with the client's side made here, tickets checked (forged, another client's, expired, spent, issued before
the client ended), joins bounded per client, and the bookkeeping of join, leave and drop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import service_config
from cpattn.cluster import authority, shard_groups
from cpattn.cluster.data_plane import create_group
from cpattn.cluster.netstore import make_bound_store
from cpattn.cluster.shard import RemoteShard, ShardWorker
from cpattn.errors import AccessDeniedError, CapacityError, ServiceError

SECRET = "k" * 64
HOST = "127.0.0.1"


@pytest.fixture
def shard(monkeypatch):
    monkeypatch.setattr(shard_groups, "_node_ip", lambda: HOST)
    threads = torch.get_num_threads()
    surface = RemoteShard(service_config(num_shards=2, join_timeout_s=10.0, collective_timeout_s=3.0), 0,
                          secret=SECRET)
    torch.set_num_threads(threads)   # a shard worker pins its process to num_cpus_per_shard threads
    yield surface
    for name in surface.group_names(SECRET):
        surface.leave_group(name, _ticket(name))


def _ticket(group: str, issued_at: float | None = None) -> str:
    client = group.split("-e")[0]
    return authority.make_ticket(SECRET, group, client, time.time() if issued_at is None else issued_at)


def _join(shard, group: str, ticket: str):
    """The client's side (rank 0) and the shard's (rank 1) of a two-rank gloo group; the client's process group."""
    store = make_bound_store(HOST, 2, 5.0)
    made: dict = {}
    client = threading.Thread(target=lambda: made.update(pg=create_group(store, group, 0, 2, "gloo", 5.0,
                                                                         bind_ip=HOST)))
    client.start()
    try:
        assert shard.join_group(group, HOST, store.port, 1, 2, "gloo", ticket) is True
    finally:
        client.join(10)
    made["store"] = store   # the store outlives the group
    return made


def _state(shard) -> tuple:
    impl = shard._impl
    return sorted(impl._groups), dict(impl._joining), dict(impl._admitted)


def test_a_ticketed_join_forms_a_working_group_that_leave_closes(shard):
    ticket = _ticket("c-1-e0-g1")
    client = _join(shard, "c-1-e0-g1", ticket)
    assert shard.group_names(SECRET) == ["c-1-e0-g1"] and shard._impl._joining == {}
    plane = shard._impl._groups["c-1-e0-g1"]
    ones = torch.ones(3, dtype=torch.float64)
    theirs = threading.Thread(target=lambda: plane.group.allreduce([ones]).wait())
    theirs.start()
    mine = torch.full((3,), 2.0, dtype=torch.float64)
    client["pg"].allreduce([mine]).wait()
    theirs.join(5)
    assert mine.tolist() == [3.0, 3.0, 3.0]                              # the shard's rank answered on the wire
    shard.leave_group("c-1-e0-g1", ticket)
    assert shard.group_names(SECRET) == []
    shard.leave_group("c-1-e0-g1", ticket)                               # leaving twice is harmless


def test_a_ticket_admits_one_join(shard):
    ticket = _ticket("c-1-e0-g1")
    _join(shard, "c-1-e0-g1", ticket)
    before = _state(shard)
    with pytest.raises(AccessDeniedError, match="its ticket was already used .*rejoin under a new group name"):
        shard.join_group("c-1-e0-g1", HOST, 1, 1, 2, "gloo", ticket)
    with pytest.raises(AccessDeniedError, match="its ticket was already used"):
        shard.join_group("c-1-e0-g1", HOST, 1, 1, 2, "gloo", _ticket("c-1-e0-g1"))   # the group exists
    assert _state(shard) == before


def test_bad_tickets_are_refused_before_anything_changes(shard):
    before = _state(shard)
    group = "c-1-e0-g1"
    with pytest.raises(AccessDeniedError, match="group 'c-1-e0-g1' refused: no valid ticket"):
        shard.join_group(group, HOST, 1, 1, 2, "gloo", "c-1|0|forged")
    with pytest.raises(AccessDeniedError, match="no valid ticket"):
        shard.join_group(group, HOST, 1, 1, 2, "gloo", _ticket("c-2-e0-g1"))   # another client's group
    with pytest.raises(AccessDeniedError, match="no valid ticket"):
        shard.join_group(group, HOST, 1, 1, 2, "gloo", authority.make_ticket("other" * 8, group, "c-1", time.time()))
    with pytest.raises(AccessDeniedError, match="its ticket expired \\(tickets last client_lease_s=30s\\)"):
        shard.join_group(group, HOST, 1, 1, 2, "gloo", _ticket(group, time.time() - 31))
    assert _state(shard) == before


def test_the_plain_worker_refuses_a_forged_ticket_too(monkeypatch):
    """Without the surface (a plain worker has the secret): a forged ticket is an AccessDeniedError, not a crash."""
    monkeypatch.setattr(shard_groups, "_node_ip", lambda: HOST)
    threads = torch.get_num_threads()
    worker = ShardWorker(service_config(num_shards=2), 0, secret=SECRET)
    torch.set_num_threads(threads)
    with pytest.raises(AccessDeniedError, match="shard 0: group 'c-1-e0-g1' refused: no valid ticket"):
        worker.join_group("c-1-e0-g1", HOST, 1, 1, 2, "gloo", "c-1|0|forged")
    assert worker._admitted == {} and worker._joining == {}


def test_dropping_a_client_closes_its_groups_and_voids_its_older_tickets(shard):
    _join(shard, "c-1-e0-g1", _ticket("c-1-e0-g1"))
    _join(shard, "c-1-e1-g2", _ticket("c-1-e1-g2"))
    _join(shard, "c-2-e0-g1", _ticket("c-2-e0-g1"))
    issued_before = _ticket("c-1-e1-g3", time.time() - 1)
    ended_at = time.time()
    assert shard.drop_client(SECRET, "c-1", ended_at) == 2
    assert shard.group_names(SECRET) == ["c-2-e0-g1"]                   # the other client's group stays
    with pytest.raises(AccessDeniedError, match="the ticket's client ended after it was issued: connect again"):
        shard.join_group("c-1-e1-g3", HOST, 1, 1, 2, "gloo", issued_before)
    _join(shard, "c-1-e2-g4", _ticket("c-1-e2-g4", ended_at + 0.5))     # a client that connected again joins
    assert shard.group_names(SECRET) == ["c-2-e0-g1", "c-1-e2-g4"]
    with pytest.raises(AccessDeniedError, match="drop_client refused: only the service's coordinator"):
        shard.drop_client("not-the-secret", "c-2")
    assert shard.drop_client(SECRET, "c-9") == 0


def test_handshakes_that_never_finish_are_bounded_per_client(shard):
    shard._impl.config = shard._impl.config.model_copy(update={"join_timeout_s": 0.3, "collective_timeout_s": 1.5})
    store = make_bound_store(HOST, 2, 5.0)   # the client never forms its side: the shards' handshakes hang
    for g in (1, 2):
        with pytest.raises(ServiceError, match=f"group 'c-1-e0-g{g}': the handshake did not finish within "
                                               "join_timeout_s=0.3s"):
            shard.join_group(f"c-1-e0-g{g}", HOST, store.port, 1, 2, "gloo", _ticket(f"c-1-e0-g{g}"))
    assert shard._impl._joining == {"c-1": shard_groups.MAX_JOINS_PER_CLIENT}
    with pytest.raises(CapacityError, match="2 joins of this client and 2 in all are still in their handshake"):
        shard.join_group("c-1-e0-g3", HOST, store.port, 1, 2, "gloo", _ticket("c-1-e0-g3"))
    assert shard._impl._joining == {"c-1": 2} and "c-1-e0-g3" not in shard.group_names(SECRET)
    deadline = time.monotonic() + 10
    while shard._impl._joining and time.monotonic() < deadline:   # each gives up within collective_timeout_s
        time.sleep(0.05)
    assert shard._impl._joining == {} and shard.group_names(SECRET) == []   # nothing joined meanwhile


def test_groups_held_are_bounded_per_client(shard):
    """Each genuine ticket admits one join, but joined groups stay until left: a client holds at most
    MAX_GROUPS_PER_CLIENT on a shard; one more is refused (nothing changes), other clients join, and leaving one
    makes room."""
    cap = shard_groups.MAX_GROUPS_PER_CLIENT
    clients = [_join(shard, f"c-1-e0-g{g}", _ticket(f"c-1-e0-g{g}")) for g in range(cap)]
    before = _state(shard)
    with pytest.raises(CapacityError, match=f"this client holds {cap} data-plane groups here"):
        shard.join_group("c-1-e0-gx", HOST, 1, 1, 2, "gloo", _ticket("c-1-e0-gx"))
    assert _state(shard) == before
    clients.append(_join(shard, "c-2-e0-g1", _ticket("c-2-e0-g1")))   # another client is not held back
    shard.leave_group("c-1-e0-g0", _ticket("c-1-e0-g0"))
    clients.append(_join(shard, "c-1-e0-gx", _ticket("c-1-e0-gx")))
    assert sum(n.startswith("c-1-") for n in shard.group_names(SECRET)) == cap


def test_a_fenced_step_drops_its_group(shard):
    _join(shard, "c-1-e0-g1", _ticket("c-1-e0-g1"))
    _join(shard, "c-2-e0-g1", _ticket("c-2-e0-g1"))
    impl = shard._impl
    impl._fence.raise_floor(2, 1.0)                                        # a restarted coordinator's fence
    plan = SimpleNamespace(step_id=9, incarnation=1)
    report = impl._refuse_fenced(impl._groups["c-1-e0-g1"], plan, {"layers": 0})
    assert report == {"layers": 0, "outcome": "fenced", "error": "step 9 was fenced by a restarted coordinator"}
    assert shard.group_names(SECRET) == ["c-2-e0-g1"]                   # the client's collective fails at once
