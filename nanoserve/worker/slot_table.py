"""The persistent slot table: where every row's tokens live, kept on the device.

One `[max_batch_size, max_model_len]` int64 buffer, allocated once, and the rows' lengths as
the worker last applied them (a host array). The host's block tables own a row's length; this
table is written only by the worker's operations that a step plan drives (`adopt`, `move`,
`reset`, and a decode step's `write_cells`), and the gates pit it against `rebuild_mapping`
over the block tables, the oracle. A decode step reads a rectangle: a *window* (a view) when
the rows are the prefix `0..n-1`, else a *gather* (a copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nanoserve.cache.blocks import BlockTable

RowsLike = int | range | Sequence[int] | torch.Tensor | np.ndarray


def is_prefix(ids: Sequence[int]) -> bool:
    """Whether row ids are 0..n-1 in order: a read of them is a window (a view), not a gather."""
    return list(ids) == list(range(len(ids)))


def rebuild_mapping(tables: Sequence[BlockTable], rows: Sequence[int], width: int | None = None,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """`[len(rows), width]` slots cell by cell from the block tables, zero-padded (width: the
    longest row by default). Raises ValueError when a row is longer than `width`."""
    rows = list(rows)
    lengths = [tables[row].num_tokens for row in rows]
    width = max(lengths, default=0) if width is None else width
    if any(length > width for length in lengths):
        raise ValueError(f"width {width} is narrower than row lengths {dict(zip(rows, lengths))}")
    mapping = [[tables[row].slot(t) for t in range(n)] + [0] * (width - n) for row, n in zip(rows, lengths)]
    return torch.tensor(mapping, dtype=torch.int64, device=device).reshape(len(rows), width)


class SlotTable:
    """Rows change only by `adopt`, `move`, `append`/`write_cells` and `reset` (a zeroed length:
    cells past it go unread); `windows`/`gathers` count the reads. Lengths are handed out as
    copies: a later append writes at column `length`, inside a rectangle somebody may still hold,
    and only a length that did not move masks that cell."""

    def __init__(self, max_batch_size: int, max_model_len: int, device: str | torch.device = "cpu") -> None:
        if max_batch_size < 1 or max_model_len < 1:
            raise ValueError(f"SlotTable needs positive sizes, got {max_batch_size} x {max_model_len}")
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.device = torch.device(device)
        self.slots = torch.zeros((max_batch_size, max_model_len), dtype=torch.int64, device=self.device)
        self.lengths_array = np.zeros(max_batch_size, dtype=np.int64)
        self._row_starts = torch.arange(max_batch_size, device=self.device) * max_model_len  # flat index of column 0
        self.windows = self.gathers = 0

    def row_ids(self, rows: RowsLike) -> list[int]:
        """A row set as a list of distinct ids; an int `n` is the prefix `0..n-1`."""
        if isinstance(rows, int):
            if not 1 <= rows <= self.max_batch_size:
                raise ValueError(f"a prefix of {rows} rows outside 1..{self.max_batch_size}")
            return list(range(rows))
        ids = [int(r) for r in (rows.tolist() if isinstance(rows, (torch.Tensor, np.ndarray)) else rows)]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= r < self.max_batch_size for r in ids):
            raise ValueError(f"rows {ids} must be a non-empty set of distinct ids in 0..{self.max_batch_size - 1}")
        return ids

    def adopt(self, row: int, slots: torch.Tensor) -> None:
        """Row `row` now holds len(slots) tokens at `slots` (a prefill chunk's context and write
        slots, or a row rebuilt). Raises ValueError (changing nothing) past max_model_len."""
        n = slots.shape[0]
        if n > self.max_model_len:
            raise ValueError(f"adopt: row {row} would hold {n} tokens; the slot table is {self.max_model_len} wide")
        self.slots[self.row_ids([row])[0], :n] = slots
        self.lengths_array[row] = n

    def move(self, src: int, dst: int, length: int) -> None:
        """Row `dst` takes `src`'s first `length` cells (a compaction); `src` ends reset."""
        if not 0 <= length <= self.max_model_len:
            raise ValueError(f"move: length {length} outside 0..{self.max_model_len}")
        src, dst = self.row_ids([src, dst])
        self.slots[dst, :length] = self.slots[src, :length]
        self.lengths_array[dst], self.lengths_array[src] = length, 0

    def write_cells(self, rows: RowsLike, columns: torch.Tensor, slots: torch.Tensor) -> None:
        """`slots[i]` at row `rows[i]`, column `columns[i]` (a decode step's write slots; a verify
        step names a row once per cell it writes): one indexed write. The lengths are the
        caller's to set (it holds the columns on the host)."""
        if isinstance(rows, int):  # the prefix 0..rows-1
            starts = self._row_starts[:rows]
        else:
            ids = [int(r) for r in rows]
            if not all(0 <= r < self.max_batch_size for r in ids):
                raise ValueError(f"write_cells: rows {sorted(set(ids))} outside 0..{self.max_batch_size - 1}")
            starts = self._row_starts[torch.tensor(ids, device=self.device)]
        self.slots.view(-1).index_copy_(0, starts + columns.to(self.device), slots.to(self.device, torch.int64))

    def trim(self, row: int, length: int) -> None:
        """The row keeps its first `length` cells (no longer than it is); nothing is cleared."""
        row = self.row_ids([row])[0]
        if not 0 <= length <= self.lengths_array[row]:
            raise ValueError(f"trim: row {row} holds {int(self.lengths_array[row])} cells, cannot keep {length}")
        self.lengths_array[row] = length

    def reset(self, row: int) -> None:
        """Set the row's length to zero and clear nothing: cells past a length go unread."""
        self.lengths_array[self.row_ids([row])[0]] = 0

    def rect(self, rows: RowsLike, width: int) -> torch.Tensor:
        """`[n, width]`: a view of the buffer when rows are the prefix 0..n-1 (a window), else
        a copy (a gather: narrowed before the index_select)."""
        ids = self.row_ids(rows)
        if not 0 <= width <= self.max_model_len:
            raise ValueError(f"read width {width} outside 0..{self.max_model_len}")
        if is_prefix(ids):
            self.windows += 1
            return self.slots[: len(ids), :width]
        self.gathers += 1
        return self.slots.narrow(1, 0, width).index_select(0, torch.tensor(ids, device=self.device))
