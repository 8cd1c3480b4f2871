"""The data plane: a torch.distributed group joining a client's gateway (rank 0) and the shards.

Per-layer tensors travel only here, never through Ray calls (1 ms and up per call, 120 ms for
16 MB). Groups are built directly from a TCPStore rather than init_process_group, so one shard
process can belong to one group per connected client at the same time. gloo runs on CPU and when
shards share a GPU (NCCL between two ranks on one GPU hangs); NCCL across GPUs.

Wire protocol per layer: two collectives, nothing else.
  message  uint8 [32 + T (Hq + 2 Hk) D itemsize] = int64 header (command, layer, step_id, T) | q|k|v
           broadcast from rank 0; an ABORT message has the same size, its payload unused
  partial  [T, Hq, D + 1] float32/64 = out | natural-log lse, gathered to rank 0
A shard's step ends after it served every layer (the coordinator, not the shard, decides commit
or rollback, so no closing message is needed) or on ABORT when the client stops early.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

CMD_ATTEND = 1
CMD_ABORT = 3
HEADER_BYTES = 32


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.Store:
    return dist.TCPStore(host, port, world_size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def create_group(store: dist.Store, group_name: str, rank: int, world_size: int, backend: str,
                 timeout_s: float, device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group over ``store`` namespaced by ``group_name``; blocks until every rank joins."""
    prefix = dist.PrefixStore(f"cpattn/{group_name}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    raise ValueError(f"data plane backend {backend!r}: use gloo or nccl")


class DataPlane:
    """Broadcast/gather over one group; stages CUDA tensors through the CPU when the backend is gloo."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, backend: str):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.backend == "gloo" and t.is_cuda else t

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place from rank 0; returns the tensor on its original device."""
        wire = self._wire(tensor).contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([wire], opts).wait()
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape/dtype) on rank 0, on the wire's device; None elsewhere."""
        wire = self._wire(tensor).contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(wire) for _ in range(self.world_size)]] if self.rank == 0 else []
        self.group.gather(outs, [wire], opts).wait()
        return outs[0] if self.rank == 0 else None

    def send_layer(self, command: int, layer: int, step_id: int, packed_TXD: torch.Tensor) -> None:
        """Rank 0: one broadcast carrying the header and the layer's packed q|k|v."""
        payload = packed_TXD.detach().contiguous().view(-1).view(torch.uint8)
        message = torch.empty(HEADER_BYTES + payload.numel(), dtype=torch.uint8, device=payload.device)
        message[:HEADER_BYTES].view(torch.int64).copy_(
            torch.tensor([command, layer, step_id, packed_TXD.shape[0]], dtype=torch.int64))
        message[HEADER_BYTES:].copy_(payload)
        self.broadcast(message)

    def recv_layer(self, num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[tuple[int, int, int, int], torch.Tensor]:
        """Other ranks: the header and the packed [T, X, D] tensor (moved to ``device``)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        message = torch.empty(HEADER_BYTES + num_tokens * num_heads * head_size * itemsize, dtype=torch.uint8)
        self.broadcast(message)
        command, layer, step_id, t = message[:HEADER_BYTES].view(torch.int64).tolist()
        packed = message[HEADER_BYTES:].view(dtype).view(num_tokens, num_heads, head_size)
        return (command, layer, step_id, t), packed.to(device, non_blocking=True)

    def close(self) -> None:
        # Dropping the group closes its connections; shutdown() exists only on some backends.
        try:
            self.group.shutdown()
        except (AttributeError, RuntimeError):
            pass
        self.group = None
