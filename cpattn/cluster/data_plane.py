"""The data plane: a torch.distributed group joining a client's gateway (rank 0) and remote shards.

Per-layer tensors travel only here, never through Ray calls (1 ms and up per call, 120 ms for
16 MB). Groups are built directly from a TCPStore rather than init_process_group, so one shard
process can belong to one group per connected client at the same time. NCCL when every rank has a
GPU of its own (tensors stay on the GPUs); gloo on CPU and when ranks share a GPU (NCCL between two
ranks on one GPU hangs), staging CUDA tensors through the host. Shards on the client's own GPU are
not in the group at all: the client computes their share in its process (cluster.gateway).

Wire protocol per layer: one broadcast out, one point-to-point message back per rank with rows (both typed
in cluster/wire_messages.py: LayerMessage, PartialMessage).
  message  uint8 [32 + T (Hq + 2 Hk) D itemsize] = int64 header (command, layer, step_id, T) | q|k|v
           broadcast from rank 0; an ABORT message has the same size, its payload unused
           A selected prefill step (cluster/wire_select.py) sends each rank its own message instead, point to
           point: header | q [Rq, Hq, D] | k, v [Rkv, Hk, D], only the rows it computes and the new K/V it needs
  partial  uint8 [R (Hq D itemsize + Hq lse_itemsize) + 8] = out [R, Hq, D] in the activation dtype |
           natural-log lse [R, Hq] float32 (float64 for float64) | int64 tag (step, layer), rank r ->
           rank 0, only for the R rows rank r computed (ShardStepPlan.rows); no rows: no message.
           The tag lets the client tell, at the end of the step, that every message arrived whole:
           an NCCL receive from a dead peer does not fail on the host, it is aborted after the timeout.
A shard's step ends after it served every layer (the coordinator, not the shard, decides commit
or rollback, so no closing message is needed) or on ABORT when the client stops early.
A decode run (several decode steps planned by one begin_step, gateway.DecodeRun) puts one more message
before each step after the first:
  run header  uint8 [32] = int64 (NEXT or END, index of the step in the run, step_id, T), from rank 0;
           END when the client stops the run early (its shards return and hold no thread).
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

from cpattn.cluster.netbind import use_nccl_interface
# HEADER_BYTES and TAG_BYTES are read from here by the graph modules (client_graphs, shard_graphs) too.
from cpattn.cluster.wire_messages import HEADER_BYTES, TAG_BYTES, LayerMessage, PartialMessage  # noqa: F401
from cpattn.errors import ConfigError, CpattnError, DataPlaneError


class WireError(Exception):
    """A data-plane collective failed (a peer died, hung past the timeout, or the group broke)."""


class LocalWorkError(Exception):
    """A layer's work in the client's own process failed (an in-process shard's kernel, the merge: out of memory,
    a CUDA error), not the wire: replaying it elsewhere cannot help, so the step rolls back and says so."""


CMD_ATTEND = 1
CMD_ABORT = 3
CMD_NEXT = 4   # run header: the run's next step follows
CMD_END = 5    # run header: the run ends here


def partial_tag(step_id: int, layer: int) -> int:
    """The nonzero int64 that closes a shard's partial message for (step, layer)."""
    return step_id * 65536 + layer + 1


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.Store:
    return dist.TCPStore(host, port, world_size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def create_group(store: dist.Store, group_name: str, rank: int, world_size: int, backend: str,
                 timeout_s: float, device: torch.device | None = None, *, bind_ip: str,
                 interface: str | None = None, explicit_interface: bool = False) -> dist.ProcessGroup:
    """A process group over ``store`` namespaced by ``group_name``; blocks until every rank joins.

    This rank binds to ``bind_ip`` (cluster.netbind says which); a group that does not connect within
    ``timeout_s`` raises DataPlaneError naming the addresses (gloo alone would wait 5 x timeout_s).
    """
    prefix = dist.PrefixStore(f"cpattn/{group_name}", store)
    timeout = datetime.timedelta(seconds=timeout_s)

    def build() -> dist.ProcessGroup:
        prefix.set(f"address/{rank}", bind_ip)   # for the error message of a rank that cannot connect
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_ip)]
            return dist.ProcessGroupGloo(prefix, rank, world_size, opts)
        # A dead peer must surface as an error in this process, not end it: abort the communicator
        # after the timeout and let the waiting call raise (the default tears the process down).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        use_nccl_interface(interface, explicit_interface)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)

    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"data plane backend {backend!r}: use gloo or nccl")
    return within_deadline(build, timeout_s, lambda why: _connect_error(prefix, group_name, rank, world_size,
                                                                        bind_ip, timeout_s, why))


def connect_group(host: str, port: int, group_name: str, rank: int, world_size: int, backend: str,
                  timeout_s: float, *, bind_ip: str, interface: str | None = None,
                  explicit_interface: bool = False) -> dist.ProcessGroup:
    """A non-zero rank: reach rank 0's store at host:port, then join the group, all within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    def reach() -> dist.Store:
        return make_store(host, port, world_size, False, timeout_s)

    store = within_deadline(reach, timeout_s, lambda why: DataPlaneError(
        f"data-plane group {group_name}: rank {rank} (bound to {bind_ip}) could not reach the client's rendezvous "
        f"at {host}:{port} within collective_timeout_s={timeout_s:g}s ({why}): the client's node IP must be "
        "reachable from every shard's node on any TCP port, or set data_plane_interface to the interface of the "
        "network they share"))
    return create_group(store, group_name, rank, world_size, backend, max(0.1, deadline - time.monotonic()),
                        bind_ip=bind_ip, interface=interface, explicit_interface=explicit_interface)


def within_deadline(fn, timeout_s: float, error):
    """``fn()`` in a helper thread (torch's connect calls release the GIL), given up after ``timeout_s``;
    a failure or the deadline raises ``error(why)``. A call given up on ends by itself on gloo's own timeout."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:   # reported in the caller's thread below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="cpattn-data-plane-connect")
    thread.start()
    thread.join(timeout_s)
    if "value" in result:
        return result["value"]
    if isinstance(result.get("error"), CpattnError):
        raise result["error"]
    why = _one_line(result["error"]) if "error" in result else "timed out"
    raise error(why) from result.get("error")


def _connect_error(prefix: dist.Store, group_name: str, rank: int, world_size: int, bind_ip: str, timeout_s: float,
                   why: str) -> DataPlaneError:
    peers = []
    for r in range(world_size):
        key = f"address/{r}"
        try:
            address = prefix.get(key).decode() if r != rank and prefix.check([key]) else None
        except Exception:   # the store itself is gone: name the ranks only
            address = None
        if r != rank:
            peers.append(f"rank {r} at {address or 'an unknown address (it never joined)'}")
    return DataPlaneError(
        f"data-plane group {group_name}: rank {rank} (bound to {bind_ip}) could not connect to {', '.join(peers)} "
        f"within collective_timeout_s={timeout_s:g}s ({why}): check that these nodes reach each other on those "
        "addresses (any TCP port), or set data_plane_interface to the interface of the network they share")


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def _from_rank_0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


class DataPlane:
    """Broadcast/gather over one group; stages CUDA tensors through the CPU when the backend is gloo."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, backend: str):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.backend == "gloo" and t.is_cuda else t

    def _run(self, work) -> None:
        """gloo: blocks until done (errors raise here). NCCL: orders our stream after it, host goes on."""
        work.wait()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place from rank 0; returns the tensor on its original device."""
        wire = self._wire(tensor).contiguous()
        self._run(self.group.broadcast([wire], _from_rank_0()))
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def send_layer(self, message: LayerMessage, command: int, layer: int, step_id: int) -> list:
        """Rank 0: one broadcast carrying the header and the layer's q|k|v, packed once in the message itself.
        Returns it in flight: the caller computes its own share meanwhile, then ``finish``es it."""
        wire = self._wire(message.stamped(command, layer, step_id)).contiguous()
        return [(self.group.broadcast([wire], _from_rank_0()), wire)]

    def send_own_layers(self, messages: dict[int, torch.Tensor]) -> list:
        """Rank 0, a selected step (cluster/wire_select.py): each group rank its own message, point to point, every
        send posted before any is waited for. Returns them in flight, as ``send_layer`` does."""
        pending = []
        for dst, message in messages.items():
            wire = self._wire(message)
            pending.append((self.group.send([wire], dst, 0), wire))
        return pending

    def finish(self, pending: list) -> None:
        """The sends of ``send_layer`` / ``send_own_layers`` done (gloo: sent; NCCL: our stream ordered after them)."""
        for work, _wire in pending:
            self._run(work)

    def recv_own_layer(self, nbytes: int, device: torch.device, ahead: bool = False) -> torch.Tensor:
        """Other ranks, a selected step: this rank's message of ``nbytes`` (wire_select.OwnLayers unpacks it) on
        ``device``. ``ahead`` (NCCL): nothing here waits on the host, as recv_layer_ahead."""
        wire_device = device if self.backend == "nccl" else torch.device("cpu")
        message = torch.empty(nbytes, dtype=torch.uint8, device=wire_device)
        self._run(self.group.recv([message], 0, 0))
        return message.to(device, non_blocking=True)

    def recv_layer(self, num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[tuple[int, int, int, int], torch.Tensor]:
        """Other ranks: the header and the packed [T, X, D] tensor (on ``device``).

        Reading the header is this rank's one host synchronisation per layer: it says which
        layer's cache the kernels address (clients may attend layers in any order).
        """
        itemsize = torch.empty(0, dtype=dtype).element_size()
        wire_device = device if self.backend == "nccl" else torch.device("cpu")
        message = torch.empty(HEADER_BYTES + num_tokens * num_heads * head_size * itemsize, dtype=torch.uint8,
                              device=wire_device)
        self.broadcast(message)
        command, layer, step_id, t = message[:HEADER_BYTES].view(torch.int64).tolist()
        packed = message[HEADER_BYTES:].view(dtype).view(num_tokens, num_heads, head_size)
        return (command, layer, step_id, t), packed.to(device, non_blocking=True)

    def send_run_header(self, command: int, index: int, step_id: int, num_tokens: int,
                        device: torch.device) -> None:
        """Rank 0: NEXT before each step of a run after its first, END when the run stops early."""
        self.broadcast(torch.tensor([command, index, step_id, num_tokens], dtype=torch.int64).to(device,
                                                                                                  non_blocking=True))

    def recv_run_header(self, device: torch.device) -> tuple[int, int, int, int]:
        """Other ranks: the run header (a host wait, once per step of a run)."""
        header = torch.empty(4, dtype=torch.int64, device=device if self.backend == "nccl" else "cpu")
        self.broadcast(header)
        command, index, step_id, t = header.tolist()
        return command, index, step_id, t

    def recv_layer_ahead(self, num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """NCCL: like recv_layer, but the header stays on the device (int64 [4], read once per step by the
        caller), so nothing here waits on the host: later layers can be enqueued behind this one."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        message = torch.empty(HEADER_BYTES + num_tokens * num_heads * head_size * itemsize, dtype=torch.uint8,
                              device=device)
        self.broadcast(message)
        return (message[:HEADER_BYTES].view(torch.int64),
                message[HEADER_BYTES:].view(dtype).view(num_tokens, num_heads, head_size))

    def send_partial(self, out_RQD: torch.Tensor, lse_RQ: torch.Tensor, tag: int) -> None:
        """A shard: its computed rows to rank 0 as one message (wire_messages.PartialMessage)."""
        self._run(self.group.send([self._wire(PartialMessage.pack(out_RQD, lse_RQ, tag))], 0, 0))

    def recv_partial(self, src: int, num_rows: int, num_heads: int, head_size: int, dtype: torch.dtype,
                     lse_dtype: torch.dtype, device: torch.device,
                     tag: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank 0: rank ``src``'s partial, out [R, Q, D] and lse [R, Q] on ``device`` (views of the one message
        received), and a 0-dim bool that is True when the message did not arrive whole (its tag is missing: the
        sender died or was aborted).

        With NCCL nothing here waits on the host, so a dead peer is seen only through that flag, which
        the step reads once at its end.
        """
        return self.take_partial(self.post_partial(src, num_rows, num_heads, head_size, dtype, lse_dtype, device),
                                 device, tag)

    def post_partial(self, src: int, num_rows: int, num_heads: int, head_size: int, dtype: torch.dtype,
                     lse_dtype: torch.dtype, device: torch.device) -> tuple:
        """Rank 0: rank ``src``'s partial's receive posted, not waited for (``take_partial`` does). NCCL orders a
        receive after the work already on our stream, so one posted before the client's own shards compute lands
        while they do; posted after, it would wait for them."""
        wire_device = device if self.backend == "nccl" else torch.device("cpu")
        message = PartialMessage.empty(num_rows, num_heads, head_size, dtype, lse_dtype, wire_device)
        return self.group.recv([message.buffer], src, 0), message

    def take_partial(self, posted: tuple, device: torch.device, tag: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """recv_partial's answer from a posted receive (gloo: waits for it; NCCL: our stream ordered after it)."""
        work, message = posted
        self._run(work)
        message = message.to(device)
        return message.out, message.lse, message.broken(tag)

    def abort(self) -> None:
        """Unblock whatever waits on this group (NCCL: abort the communicator); the group is unusable after."""
        for name in ("abort", "_abort"):   # which one a backend binds varies across torch versions
            method = getattr(self.group, name, None)
            if method is not None:
                try:
                    method()
                    return
                except RuntimeError:
                    pass

    def close(self) -> None:
        """Drop the group. NCCL: abort its communicators, a local call (shutdown() waits on the peers'
        communicators and hung at a client's exit on 2 x H200); gloo: dropping it closes its sockets."""
        if self.group is None:
            return
        if self.backend == "nccl":
            self.abort()
        else:
            try:
                self.group.shutdown()
            except (AttributeError, RuntimeError):
                pass
        self.group = None
