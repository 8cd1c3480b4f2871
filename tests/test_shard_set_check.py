"""ShardSet.check counts an answer only for the shard it asked: a shard replaced while a check's ping to its
predecessor was out is not declared lost by that ping (it was replaced a second time: the chaos test saw 4
replacements for 3 kills, CI 2026-12-01). Runs without Ray actors: the pings' answers are faked."""

from __future__ import annotations

import pytest
import ray

from cpattn.cluster import shard_set as shard_set_module
from cpattn.cluster.messages import ShardInfo
from cpattn.cluster.shard_set import ShardSet
from conftest import service_config


class _Ping:
    def __init__(self, handle):
        self.handle = handle

    def options(self, **_):
        return self

    def remote(self, _secret):
        return self.handle   # the "ref" is the handle asked


class _Handle:
    def __init__(self, name: str):
        self.name, self.ping = name, _Ping(self)


def _answers(shards: ShardSet, replace_during: dict):
    """ray.get for the fake pings: a handle in ``replace_during`` is replaced by its value while its ping is out,
    then its answer comes (an exception to raise, or True)."""
    def get(ref, timeout=None):
        outcome = True
        if ref in replace_during:
            new, outcome = replace_during.pop(ref)
            rank = shards.handles.index(ref)
            shards.install(rank, new, ShardInfo(bundle_index=rank, rank=rank))
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return get


@pytest.mark.parametrize("answer", ["died", "silent", "unreachable"])
def test_a_ping_of_a_replaced_shard_does_not_lose_its_replacement(monkeypatch, answer):
    shards = ShardSet(service_config(num_shards=3, shard_hang_timeout_s=0.001), secret="s")
    old = [_Handle(f"old{r}") for r in range(3)]
    shards.handles, shards.infos = list(old), [ShardInfo(bundle_index=r, rank=r) for r in range(3)]
    new = _Handle("new1")
    error = {"died": ray.exceptions.RayActorError(), "silent": ray.exceptions.GetTimeoutError(),
             "unreachable": ray.exceptions.ActorUnavailableError("reset", None)}[answer]
    monkeypatch.setattr(shard_set_module.ray, "get", _answers(shards, {old[1]: (new, error)}))
    assert shards.check(timeout_s=0.1) == {}
    assert shards.handles[1] is new and shards.lost == {} and 1 not in shards._silent_since
    # the replacement itself is asked by the next check; its own death is a loss
    monkeypatch.setattr(shard_set_module.ray, "get", _answers(shards, {new: (new, ray.exceptions.RayActorError())}))
    assert set(shards.check(timeout_s=0.1)) == {1}


def test_a_dead_shard_still_installed_is_lost(monkeypatch):
    shards = ShardSet(service_config(num_shards=2), secret="s")
    old = [_Handle(f"old{r}") for r in range(2)]
    shards.handles, shards.infos = list(old), [ShardInfo(bundle_index=r, rank=r) for r in range(2)]

    def get(ref, timeout=None):
        if ref is old[0]:
            raise ray.exceptions.RayActorError()
        return True
    monkeypatch.setattr(shard_set_module.ray, "get", get)
    lost = shards.check(timeout_s=0.1)
    assert set(lost) == {0} and "died" in lost[0]
