"""The data plane's typed messages (cluster/wire_messages.py) on CPU: a layer's q|k|v packed once behind its
header (the buffer sent is the buffer a replay keeps), and a shard's partial packed by the sender and read by
the receiver through views of one buffer, with its tag telling a message cut short."""

from __future__ import annotations

import torch

from cpattn.cluster.data_plane import partial_tag
from cpattn.cluster.wire_messages import HEADER_BYTES, TAG_BYTES, LayerMessage, PartialMessage

T, HQ, HK, D = 3, 4, 2, 8
CPU = torch.device("cpu")


def _qkv(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(T, h, D, dtype=torch.float64, generator=gen).to(dtype) for h in (HQ, HK, HK)]


def test_a_layer_message_packs_once_behind_its_header():
    q, k, v = _qkv(torch.bfloat16)
    message = LayerMessage(q, k, v, CPU)
    packed = message.packed()
    assert torch.equal(packed, torch.cat([q, k, v], dim=1)) and message.packed() is packed
    buffer = message.stamped(1, 5, 42)
    assert buffer.dtype == torch.uint8 and buffer.numel() == HEADER_BYTES + packed.numel() * 2
    assert buffer[:HEADER_BYTES].view(torch.int64).tolist() == [1, 5, 42, T]
    assert buffer[HEADER_BYTES:].data_ptr() == packed.data_ptr()
    assert message.stamped(1, 6, 43) is buffer and buffer[:HEADER_BYTES].view(torch.int64).tolist() == [1, 6, 43, T]


def test_a_kept_message_holds_views_of_its_one_buffer():
    q, k, v = _qkv()
    kept = LayerMessage(q, k, v, CPU).keep()   # never sent (e.g. a graphed layer): packed now, once
    assert torch.equal(kept.q, q) and torch.equal(kept.k, k) and torch.equal(kept.v, v)
    assert kept.q.data_ptr() == kept.packed().data_ptr() and kept.q.data_ptr() != q.data_ptr()


def test_an_abort_message_has_a_layers_size_and_no_payload():
    blank = LayerMessage.blank(T, HQ + 2 * HK, D, torch.float32, CPU)
    buffer = blank.stamped(3, -1, 9)
    assert buffer.numel() == HEADER_BYTES + T * (HQ + 2 * HK) * D * 4 and not bool(blank.packed().any())
    assert buffer[:HEADER_BYTES].view(torch.int64).tolist() == [3, -1, 9, T]


def test_a_partial_packed_by_the_sender_reads_back_through_views_and_its_tag():
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(T, HQ, D, generator=gen).to(torch.bfloat16)
    lse = torch.randn(T, HQ, generator=gen)
    tag = partial_tag(7, 2)
    sent = PartialMessage.pack(out, lse, tag)
    received = PartialMessage.empty(T, HQ, D, torch.bfloat16, torch.float32, CPU)
    assert received.buffer.numel() == sent.numel() == T * HQ * (D * 2 + 4) + TAG_BYTES
    assert bool(received.broken(tag))   # nothing arrived yet: the zeroed tag reads as cut short
    received.buffer.copy_(sent)         # what the receive does
    assert torch.equal(received.out, out) and torch.equal(received.lse, lse) and not bool(received.broken(tag))
    assert bool(received.broken(partial_tag(7, 3)))   # another layer's message is not this one
    assert received.out.data_ptr() == received.buffer.data_ptr() and received.to(CPU) is received
