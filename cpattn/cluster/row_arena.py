"""The buffers a steady decode step refills, as views of one device byte buffer: a step's rows go in with one copy.

A steady step (cluster/steady_run.py) refills a few [T]-sized buffers the captured graphs read: slots, key counts,
each sliding window's first keys, replica slots, the pages dynamic fp8 scales grow (2-9 buffers). One copy each
cost 17-30 us of the caller's time on an H200 host while the GPU ran the previous step (cudaMemcpyAsync, torch
profiler, 2026-12-02), most of a steady step's opening. Laid out in one buffer, with the run's rows of each step
laid out the same way (``pack``), a step is one device-to-device copy.
Legend: S steps, N bytes of one step's rows.
"""

from __future__ import annotations

import numpy as np
import torch


class RowArena:
    """``buffers`` moved into one byte buffer (their values kept): ``views`` are the tensors to use instead, in the
    same order; fields of larger elements come first, so each view is aligned to its element size."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.order = sorted(range(len(buffers)), key=lambda i: -buffers[i].element_size())
        self.shapes = [(b.shape, b.dtype) for b in buffers]
        total = sum(b.numel() * b.element_size() for b in buffers)
        self.bytes = torch.empty(total, dtype=torch.uint8, device=buffers[0].device if buffers else "cpu")
        self.views: list[torch.Tensor | None] = [None] * len(buffers)
        offset = 0
        for i in self.order:
            b = buffers[i]
            size = b.numel() * b.element_size()
            view = self.bytes[offset:offset + size].view(b.dtype).view(b.shape)
            view.copy_(b)
            self.views[i] = view
            offset += size

    def pack(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """[S, N] uint8 on the host: row j is step j's values of every buffer in this arena's layout (``rows[i]``:
        [S, ...] of buffer i's dtype and, per step, its shape, on the host), for ``fill``.
        Laid out by numpy: a run's S x N bytes (~98K at 64 sequences x 128 steps) are over torch's 32K-element
        grain, and torch.cat waited for its intra-op threads, 2-48 ms on a loaded 2-core host (0.1 ms here)."""
        if len(rows) != len(self.shapes):
            raise ValueError(f"{len(rows)} row arrays for an arena of {len(self.shapes)} buffers")
        steps = rows[0].shape[0]
        out = np.empty((steps, self.bytes.numel()), dtype=np.uint8)
        offset = 0
        for i in self.order:
            shape, dtype = self.shapes[i]
            r = rows[i]
            if r.dtype != dtype or tuple(r.shape[1:]) != tuple(shape):
                raise ValueError(f"rows {i}: {r.dtype} {tuple(r.shape)} for a buffer of {dtype} {tuple(shape)}")
            part = r.reshape(steps, -1)
            part = (part if part.is_contiguous() else part.contiguous()).view(torch.uint8).numpy()   # views
            out[:, offset:offset + part.shape[1]] = part
            offset += part.shape[1]
        return torch.from_numpy(out)

    def fill(self, packed_row: torch.Tensor) -> None:
        """One step's values (a row of ``pack``'s result) into every buffer: one copy."""
        self.bytes.copy_(packed_row)
