"""Block tables: one row of physical page ids per request, padded with ``PAD_BLOCK_ID``.

Rows are reused after a request frees them; clearing the whole row on free is what keeps a
reused row from showing the previous request's pages (a known silent-corruption class).
"""

from __future__ import annotations

import torch

PAD_BLOCK_ID = -1


class BlockTable:
    """``rows_RW`` int64 [max_rows, max_blocks_per_row]; row r holds ``num_blocks[r]`` valid ids."""

    def __init__(self, max_rows: int, max_blocks_per_row: int):
        self.rows_RW = torch.full((max_rows, max_blocks_per_row), PAD_BLOCK_ID, dtype=torch.int64)
        self.num_blocks = [0] * max_rows
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def max_blocks_per_row(self) -> int:
        return self.rows_RW.shape[1]

    def can_add_row(self) -> bool:
        return bool(self._free_rows)

    def add_row(self) -> int:
        if not self._free_rows:
            raise ValueError(f"block table full: all {self.rows_RW.shape[0]} rows in use")
        return self._free_rows.pop()

    def can_append(self, row: int, num_new: int) -> bool:
        return self.num_blocks[row] + num_new <= self.max_blocks_per_row

    def append(self, row: int, blocks: list[int]) -> None:
        n = self.num_blocks[row]
        if not self.can_append(row, len(blocks)):
            raise ValueError(
                f"row {row} holds {n} blocks; {len(blocks)} more exceed the width {self.max_blocks_per_row}")
        self.rows_RW[row, n:n + len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        self.num_blocks[row] = n + len(blocks)

    def truncate(self, row: int, num_blocks: int) -> list[int]:
        """Keep the first ``num_blocks`` ids of the row; return (and clear) the dropped ones."""
        n = self.num_blocks[row]
        dropped = self.rows_RW[row, num_blocks:n].tolist()
        self.rows_RW[row, num_blocks:n] = PAD_BLOCK_ID
        self.num_blocks[row] = min(n, num_blocks)
        return dropped

    def remove_row(self, row: int) -> list[int]:
        """Clear the row entirely and make it reusable; return the ids it held."""
        dropped = self.truncate(row, 0)
        self._free_rows.append(row)
        return dropped

    def row(self, row: int) -> list[int]:
        return self.rows_RW[row, :self.num_blocks[row]].tolist()

    def gather(self, rows: list[int], width: int | None = None) -> torch.Tensor:
        """Block table of a batch: [B, width] int64, padding ``PAD_BLOCK_ID``."""
        width = width if width is not None else max([self.num_blocks[r] for r in rows], default=0)
        width = max(width, 1)
        if not rows:
            return torch.full((0, width), PAD_BLOCK_ID, dtype=torch.int64)
        return self.rows_RW[torch.tensor(rows, dtype=torch.int64), :width].clone()
