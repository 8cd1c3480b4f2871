"""The client's data-plane group (cluster/client_group.py) on a real Gateway without Ray: its coordinator is a plain
Coordinator and its shards plain shard surfaces behind LocalActor handles (tests/local_actors.py), joined over gloo
on loopback. Group names per epoch and generation, leave and rejoin bookkeeping, and rejoin's retry when a shard
dies while the new group forms (and only then), bounded in attempts and in time."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import ray

from conftest import service_config
from cpattn.cluster import client_group, coordinator_sequences, gateway, shard_groups
from cpattn.cluster.gateway import Gateway
from cpattn.cluster.messages import ShardsReply
from cpattn.errors import ConfigError, DataPlaneError, ServiceError
from local_actors import DeadActor, FakeRay, LocalActor, plain_coordinator, resolve, settle

HOST = "127.0.0.1"


def _fake_wait(refs, num_returns: int, timeout: float):
    done, pending = concurrent.futures.wait(refs, timeout)
    return list(done), list(pending)


@pytest.fixture
def coord(monkeypatch):
    for module in (client_group, gateway):
        monkeypatch.setattr(module, "call", resolve)
    monkeypatch.setattr(coordinator_sequences, "ray", FakeRay)
    monkeypatch.setattr(ray, "wait", _fake_wait)               # _collect_failed_joins reads the shards' joins
    monkeypatch.setattr(ray, "get", resolve)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: HOST)
    monkeypatch.setattr(shard_groups, "_node_ip", lambda: HOST)
    c = plain_coordinator(service_config(num_shards=2, collective_timeout_s=2.0, health_check_interval_s=0.1))
    c.shard_set.infos = [w._impl.info().with_rank(r) for r, w in enumerate(c.workers)]
    return c


@pytest.fixture
def gw(coord):
    g = Gateway(LocalActor(coord), coord.config, registered=coord.register_client())
    g.lease.stop()   # no heartbeats here: its ray.get would start a Ray instance once the patches are gone
    yield g
    g.leave()


def _groups(coord) -> list[list[str]]:
    """Each shard's groups, once the leaves sent so far (fire and forget) have landed."""
    settle()
    return [w._impl.group_names() for w in coord.workers]


def test_join_forms_one_group_with_every_remote_shard(coord, gw):
    reply = coord.get_shards(gw.credential)                           # what join read: a typed reply
    assert isinstance(reply, ShardsReply) and reply.epoch == 0 and reply.shards == coord.shard_set.handles
    assert [i.rank for i in reply.infos] == [0, 1] and gw.shards == reply.shards
    assert gw.group_name == f"{gw.client_id}-e0-g1" and gw.epoch == 0
    assert gw.remote == [0, 1] and gw.local == {} and gw.plane.world_size == 3 and gw.plane.backend == "gloo"
    assert _groups(coord) == [[gw.group_name]] * 2


def test_rejoin_leaves_the_old_group_and_names_the_new_one_after_the_epoch(coord, gw):
    first = gw.group_name
    gw.rejoin()
    assert gw.group_name == f"{gw.client_id}-e0-g2" and _groups(coord) == [[gw.group_name]] * 2
    coord.gen.shard_replaced()                       # a shard was replaced: the next group is on epoch 1
    gw.rejoin()
    assert gw.epoch == 1 and gw.group_name == f"{gw.client_id}-e1-g3"
    assert _groups(coord) == [[gw.group_name]] * 2 and first not in _groups(coord)[0]
    gw.leave()
    assert gw.plane is None and gw.local == {} and _groups(coord) == [[], []]


def _shard_died() -> DataPlaneError:
    """What join raises when a shard died while the group formed (rpc.call of a dead actor's join)."""
    exc = DataPlaneError("data-plane group did not form (a shard died while the group formed)")
    exc.__cause__ = ray.exceptions.RayActorError()
    return exc


class ScriptedJoins:
    """Gateway.join raising each of ``failures`` in turn (the coordinator's epoch bumped ``after_s`` later, as
    its health check replaces the shard), then the real join."""

    def __init__(self, gw, coord, failures: list[BaseException], after_s: float | None = 0.2):
        self.gw, self.real, self.coord, self.failures, self.after_s = gw, gw.join, coord, list(failures), after_s
        self.calls = 0
        gw.join = self

    def __call__(self) -> None:
        self.calls += 1
        if not self.failures:
            return self.real()
        self.gw.epoch = self.coord.gen.epoch   # as join does first (get_shards), before its group fails
        if self.after_s is not None:
            threading.Timer(self.after_s, self.coord.gen.shard_replaced).start()
        raise self.failures.pop(0)


def test_a_shard_dying_while_the_group_forms_is_waited_out_and_joined_again(coord, gw):
    joins = ScriptedJoins(gw, coord, [_shard_died()])
    gw.rejoin()
    assert joins.calls == 2 and gw.epoch == 1 and gw.group_name == f"{gw.client_id}-e1-g2"
    assert _groups(coord) == [[gw.group_name]] * 2


def test_a_dead_shard_in_a_real_join_is_replaced_and_joined_again(coord, gw):
    """Unscripted: shard 1's handle is a dead actor; its join never connects, the group times out
    (collective_timeout_s), the dead join's RayActorError is found, and the replacement is joined."""
    healthy = coord.shard_set.handles[1]
    coord.shard_set.handles[1] = DeadActor()

    def replace() -> None:
        coord.shard_set.handles[1] = healthy
        coord.gen.shard_replaced()

    threading.Timer(coord.config.collective_timeout_s + 0.5, replace).start()
    gw.rejoin()
    assert gw.epoch == 1 and gw.group_name == f"{gw.client_id}-e1-g3"    # g2 failed, g3 formed
    assert _groups(coord) == [[gw.group_name]] * 2


@pytest.mark.parametrize("failure", [ServiceError("get_shards did not answer within 60s (rpc_timeout_s)"),
                                     DataPlaneError("rank 1 could not reach the client's rendezvous"),
                                     ConfigError("data_plane 'nccl' needs the client and every shard on a GPU")])
def test_any_other_failure_raises_at_once(coord, gw, failure):
    joins = ScriptedJoins(gw, coord, [failure], after_s=None)
    with pytest.raises(type(failure), match=str(failure)[:20]):
        gw.rejoin()
    assert joins.calls == 1 and gw.plane is None and _groups(coord) == [[], []]   # left, nothing rejoined


def test_rejoin_gives_up_after_max_joins(coord, gw):
    joins = ScriptedJoins(gw, coord, [_shard_died() for _ in range(client_group.MAX_JOINS)])
    with pytest.raises(DataPlaneError, match="a shard died while the group formed"):
        gw.rejoin()
    assert joins.calls == client_group.MAX_JOINS and gw.plane is None


def test_the_wait_for_a_replacement_is_bounded(coord, gw):
    gw.config = coord.config.model_copy(update={"start_timeout_s": 0.3, "rpc_timeout_s": 0.5})
    joins = ScriptedJoins(gw, coord, [_shard_died()], after_s=None)   # the shard is never replaced
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match="the service did not replace it within 1s: check `cpattn status`") as info:
        gw.rejoin()
    assert 0.9 <= time.monotonic() - t0 < 5 and joins.calls == 1
    assert isinstance(info.value.__cause__, DataPlaneError)


def test_leave_survives_a_shard_that_is_gone(coord, gw):
    group = gw.group_name
    gw.shards = [gw.shards[0], None]                 # shard 1 lost; its replacement not started yet
    gw.leave()
    assert gw.plane is None and gw.local == {} and gw.client_graphs is None
    assert _groups(coord) == [[], [group]]           # shard 0 left; the lost one is dropped by the coordinator
