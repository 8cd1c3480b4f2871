"""Block tables: one row of physical page ids per request, padded with ``PAD_BLOCK_ID``.

Rows are reused after a request frees them; clearing the whole row on free is what keeps a
reused row from showing the previous request's pages (a known silent-corruption class).
The tensor grows by doubling up to ``max_rows x max_blocks_per_row``, so a table sized for a
million-token sequence costs memory only when such a sequence exists.

A row may have *released* its first pages (every layer of the model has a sliding window, and no future
query's window reaches them: ``release_prefix``). Their ids stay in the row, so every copy of the row a
client, a shard or a captured graph holds stays valid as it was; no kernel reads them (each skips the pages
wholly before its window), and the row no longer owns them: they are back in the pool, maybe another
sequence's now. ``owned`` and ``remove_row`` give only the pages the row still owns.
"""

from __future__ import annotations

from array import array

import torch

from cpattn.errors import InvalidRequestError

PAD_BLOCK_ID = -1


class BlockTable:
    """``rows_RW`` int64 [rows, width]; row r holds ``num_blocks[r]`` valid ids, then padding."""

    def __init__(self, max_rows: int, max_blocks_per_row: int):
        if max_rows < 1 or max_blocks_per_row < 1:
            raise InvalidRequestError(f"block table needs max_rows >= 1 and max_blocks_per_row >= 1, "
                                      f"got {max_rows} x {max_blocks_per_row}")
        self.max_rows = max_rows
        self.max_blocks_per_row = max_blocks_per_row
        self.rows_RW = torch.full((min(max_rows, 16), min(max_blocks_per_row, 64)), PAD_BLOCK_ID, dtype=torch.int64)
        # The same memory as numpy: writing one page id through torch costs ~2-5 us (a decode run appends one per
        # sequence, row and page it opens: a fifth of a B=64 run's plan), through numpy ~0.1 us.
        self._rows_np = self.rows_RW.numpy()
        # Compact (8 bytes a row each): the coordinator keeps max_sequences rows per shard for its lifetime.
        self.num_blocks = array("q", bytes(8 * max_rows))
        self.num_released = array("q", bytes(8 * max_rows))   # leading ids of each row it no longer owns
        self._free_rows = array("q", range(max_rows - 1, -1, -1))

    def _grow(self, rows: int, width: int) -> None:
        old_r, old_w = self.rows_RW.shape
        if rows <= old_r and width <= old_w:
            return
        new_r = min(self.max_rows, max(rows, 2 * old_r if rows > old_r else old_r))
        new_w = min(self.max_blocks_per_row, max(width, 2 * old_w if width > old_w else old_w))
        grown = torch.full((new_r, new_w), PAD_BLOCK_ID, dtype=torch.int64)
        grown[:old_r, :old_w] = self.rows_RW
        self.rows_RW, self._rows_np = grown, grown.numpy()

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def claim_row(self, row: int) -> None:
        """Take a specific free row (restoring persisted state)."""
        if row not in self._free_rows:
            raise InvalidRequestError(f"row {row} is not free")
        self._free_rows.remove(row)
        self._grow(row + 1, 1)

    def can_add_row(self) -> bool:
        return bool(self._free_rows)

    def add_row(self) -> int:
        if not self._free_rows:
            raise InvalidRequestError(f"block table full: all {self.max_rows} rows in use")
        row = self._free_rows.pop()
        self._grow(row + 1, 1)
        return row

    def can_append(self, row: int, num_new: int) -> bool:
        return self.num_blocks[row] + num_new <= self.max_blocks_per_row

    def append(self, row: int, blocks: list[int]) -> None:
        n = self.num_blocks[row]
        if not self.can_append(row, len(blocks)):
            raise InvalidRequestError(
                f"row {row} holds {n} blocks; {len(blocks)} more exceed the width {self.max_blocks_per_row}")
        if not blocks:
            return
        self._grow(row + 1, n + len(blocks))
        self._rows_np[row, n:n + len(blocks)] = blocks
        self.num_blocks[row] = n + len(blocks)

    def truncate(self, row: int, num_blocks: int) -> list[int]:
        """Keep the first ``num_blocks`` ids of the row; return (and clear) the dropped ones."""
        if num_blocks < 0:
            raise InvalidRequestError(f"cannot truncate row {row} to {num_blocks} blocks: use a count >= 0")
        if 0 < num_blocks < self.num_released[row]:
            raise InvalidRequestError(f"cannot truncate row {row} to {num_blocks} blocks: its first "
                                      f"{self.num_released[row]} were released (only a step's new pages are undone)")
        n = self.num_blocks[row]
        if num_blocks >= n:
            return []
        dropped = self.rows_RW[row, max(num_blocks, self.num_released[row]):n].tolist()
        self.rows_RW[row, num_blocks:n] = PAD_BLOCK_ID
        self.num_blocks[row] = num_blocks
        self.num_released[row] = min(self.num_released[row], num_blocks)
        return dropped

    def remove_row(self, row: int) -> list[int]:
        """Clear the row entirely and make it reusable; return the ids it still owned."""
        dropped = self.truncate(row, 0)
        self._free_rows.append(row)
        return dropped

    def release_prefix(self, row: int, count: int) -> list[int]:
        """The row no longer owns its first ``count`` pages (their ids stay); return the ones it owned until now."""
        count = min(count, self.num_blocks[row])
        start = self.num_released[row]
        if count <= start:
            return []
        self.num_released[row] = count
        return self._rows_np[row, start:count].tolist()

    def owned(self, row: int) -> list[int]:
        """The pages the row owns: all of it but its released prefix."""
        return self.rows_RW[row, self.num_released[row]:self.num_blocks[row]].tolist()

    def replace(self, row: int, index: int, block: int) -> int:
        """Put ``block`` at ``index`` of the row (a copy-on-write page); return the id it replaces."""
        if not 0 <= index < self.num_blocks[row]:
            raise InvalidRequestError(f"row {row} holds {self.num_blocks[row]} blocks: no index {index} to replace")
        old = int(self._rows_np[row, index])
        self._rows_np[row, index] = block
        return old

    def block_at(self, row: int, index: int) -> int:
        """The page id at ``index`` of the row (no bounds check against num_blocks: padding reads PAD_BLOCK_ID)."""
        return int(self._rows_np[row, index])

    def row(self, row: int) -> list[int]:
        return self.rows_RW[row, :self.num_blocks[row]].tolist()

    def gather(self, rows: list[int], width: int | None = None) -> torch.Tensor:
        """Block table of a batch: [B, width] int64, padding ``PAD_BLOCK_ID``."""
        width = width if width is not None else max([self.num_blocks[r] for r in rows], default=0)
        width = max(width, 1)
        out = torch.full((len(rows), width), PAD_BLOCK_ID, dtype=torch.int64)
        if rows:
            w = min(width, self.rows_RW.shape[1])
            out[:, :w] = self.rows_RW[torch.tensor(rows, dtype=torch.int64), :w]
        return out
