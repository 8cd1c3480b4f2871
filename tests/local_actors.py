"""Plain objects standing in for Ray actor handles in unit tests without Ray (issue 19's state owners).

``LocalActor(obj).method.remote(*args)`` runs ``obj.method(*args)`` in a thread (an actor serves calls
concurrently: a shard's join blocks until the client's side of the group forms) and returns a Future;
``resolve`` reads futures as ``ray.get`` and ``rpc.call`` read refs: the method's own error raised as itself.
``DeadActor`` answers every call with Ray's RayActorError, as a killed actor does.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

import ray
import torch

_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="local-actor")
_ISSUED: list[Future] = []   # calls not yet known to have returned (settle)


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs) -> Future:
        future = _POOL.submit(self._fn, *args, **kwargs)
        _ISSUED.append(future)
        return future


def settle(timeout_s: float = 10.0) -> None:
    """Until every call made so far has returned (calls whose refs nobody reads: a gateway's leave_group)."""
    wait([f for f in _ISSUED if not f.done()], timeout_s)
    _ISSUED[:] = [f for f in _ISSUED if not f.done()]


class LocalActor:
    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name))


class DeadActor:
    """A killed actor: every call's ref raises RayActorError when read."""

    def __getattr__(self, name: str) -> _Method:
        def died(*args, **kwargs):
            raise ray.exceptions.RayActorError()
        return _Method(died)


def resolve(refs, timeout_s: float | None = None, what: str = "", *, timeout: float | None = None):
    """``ray.get(refs, timeout=...)`` and ``rpc.call(refs, timeout_s, what)`` for LocalActor's futures."""
    limit = timeout if timeout is not None else timeout_s
    if isinstance(refs, list):
        return [r.result(limit) for r in refs]
    return refs.result(limit)


def plain_coordinator(cfg):
    """A plain Coordinator (no Ray) whose shards are plain shard surfaces (``.workers``) behind LocalActors.
    Its fill_synthetic reads refs with ``ray.get``: patch ``coordinator_sequences.ray`` with ``FakeRay``."""
    from cpattn.cluster.coordinator import Coordinator
    from cpattn.cluster.shard import RemoteShard

    threads = torch.get_num_threads()
    coord = Coordinator(cfg)
    coord.workers = [RemoteShard(cfg, r, secret=coord.gen.shard_secret) for r in range(cfg.num_shards)]
    torch.set_num_threads(threads)   # a shard worker pins its process to num_cpus_per_shard threads
    coord.shard_set.handles = [LocalActor(w) for w in coord.workers]
    return coord


class FakeRay:
    """Stands in for the ``ray`` module where code reads refs with ray.get (coordinator_sequences)."""

    get = staticmethod(resolve)
