"""Typed replies that cross processes (issue 19): what a shard's ``info()`` says about itself.

A dataclass instead of a dict with string keys: a misspelt field fails where it is read, the fields are
listed once, and Ray pickles it between the shard, the coordinator and the client like any object.
The public surface (``Service.info()``, ``stats()``, ``cpattn status --json``) still shows plain dicts:
``as_dict()``. (begin_step / end_step / run_step replies follow with the decode work, issue 18.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardInfo:
    """One shard: where it runs, what it serves with, and how much KV it holds."""

    bundle_index: int
    """Its bundle in the service's placement group (names the actor; kept by a replacement)."""
    rank: int | None = None
    """Its DCP rank: set by the coordinator once ranks are assigned (by node, then GPU); None before."""
    node_id: str | None = None
    node_ip: str | None = None
    gpu_ids: tuple[str, ...] = ()
    """What Ray assigned the actor (ray.get_gpu_ids())."""
    gpu_uuid: str | None = None
    """The CUDA device's UUID (None on CPU): a client on the same GPU opens the shard's cache by CUDA IPC."""
    pid: int | None = None
    device: str | None = None
    backend: str | None = None
    """The attention backend's name (select_backend's choice in the shard's process)."""
    kernel_version: str | None = None
    lse_base: str | None = None
    num_blocks: int | None = None
    kernel_block_size: int | None = None
    ready: bool = True
    """False for a replacement until the coordinator has refilled it."""
    kv_cache_dtype: str | None = None
    kv_bytes: int | None = None
    """None fields: a shard that has not answered (missing after a coordinator restart)."""

    def with_rank(self, rank: int) -> "ShardInfo":
        return dataclasses.replace(self, rank=rank)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
