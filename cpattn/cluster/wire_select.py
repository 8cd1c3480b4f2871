"""What each rank of a prefill step receives per layer: its own message of only the rows it needs.

Legend: T tokens of the step, Q query heads, K kv heads, D head size, Rq query rows a rank computes, Rkv the
rows of new K/V it needs.
A broadcast sends every remote rank the whole q|k|v [T, Q + 2K, D]. In a prefill split across ranks (PCP) a
rank computes only some query rows (ShardStepPlan.rows: its causal pieces and queries with local context) and
needs only the new K/V it stores (its slot mapping, and its replica's) or attends among the new tokens (the keys
[k_start, q_end) of its causal pieces). When the rank-by-rank messages together are smaller than the one
broadcast (always with one remote rank; with more, when each computes few rows), the step is planned *selected*
(``select_wire``, once per step): every remote rank gets, per layer, header | q[q_rows] | k[kv_rows] |
v[kv_rows] from rank 0 as a point-to-point message. Where the rank's step runs new tokens only (a prefill from
empty: cluster/new_tokens.py) the layer runner attends the message as it arrived (compact); otherwise
``OwnLayers`` scatters it into full-size step buffers, so the layer runner's planned indices stay unchanged; rows
not received are never read (their outputs are not returned, their K/V is neither stored nor attended).

A rank with no row to compute and no K/V to store gets the header alone (32 bytes).
"""

from __future__ import annotations

import math

import torch

from cpattn.cluster.data_plane import CMD_ATTEND
from cpattn.cluster.layer_runner import lse_wire_dtype
from cpattn.cluster.step_planner import ShardStepPlan
from cpattn.cluster.wire_messages import HEADER_BYTES, LayerMessage


def needed_kv_rows(plan: ShardStepPlan) -> torch.Tensor | None:
    """(Rkv,) int64 sorted: the new tokens whose K/V ``plan``'s rank writes or attends in the step; None = all."""
    mask = plan.metadata.slot_mapping >= 0
    if plan.replica_slot_mapping is not None:
        mask |= plan.replica_slot_mapping >= 0
    for k_start, q_end in plan.causal_pieces[:, 1:].flip(1).tolist():
        mask[k_start:q_end] = True
    return None if bool(mask.all()) else mask.nonzero().flatten()


def _count(rows: torch.Tensor | None, num_tokens: int) -> int:
    return num_tokens if rows is None else int(rows.numel())


def message_bytes(num_q_rows: int, num_kv_rows: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                  itemsize: int) -> int:
    """A rank's own layer message: header | q [Rq, Q, D] | k, v [Rkv, K, D]."""
    return HEADER_BYTES + (num_q_rows * num_q_heads + 2 * num_kv_rows * num_kv_heads) * head_size * itemsize


def select_wire(plans: list[ShardStepPlan], local: set[int] | tuple[int, ...], num_q_heads: int, num_kv_heads: int,
                head_size: int, itemsize: int, mode: str = "auto", wire: str | None = "nccl") -> bool:
    """Once per step: plan it selected (every plan's ``kv_rows`` set, ``selected`` True), or not; returns which.

    Only a step where some sequence has more than one new token and some rank is remote; decode-only steps keep
    the broadcast (their graphs replay it, and their rows are all). ``mode`` (ServiceConfig.prefill_wire): auto
    selects when the remote ranks' own messages add up to fewer bytes than the client's broadcast sends: one
    message on NCCL (it pipelines the message along its ring), one per remote rank on gloo (``wire``: the
    client's data-plane backend)."""
    remote = [p for r, p in enumerate(plans) if r not in local]
    if mode == "broadcast" or not remote or int(plans[0].metadata.max_query_len) <= 1:
        return False
    t = plans[0].num_tokens
    kv_rows = {id(p): needed_kv_rows(p) for p in remote}
    selected = sum(message_bytes(p.num_rows, _count(kv_rows[id(p)], t), num_q_heads, num_kv_heads, head_size,
                                 itemsize) for p in remote)
    copies = 1 if wire == "nccl" else len(remote)
    if mode == "auto" and selected >= copies * message_bytes(t, t, num_q_heads, num_kv_heads, head_size, itemsize):
        return False
    for p in remote:
        p.kv_rows, p.selected = kv_rows[id(p)], True
    for r, p in enumerate(plans):
        if r in local:
            p.selected = True   # the client reads the step's mode from any plan
    return True


def pack_own_message(header: torch.Tensor, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                     q_rows: torch.Tensor | None, kv_rows: torch.Tensor | None) -> torch.Tensor:
    """Rank 0: one rank's message, uint8 header | q[q_rows] | k[kv_rows] | v[kv_rows] (rows on q's device), the
    rows gathered straight into it (one pass over what travels)."""
    (t, hq, d), hk = q_TQD.shape, k_TKD.shape[1]
    nq, nkv = _count(q_rows, t), _count(kv_rows, t)
    message = torch.empty(message_bytes(nq, nkv, hq, hk, d, q_TQD.element_size()), dtype=torch.uint8,
                          device=q_TQD.device)
    message[:HEADER_BYTES].copy_(header.view(torch.uint8))
    payload = message[HEADER_BYTES:].view(q_TQD.dtype)
    q_end, k_end = nq * hq * d, nq * hq * d + nkv * hk * d
    for x, rows, part in ((q_TQD, q_rows, payload[:q_end].view(nq, hq, d)),
                          (k_TKD, kv_rows, payload[q_end:k_end].view(nkv, hk, d)),
                          (v_TKD, kv_rows, payload[k_end:].view(nkv, hk, d))):
        if rows is None:
            part.copy_(x)
        else:
            torch.index_select(x, 0, rows, out=part)
    return message


class OwnLayers:
    """A selected step on a remote rank: receives its own message per layer and hands the layer runner full-size
    q [T, Q, D], k, v [T, K, D] (step buffers, zero where nothing arrived: never read), or with ``compact`` the
    message's own q [Rq, Q, D], k, v [Rkv, K, D] (views of it)."""

    def __init__(self, plan: ShardStepPlan, num_q_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device, compact: bool = False):
        t = plan.num_tokens
        self.q_rows = None if plan.rows is None or compact else plan.rows.to(device)
        self.kv_rows = None if plan.kv_rows is None or compact else plan.kv_rows.to(device)
        self.num_q = _count(plan.rows, t)   # what arrives, expanded or not
        self.num_kv = _count(plan.kv_rows, t)
        self.shape = (num_q_heads, num_kv_heads, head_size)
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.nbytes = message_bytes(self.num_q, self.num_kv, num_q_heads, num_kv_heads, head_size, self.itemsize)
        full = lambda h, rows: None if rows is None else torch.zeros(t, h, head_size, dtype=dtype, device=device)  # noqa: E731
        self.q, self.k, self.v = full(num_q_heads, self.q_rows), full(num_kv_heads, self.kv_rows), \
            full(num_kv_heads, self.kv_rows)

    def unpack(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(header int64 [4], q, k, v) from a received message (on the step's device): the rows scattered into
        the step's buffers (the buffers are reused by the next layer, after this layer's kernels in stream order)."""
        hq, hk, d = self.shape
        header = message[:HEADER_BYTES].view(torch.int64)
        payload = message[HEADER_BYTES:].view(self.dtype)
        nq, nkv = self.num_q * hq * d, self.num_kv * hk * d
        q = payload[:nq].view(self.num_q, hq, d)
        k = payload[nq:nq + nkv].view(self.num_kv, hk, d)
        v = payload[nq + nkv:].view(self.num_kv, hk, d)
        if self.q_rows is not None:
            q = self.q.index_copy_(0, self.q_rows, q)
        if self.kv_rows is not None:
            k = self.k.index_copy_(0, self.kv_rows, k)
            v = self.v.index_copy_(0, self.kv_rows, v)
        return header, q, k, v


def layer_header(command: int, layer: int, step_id: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """int64 [4] on ``device`` (non_blocking: a blocking copy would wait for the previous layer's partials)."""
    return torch.tensor([command, layer, step_id, num_tokens], dtype=torch.int64).to(device, non_blocking=True)


def blank_own_message(header: torch.Tensor, q_rows: torch.Tensor | None, kv_rows: torch.Tensor | None,
                      num_tokens: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """A rank's message of its own size whose payload is unused (ABORT): the header, then zeros."""
    nbytes = message_bytes(_count(q_rows, num_tokens), _count(kv_rows, num_tokens), num_q_heads, num_kv_heads,
                           head_size, torch.empty(0, dtype=dtype).element_size())
    message = torch.zeros(nbytes, dtype=torch.uint8, device=header.device)
    message[:HEADER_BYTES].copy_(header.view(torch.uint8))
    return message


class LayerReceiver:
    """A remote shard's side of one step: each layer's header and full-size q, k, v, from the broadcast or (a
    selected step) from this rank's own message (its rows alone where the runner planned the step compact)."""

    def __init__(self, plane, plan: ShardStepPlan, config, device: torch.device, compact: bool = False):
        """``compact``: hand over the own message's rows unexpanded (the runner planned the step compact)."""
        self.plane, self.plan, self.device, self.dtype = plane, plan, device, config.torch_dtype
        self.heads = (config.num_q_heads, config.num_kv_heads, config.head_size)
        self.own = OwnLayers(plan, *self.heads, self.dtype, device, compact) if plan.selected else None

    def receive(self, ahead: bool) -> tuple[torch.Tensor | tuple, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(header, q, k, v): ``ahead`` (NCCL, layers enqueued ahead): the header int64 [4] on the device, read
        once per step by the caller; else its four ints, read here (this rank's one host wait per layer)."""
        hq, hk, d = self.heads
        if self.own is not None:
            header, q, k, v = self.own.unpack(self.plane.recv_own_layer(self.own.nbytes, self.device, ahead))
            return (header if ahead else tuple(header.tolist())), q, k, v
        if ahead:
            header, qkv = self.plane.recv_layer_ahead(self.plan.num_tokens, hq + 2 * hk, d, self.dtype, self.device)
        else:
            header, qkv = self.plane.recv_layer(self.plan.num_tokens, hq + 2 * hk, d, self.dtype, self.device)
        return header, qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]


def selection_of(remote_kv_rows: dict | None, remote_rows: dict, device: torch.device) -> dict | None:
    """The client's StepWire.selection from a begin_step reply: remote rank -> (q rows, K/V rows) on ``device``."""
    if remote_kv_rows is None:
        return None
    none = torch.zeros(0, dtype=torch.int64, device=device)   # a rank absent from remote_rows computes no row
    return {r: (remote_rows.get(r, none), None if kv is None else kv.to(device)) for r, kv in remote_kv_rows.items()}


def blank_layer(wire, config, device: torch.device) -> LayerMessage | None:
    """What ``post_layer`` sends for ABORT: a broadcast's blank message, or None (each rank's own blank)."""
    if wire.selection is not None:
        return None
    return LayerMessage.blank(wire.num_tokens, config.num_q_heads + 2 * config.num_kv_heads, config.head_size,
                              config.torch_dtype, device)


def post_layer(plane, wire, remote: list[int], config, device: torch.device, command: int, layer: int,
               message: LayerMessage | None) -> list:
    """One layer on its way to the remote shards (``plane`` None: none; ``device`` the client's), the client's
    gateway.StepWire ``wire``:
    one broadcast, or in a selected step each rank's own message (q|k|v is then never concatenated whole); a
    layer's max |q|k|v| goes into ``wire.norms`` on the way (NaN policy). Returns the sends in flight, for
    ``plane.finish`` once the client's own shards have computed; ``wire.sent_bytes`` counts them."""
    norms = wire.norms if command == CMD_ATTEND else None
    if wire.selection is None:
        if plane is None and norms is None:
            return []
        packed = message.packed()   # q|k|v concatenated once, in the wire message itself
        if norms is not None:
            torch.linalg.vector_norm(packed, math.inf, dtype=torch.float32, out=norms[layer])
        if plane is None:
            return []
        wire.sent_bytes += message.buffer.numel()
        return plane.send_layer(message, command, layer, wire.step_id)
    if norms is not None:
        norms[layer] = torch.stack([torch.linalg.vector_norm(x, math.inf, dtype=torch.float32)
                                    for x in (message.q, message.k, message.v)]).max()
    header = layer_header(command, layer, wire.step_id, wire.num_tokens, device)
    own = {}
    for r, (q_rows, kv_rows) in wire.selection.items():
        own[remote.index(r) + 1] = (
            blank_own_message(header, q_rows, kv_rows, wire.num_tokens, config.num_q_heads, config.num_kv_heads,
                              config.head_size, config.torch_dtype) if message is None else
            pack_own_message(header, message.q, message.k, message.v, q_rows, kv_rows))
    wire.sent_bytes += sum(m.numel() for m in own.values())
    return plane.send_own_layers(own)


def post_partials(plane, wire, remote: list[int], config, device: torch.device) -> list:
    """(rows, posted receive) of each remote shard that computes rows in the step (DataPlane.post_partial), in
    rank order; ``plane.take_partial`` gives each one's out and LSE."""
    posted = []
    for i, r in enumerate(remote):
        if r in wire.remote_rows:
            rows = wire.remote_rows[r]
            n = wire.num_tokens if rows is None else rows.numel()
            posted.append((rows, plane.post_partial(i + 1, n, config.num_q_heads, config.head_size,
                                                    config.torch_dtype, lse_wire_dtype(config.torch_dtype), device)))
    return posted


def rows_disjoint(row_sets: list[torch.Tensor | None], num_tokens: int) -> bool:
    """Every one of ``num_tokens`` rows in exactly one of ``row_sets`` (CPU, each sorted and unique; None = all):
    the client's merge is then a scatter (attention.ops.merge.merge_rows ``disjoint``). Once per step."""
    if len(row_sets) < 2 or any(rows is None for rows in row_sets) or sum(r.numel() for r in row_sets) != num_tokens:
        return False
    return bool((torch.bincount(torch.cat(row_sets), minlength=num_tokens) == 1).all())


def receiver_for(plane, planned, config, device: torch.device) -> LayerReceiver:
    """A remote shard's receiver of a step the runner planned (compact where it planned the step so)."""
    new = planned.new_tokens_only
    return LayerReceiver(plane, planned.plan, config, device, compact=new is not None and new.compact)
