"""Issue 21 without Ray: where the data plane binds, a group that cannot connect, placement steering fields, and
shard silence (a lost connection is not a death). The two-host scenario is tests/test_multihost_netns.py."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from cpattn.cluster.data_plane import create_group, connect_group
from cpattn.cluster.netbind import bind_address, interface_address, interface_of
from cpattn.cluster.netstore import make_bound_store
from cpattn.cluster.placement import shard_bundles
from cpattn.cluster.shard_set import ShardSet
from cpattn.config import ServiceConfig
from cpattn.errors import ConfigError, DataPlaneError


def test_bind_address_is_the_node_ip_and_its_interface():
    assert interface_address("lo") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert bind_address("127.0.0.1", None) == ("127.0.0.1", "lo")
    assert bind_address("10.255.255.254", None) == ("10.255.255.254", None)   # no interface holds it here


def test_bind_address_of_a_configured_interface_and_a_missing_one():
    assert bind_address("10.0.0.5", "lo") == ("127.0.0.1", "lo")
    with pytest.raises(DataPlaneError, match=r"data_plane_interface 'nosuch0' has no IPv4 address .*interfaces "
                                             r"there: .*lo \(127\.0\.0\.1\)"):
        bind_address("10.0.0.5", "nosuch0")


def test_a_group_whose_peer_never_joins_fails_in_its_timeout_naming_addresses():
    store = make_bound_store("127.0.0.1", 2, 1.0)
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match=r"rank 0 \(bound to 127\.0\.0\.1\) could not connect to rank 1 at an "
                                             r"unknown address \(it never joined\) within collective_timeout_s=1s"):
        create_group(store, "lonely", 0, 2, "gloo", 1.0, bind_ip="127.0.0.1")
    assert time.monotonic() - t0 < 3.0   # not gloo's 5 x timeout


def test_a_rank_that_cannot_reach_the_rendezvous_fails_in_its_timeout():
    t0 = time.monotonic()
    # Port 9 (discard) on loopback: nothing listens, the store never answers.
    with pytest.raises(DataPlaneError, match=r"rank 1 \(bound to 127\.0\.0\.1\) could not reach the client's "
                                             r"rendezvous at 127\.0\.0\.1:9 within collective_timeout_s=1s"):
        connect_group("127.0.0.1", 9, "unreachable", 1, 2, "gloo", 1.0, bind_ip="127.0.0.1")
    assert time.monotonic() - t0 < 3.0


def test_a_group_bound_to_an_address_works():
    import threading

    store = make_bound_store("127.0.0.1", 2, 5.0)
    groups = {}
    peer = threading.Thread(target=lambda: groups.__setitem__(1, connect_group(
        "127.0.0.1", store.port, "pair", 1, 2, "gloo", 5.0, bind_ip="127.0.0.1")))
    peer.start()
    groups[0] = create_group(store, "pair", 0, 2, "gloo", 5.0, bind_ip="127.0.0.1")
    peer.join()
    got = torch.zeros(4)
    receiver = threading.Thread(target=lambda: groups[1].broadcast([got]).wait())
    receiver.start()
    groups[0].broadcast([torch.arange(4.0)]).wait()
    receiver.join()
    assert torch.equal(got, torch.arange(4.0))


def test_placement_fields_reach_bundles_and_validate():
    cfg = ServiceConfig(num_shards=2, shard_resources='{"cpattn_shard": 1}', coordinator_resources={"head": 0.5},
                        shard_label_selector={"cpattn/shards": "yes"}, data_plane_interface="eth1")
    assert shard_bundles(2, 1.0, 0.0, cfg.shard_resources) == [{"CPU": 1.0, "cpattn_shard": 1.0}] * 2
    with pytest.raises(ConfigError, match=r"shard_resources 'GPU': CPU and GPU come from num_cpus_per_shard"):
        ServiceConfig(shard_resources={"GPU": 1})
    with pytest.raises(ConfigError, match=r"coordinator_resources\['x'\] = 0.0 must be > 0"):
        ServiceConfig(coordinator_resources={"x": 0})
    with pytest.raises(ConfigError, match=r"data_plane_interface 'eth0; rm' is not a network interface name"):
        ServiceConfig(data_plane_interface="eth0; rm")
    with pytest.raises(ConfigError, match=r"shard_label_selector 'k': '': keys and values must be non-empty"):
        ServiceConfig(shard_label_selector={"k": ""})
    with pytest.raises(ConfigError, match=r"is not a JSON mapping"):
        ServiceConfig(shard_resources="{cpattn_shard: 1")


class _Pings:
    """Stands for ray.get on pings: raises what the scenario says, per rank."""

    def __init__(self, outcome):
        self.outcome = outcome

    def __call__(self, ref, timeout=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Handle:
    class ping:   # h.ping.options(...).remote() -> a placeholder ref
        @staticmethod
        def options(**_):
            return _Handle.ping

        @staticmethod
        def remote(*_secret):   # the shard secret proves the coordinator (authority.SHARD_METHODS)
            return object()


def test_a_lost_connection_is_silence_and_lost_only_past_shard_hang_timeout(monkeypatch):
    shards = ShardSet(ServiceConfig(num_shards=1, shard_hang_timeout_s=0.5))
    shards.handles = [_Handle()]
    monkeypatch.setattr(ray, "get", _Pings(ray.exceptions.ActorUnavailableError("connection reset", None)))
    assert shards.check(0.1) == {}          # a transient loss of contact is not a death
    assert 0 in shards.silent
    time.sleep(0.6)
    lost = shards.check(0.1)
    assert "unreachable (ActorUnavailableError" in lost[0] and "shard_hang_timeout_s=0.5" in lost[0]


def test_a_shard_that_answers_again_is_no_longer_silent(monkeypatch):
    shards = ShardSet(ServiceConfig(num_shards=1, shard_hang_timeout_s=0.5))
    shards.handles = [_Handle()]
    monkeypatch.setattr(ray, "get", _Pings(ray.exceptions.GetTimeoutError("no answer")))
    assert shards.check(0.1) == {}
    monkeypatch.setattr(ray, "get", _Pings(True))
    time.sleep(0.6)
    assert shards.check(0.1) == {} and shards.silent == {}
