"""Issue 20: every remote method refuses a caller without the right proof; tickets are bound to the client's
lease and spent by one join; joins that never finish give their thread back; the operator credential.

The stranger is this test process: connected to the same Ray cluster, holding actor handles, but without
the credential a method needs. One module-scoped service (test_hooks off, as a production service runs).
"""

from __future__ import annotations

import inspect
import time

import pytest
import ray

import cpattn
from conftest import service_config
from cpattn.cluster import authority
from cpattn.cluster.coordinator import Coordinator
from cpattn.cluster.shard import RemoteShard, ShardWorker
from cpattn.cluster.shard_groups import MAX_JOINS_PER_CLIENT
from cpattn.errors import AccessDeniedError, CapacityError, ServiceError
from reliability_common import RPC_S, current_shards
from service_oracle import Oracle, run_step

FORGED = "not-the-credential"


@pytest.fixture(scope="module")
def service(ray_session):
    cfg = service_config(num_shards=2, test_hooks=False, rpc_timeout_s=RPC_S)
    svc = cpattn.start(cfg)
    try:
        yield svc
    finally:
        svc.shutdown()


def _refusal(ref) -> AccessDeniedError:
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(ref, timeout=RPC_S)
    assert isinstance(info.value.cause, AccessDeniedError), info.value
    return info.value.cause


def _stranger_call(method, impl_fn, rule: authority.Rule, proof=FORGED):
    """``method.remote(...)`` with None for every required parameter and the proof (by name) forged."""
    params = [p for p in inspect.signature(impl_fn).parameters.values() if p.name != "self"]
    kwargs = {p.name: None for p in params if p.default is inspect.Parameter.empty}
    return method.remote(**dict(kwargs, **{rule.proof: proof}))


def test_every_remote_method_refuses_a_stranger(service):
    coordinator = service.gateway.coordinator
    shard = current_shards(service)[0]
    refused = []
    for name, rule in authority.COORDINATOR_METHODS.items():
        if rule.who == authority.OPEN:
            continue
        for proof in (None, FORGED):
            _refusal(_stranger_call(getattr(coordinator, name), getattr(Coordinator, name), rule, proof))
        refused.append(name)
    for name, rule in authority.SHARD_METHODS.items():
        for proof in (None, FORGED):
            _refusal(_stranger_call(getattr(shard, name), getattr(ShardWorker, name), rule, proof))
        refused.append(name)
    assert len(refused) == len(authority.COORDINATOR_METHODS) - 1 + len(authority.SHARD_METHODS)
    # Only register_client is open: it is how a client gets its credential.
    assert [n for n, r in authority.COORDINATOR_METHODS.items() if r.who == authority.OPEN] == ["register_client"]


def test_the_actors_expose_only_their_tables(service):
    """Ray exposes every method of an actor's class, private ones included: the surfaces have only the table's,
    and the methods Ray adds to every actor (which run anything on it: why anyone holding the Ray token is an
    operator, README Security), which nothing in cpattn can take away."""
    coordinator = service.gateway.coordinator
    shard = current_shards(service)[0]
    for handle, table in ((coordinator, authority.COORDINATOR_METHODS), (shard, authority.SHARD_METHODS)):
        exposed = {m for m in handle._ray_method_signatures if not m.startswith("__")}
        assert exposed == set(table)
        assert {m for m in handle._ray_method_signatures if m.startswith("__")} == {"__init__", *authority.RAY_ACTOR_METHODS}
    for private in ("_end_client", "_replace", "authorize", "expire_clients", "recover", "check_shards"):
        with pytest.raises(AttributeError):
            getattr(coordinator, private)
    with pytest.raises(AttributeError):
        getattr(shard, "_refuse_fenced")


def test_a_client_credential_is_not_the_operators(service):
    coordinator = service.gateway.coordinator
    other = cpattn.connect(name=service.config.name, namespace=service.config.namespace)
    try:
        err = _refusal(coordinator.shutdown.remote(other.credential))
        assert "operator credential" in str(err)
        _refusal(coordinator.stats.remote(other.credential, True))
        with pytest.raises(AccessDeniedError, match="only the operator may"):
            other.shutdown()
        run_step(other, Oracle(other.config, 3), {other.add_sequence(): 3})   # still connected and working
        # A wrong operator credential: refused before this client ends anything (it closed itself first, and its
        # lease then lapsed and freed its sequences), and said as what it is, not as an unknown client.
        other.operator_credential = authority.new_operator_credential()
        admin_stats = lambda: other.stats(admin=True)   # noqa: E731
        for call, what in ((other.shutdown, r"shutdown\(\)"), (admin_stats, r"stats\(admin=True\)")):
            with pytest.raises(AccessDeniedError, match=what + " refused: operator_credential is not this service's"):
                call()
        other.operator_credential = None
        run_step(other, Oracle(other.config, 4), {other.add_sequence(): 2})   # not closed: its lease renewed
        shard = current_shards(service)[0]
        for method in ("kv_checksum", "group_names", "info", "simulate_hang"):
            _refusal(getattr(shard, method).remote(other.credential))
        # test hooks are off: not even the operator makes a shard look hung
        err = _refusal(shard.simulate_hang.remote(service.operator_credential, True))
        assert "test_hooks" in str(err)
        assert ray.get(shard.group_names.remote(service.operator_credential), timeout=RPC_S)
        assert set(service.stats(admin=True)["clients"]) <= {service.client_id, other.client_id}
    finally:
        other.close()


def test_tickets_are_spent_by_one_join_and_void_once_their_client_ended(service):
    from cpattn.cluster.netstore import make_bound_store

    cfg = service.config
    client = cpattn.connect(name=cfg.name, namespace=cfg.namespace)
    coordinator, shard = client.gateway.coordinator, current_shards(service)[1]
    host = ray.util.get_node_ip_address()
    # The client's live group was joined with its ticket: the same ticket joins nothing more.
    err = _refusal(shard.join_group.remote(client.gateway.group_name, host, 1, 1, 2, "gloo", client.gateway._ticket))
    assert "already used" in str(err)
    name = f"{client.client_id}-later"
    ticket = ray.get(coordinator.group_ticket.remote(client.credential, name), timeout=RPC_S)
    client.close()
    store = make_bound_store(host, 2, 5.0)
    err = _refusal(shard.join_group.remote(name, host, store.port, 1, 2, "gloo", ticket))
    assert "ended after it was issued" in str(err)
    # Another group's ticket, or a ticket edited to name another group, proves nothing.
    _refusal(shard.join_group.remote(name + "x", host, store.port, 1, 2, "gloo", ticket))


def _plain_shard(secret: str = "s3cret", **overrides) -> RemoteShard:
    """The shard's remote surface in this process (no Ray): the same checks Ray's actor runs."""
    cfg = service_config(num_shards=1, **overrides)
    return RemoteShard(cfg, 0, None, secret, True, authority.digest("op"))


def test_an_expired_ticket_and_the_join_limits_in_process():
    from cpattn.cluster.netstore import make_bound_store

    shard = _plain_shard(client_lease_s=5.0, join_timeout_s=1.0, collective_timeout_s=4.0)
    old = authority.make_ticket("s3cret", "c-1-a", "c-1", time.time() - 6.0)
    with pytest.raises(AccessDeniedError, match="expired"):
        shard.join_group("c-1-a", "127.0.0.1", 1, 1, 2, "gloo", old)
    with pytest.raises(AccessDeniedError, match="no valid ticket"):
        shard.join_group("c-2-a", "127.0.0.1", 1, 1, 2, "gloo", old)   # c-1's ticket for c-2's group
    # Joins whose peer never comes: the caller gets its thread back after join_timeout_s; a client has at most
    # MAX_JOINS_PER_CLIENT in flight (the handshakes go on, bounded by collective_timeout_s, in their own threads).
    store = make_bound_store("127.0.0.1", 2, 10.0)
    for i in range(MAX_JOINS_PER_CLIENT):
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="did not finish within join_timeout_s"):
            shard.join_group(f"c-1-g{i}", "127.0.0.1", store.port, 1, 2, "gloo",
                             authority.make_ticket("s3cret", f"c-1-g{i}", "c-1", time.time()))
        assert time.monotonic() - t0 < 3.0
    with pytest.raises(CapacityError, match="still in their handshake"):
        shard.join_group("c-1-g9", "127.0.0.1", store.port, 1, 2, "gloo",
                         authority.make_ticket("s3cret", "c-1-g9", "c-1", time.time()))
    assert shard.group_names("op") == []


def test_the_operator_credential_stops_the_service_and_nothing_else_does(ray_session):
    cfg = service_config(num_shards=1)
    svc = cpattn.start(cfg)
    try:
        attached = cpattn.connect(name=cfg.name, namespace=cfg.namespace, operator_credential=svc.operator_credential)
        _refusal(svc.gateway.coordinator.shutdown.remote(FORGED))
        _refusal(svc.gateway.coordinator.start.remote(FORGED))
        attached.shutdown()   # an operator attached with the credential may stop it
        with pytest.raises(ValueError):
            ray.get_actor(cfg.name, namespace=cfg.namespace)
    finally:
        try:
            svc.shutdown()
        except cpattn.CpattnError:
            pass


def test_operator_credentials_never_look_like_an_option():
    """`cpattn status --operator-credential CREDENTIAL` failed in CI when a bare url-safe token began with '-'
    (argparse took it for an option): every credential starts with a letter, and the CLI parses it."""
    from cpattn.launch.cli import build_parser

    for _ in range(2000):   # a bare token began with '-' once in 64
        credential = authority.new_operator_credential()
        assert credential[0].isalpha() and len(credential) > 40, credential
    credential = "op-" + "-" * 8
    args = build_parser().parse_args(["status", "--name", "svc", "--operator-credential", credential])
    assert args.operator_credential == credential
