"""Where a client computes: its device, whether its wire to the shards is NCCL or gloo, and a shard's KV cache
opened in the client's process by CUDA IPC (cluster.gateway)."""

from __future__ import annotations

import torch

from cpattn.cluster.messages import ShardInfo
from cpattn.config import ServiceConfig
from cpattn.errors import ConfigError


def client_device(config: ServiceConfig) -> torch.device:
    """The GPU this process computes on (its current device) when the shards are on CUDA, else the CPU."""
    if config.resolved_device() == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_data_plane(config: ServiceConfig, device: torch.device, remote_infos: list[ShardInfo]) -> str:
    """nccl when the gateway and every remote shard each have a GPU of their own; gloo otherwise."""
    gpus = [_gpu_uuid(device)] + [i.gpu_uuid for i in remote_infos]
    nccl_ok = device.type == "cuda" and None not in gpus and len(set(gpus)) == len(gpus)
    if config.data_plane == "nccl" and not nccl_ok:
        raise ConfigError("data_plane 'nccl' needs the client and every shard it reaches over the wire on a GPU "
                          "of its own (NCCL cannot have two ranks on one GPU): use data_plane 'auto'")
    if config.data_plane == "gloo":
        return "gloo"
    return "nccl" if nccl_ok else "gloo"


def _gpu_uuid(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def open_shared_cache(handle_args: tuple, device: torch.device) -> torch.Tensor:
    """A shard's exported KV cache, opened on this process's index of the same physical GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle_args)
    args[6] = device.index   # the shard numbered its GPU 0 (Ray narrows its visible devices)
    return rebuild_cuda_tensor(*args)
