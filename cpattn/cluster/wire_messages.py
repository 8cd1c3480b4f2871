"""One layer's q|k|v as the data plane carries it, packed once (cluster/data_plane.py has the wire format).

The client used to concatenate q|k|v for the wire, copy that behind the header, and (kv_replicas=2)
concatenate q|k|v once more for the step's replay: three copies of the layer's inputs. A LayerMessage
allocates the message (header | q|k|v) once and concatenates q, k and v straight into its payload; that one
buffer goes on the wire and is what a replay keeps (it sends the same buffer again under a new step id).
"""

from __future__ import annotations

import torch

HEADER_BYTES = 32
"""int64 [4]: command, layer, step_id, T."""


class LayerMessage:
    """q [T, Hq, D], k and v [T, Hk, D] of one layer on the gateway's device, and (once ``packed``) the wire
    message uint8 [HEADER_BYTES + T (Hq + 2 Hk) D itemsize] holding them."""

    def __init__(self, q_TQD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, device: torch.device):
        # Already there (a client on its GPU): no .to() at all, a call that costs ~2 us even when it returns x.
        self.q, self.k, self.v = (x if x.device == device else x.to(device, non_blocking=True)
                                  for x in (q_TQD, k_TKD, v_TKD))
        self.buffer: torch.Tensor | None = None
        self._qkv: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    def packed(self) -> torch.Tensor:
        """q|k|v [T, Hq + 2 Hk, D], a view of the message's payload (concatenated there at the first call)."""
        if self._qkv is None:
            q, k, v = self.q, self.k, self.v
            t, d = q.shape[0], q.shape[2]
            width = q.shape[1] + k.shape[1] + v.shape[1]
            self.buffer = torch.empty(HEADER_BYTES + t * width * d * q.element_size(), dtype=torch.uint8,
                                      device=q.device)
            self._qkv = self.buffer[HEADER_BYTES:].view(q.dtype).view(t, width, d)
            torch.cat([q, k, v], dim=1, out=self._qkv)
        return self._qkv

    def stamped(self, command: int, layer: int, step_id: int) -> torch.Tensor:
        """The whole message with its header written: what the broadcast sends."""
        self.packed()
        # non_blocking: a blocking host-to-device copy synchronises the stream, i.e. waits for the previous
        # layer's partials every layer (measured: 0.86 ms per layer at 128K on 2 H200s).
        self.buffer[:HEADER_BYTES].view(torch.int64).copy_(
            torch.tensor([command, layer, step_id, self.num_tokens], dtype=torch.int64), non_blocking=True)
        return self.buffer

    def keep(self) -> "LayerMessage":
        """For a replay: packed, with q, k and v now views of the payload (the caller's tensors are let go)."""
        qkv = self.packed()
        hq, hk = self.q.shape[1], self.k.shape[1]
        self.q, self.k, self.v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        return self

    @classmethod
    def blank(cls, num_tokens: int, width: int, head_size: int, dtype: torch.dtype,
              device: torch.device) -> "LayerMessage":
        """A message of a layer's size (``width`` = Hq + 2 Hk) whose payload is unused (ABORT)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        message = cls.__new__(cls)
        message.buffer = torch.zeros(HEADER_BYTES + num_tokens * width * head_size * itemsize, dtype=torch.uint8,
                                     device=device)
        message._qkv = message.buffer[HEADER_BYTES:].view(dtype).view(num_tokens, width, head_size)
        message.q = message.k = message.v = message._qkv
        return message


TAG_BYTES = 8
"""int64: data_plane.partial_tag(step, layer), last in a partial; missing when the message did not arrive whole."""


class PartialMessage:
    """One shard's computed rows of a layer as one message: out [R, Hq, D] in the activation dtype | lse [R, Hq]
    natural log (float32; float64 for float64) | int64 tag. The receiver allocates it once and merges straight
    from its ``out`` and ``lse`` views; the sender packs its rows into one with a single concatenation (``pack``)."""

    def __init__(self, buffer: torch.Tensor, num_rows: int, num_heads: int, head_size: int, dtype: torch.dtype,
                 lse_dtype: torch.dtype):
        out_bytes = num_rows * num_heads * head_size * _itemsize(dtype)
        lse_bytes = num_rows * num_heads * _itemsize(lse_dtype)
        self.buffer = buffer
        self.out = buffer[:out_bytes].view(dtype).view(num_rows, num_heads, head_size)
        self.lse = buffer[out_bytes:out_bytes + lse_bytes].view(lse_dtype).view(num_rows, num_heads)
        self.tag = buffer[-TAG_BYTES:].view(torch.int64)
        self._shape = (num_rows, num_heads, head_size, dtype, lse_dtype)

    @classmethod
    def empty(cls, num_rows: int, num_heads: int, head_size: int, dtype: torch.dtype, lse_dtype: torch.dtype,
              device: torch.device) -> "PartialMessage":
        """To receive into: its tag zeroed, so a message cut short reads as broken."""
        nbytes = num_rows * num_heads * (head_size * _itemsize(dtype) + _itemsize(lse_dtype)) + TAG_BYTES
        message = cls(torch.empty(nbytes, dtype=torch.uint8, device=device), num_rows, num_heads, head_size, dtype,
                      lse_dtype)
        message.tag.zero_()
        return message

    @staticmethod
    def pack(out_RQD: torch.Tensor, lse_RQ: torch.Tensor, tag: int) -> torch.Tensor:
        """The sender's message (uint8, on out's device): its rows, their lse and the tag, in one concatenation."""
        tag_bytes = torch.tensor([tag], dtype=torch.int64).view(torch.uint8).to(out_RQD.device, non_blocking=True)
        return torch.cat([out_RQD.contiguous().view(-1).view(torch.uint8),
                          lse_RQ.contiguous().view(-1).view(torch.uint8), tag_bytes])

    def to(self, device: torch.device) -> "PartialMessage":
        """The same message on ``device`` (one copy; itself when it is there already)."""
        buffer = self.buffer.to(device, non_blocking=True)
        return self if buffer is self.buffer else PartialMessage(buffer, *self._shape)

    def broken(self, tag: int) -> torch.Tensor:
        """0-dim bool on the message's device: True when it did not arrive whole (its tag is not ``tag``)."""
        return self.tag[0] != tag


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
