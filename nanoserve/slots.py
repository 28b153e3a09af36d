"""The persistent slot table: where every row's tokens live, kept on the device.

`SlotTable` is one `[max_batch_size, max_model_len]` int64 buffer allocated once, and
the rows' lengths. A decode step appends one cell per row (one indexed write at each
row's own next column, one length bump) and reads its rectangle: a *window*
(`slots[:n, :width]`, a view of the buffer) when the rows are the prefix `0..n-1`, a
*gather* (`narrow`, then `index_select`) otherwise.

The lengths live in one host array, `lengths_array`; a cache binds its block tables'
token counts to it, so a row's length has one owner. Reads hand lengths out as copies:
a later append writes at column `length`, which for a short row is inside a rectangle
somebody may still hold, and only lengths that did not move keep that cell out of the read.

`rebuild_mapping` is the construction the table replaced: every cell from its block
table, one `slot()` call at a time. It is the oracle the table is checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class TableLike(Protocol):
    """What the table needs from a block table (nanoserve.cache.blocks.BlockTable)."""

    @property
    def num_tokens(self) -> int: ...

    def slot(self, t: int) -> int: ...


def rebuild_mapping(
    tables: Sequence[TableLike], rows: Sequence[int], width: int | None = None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Build `[len(rows), width]` slots cell by cell from the block tables, zero-padded.

    Kept plain on purpose: it is the oracle the table is graded against, and its cost
    (rows * width slot() calls and one copy onto the device, every call) is what the
    benchmark's rebuild arm measures.
    """
    rows = list(rows)
    lengths = [tables[row].num_tokens for row in rows]
    if width is None:
        width = max(lengths, default=0)
    if any(length > width for length in lengths):
        raise ValueError(f"width {width} is narrower than row lengths {dict(zip(rows, lengths))}")
    mapping = [[0] * width for _ in rows]
    for i, row in enumerate(rows):
        table = tables[row]
        for t in range(table.num_tokens):
            mapping[i][t] = table.slot(t)
    return torch.tensor(mapping, dtype=torch.int64, device=device).reshape(len(rows), width)


RowsLike = int | range | Sequence[int] | torch.Tensor | np.ndarray


@dataclass(frozen=True)
class SlotCounters:
    """A snapshot of what a SlotTable has done, for gates that compare before and after."""

    appended_cells: int
    resynced_cells: int
    resyncs: int
    windows: int
    gathers: int
    resyncs_by_row: tuple[int, ...]


class SlotTable:
    """One `[max_batch_size, max_model_len]` int64 slot buffer and its row lengths.

    Allocated once on `device` and never reallocated. Rows change by `append` (one cell
    per row at the row's own next column), by `resync` (a whole row copied in from its
    block table) and by `reset` (length to zero, nothing cleared).
    """

    def __init__(self, max_batch_size: int, max_model_len: int, device: str | torch.device = "cpu") -> None:
        if max_batch_size < 1 or max_model_len < 1:
            raise ValueError(f"SlotTable needs positive sizes, got {max_batch_size} x {max_model_len}")
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.slots = torch.zeros((max_batch_size, max_model_len), dtype=torch.int64, device=self.device)
        self.lengths_array = np.zeros(max_batch_size, dtype=np.int64)  # the rows' lengths: their one owner
        self._resyncs_by_row = np.zeros(max_batch_size, dtype=np.int64)
        self.appended_cells = 0
        self.resynced_cells = 0
        self.resyncs = 0
        self.windows = 0
        self.gathers = 0

    # -- rows --------------------------------------------------------------------------

    def row_ids(self, rows: RowsLike) -> list[int]:
        """A row set as a list of distinct ids; an int `n` is the prefix `0..n-1`."""
        if isinstance(rows, int):  # the common decode case: only the size to check
            if not 1 <= rows <= self.max_batch_size:
                raise ValueError(f"a prefix of {rows} rows outside 1..{self.max_batch_size}")
            return list(range(rows))
        if isinstance(rows, (torch.Tensor, np.ndarray)):
            rows = rows.tolist()
        ids = [int(r) for r in rows]
        if not ids:
            raise ValueError("empty row set")
        if len(set(ids)) != len(ids) or not all(0 <= r < self.max_batch_size for r in ids):
            raise ValueError(f"rows {ids} must be distinct ids in 0..{self.max_batch_size - 1}")
        return ids

    @staticmethod
    def is_prefix(ids: Sequence[int]) -> bool:
        return ids[-1] == len(ids) - 1 and all(r == i for i, r in enumerate(ids))

    def is_window(self, rows: RowsLike) -> bool:
        """Whether a read over `rows` is a view of the buffer (rows are the prefix 0..n-1)."""
        return self.is_prefix(self.row_ids(rows))

    @property
    def lens(self) -> torch.Tensor:
        """Every row's length `[max_batch_size]`, a copy on the table's device."""
        return torch.from_numpy(self.lengths_array.copy()).to(self.device)

    def length(self, row: int) -> int:
        return int(self.lengths_array[self._check_row(row)])

    def lengths(self, rows: RowsLike) -> np.ndarray:
        """A host copy of the rows' lengths."""
        return self.lengths_array[self.row_ids(rows)]

    # -- writes ------------------------------------------------------------------------

    def append(self, rows: RowsLike, slots: torch.Tensor | np.ndarray) -> None:
        """Write `slots[i]` at row `rows[i]`'s next column, then bump those lengths by one.

        One indexed write and one length update for all rows. Raises ValueError (changing
        nothing) when a row is already `max_model_len` long.
        """
        ids = self.row_ids(rows)
        if tuple(slots.shape) != (len(ids),):
            raise ValueError(f"append needs [{len(ids)}] slots, got {tuple(slots.shape)}")
        cols = self.lengths_array[ids]
        full = [r for r, n in zip(ids, cols.tolist()) if n >= self.max_model_len]
        if full:
            raise ValueError(f"rows {full} already hold max_model_len={self.max_model_len} tokens; "
                             "the scheduler must finish or preempt them before another decode step")
        slots = torch.as_tensor(slots, dtype=torch.int64).to(self.device)
        index = (torch.tensor(ids, device=self.device), torch.from_numpy(cols).to(self.device))
        self.slots.index_put_(index, slots)
        self.lengths_array[ids] = cols + 1
        self.appended_cells += len(ids)

    def resync(self, table: TableLike, row: int) -> None:
        """Copy a whole row in from its block table (rebuild_mapping for one row)."""
        self._check_row(row)
        n = table.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"row {row}: table holds {n} tokens, the slot table is {self.max_model_len} wide")
        if n:
            self.slots[row, :n] = rebuild_mapping([table], [0], device=self.device)[0]
        self.lengths_array[row] = n
        self.resynced_cells += n
        self.resyncs += 1
        self._resyncs_by_row[row] += 1

    def reset(self, row: int) -> None:
        """Set a row's length to zero. Clears nothing: the old cells sit past the length, unread."""
        self.lengths_array[self._check_row(row)] = 0

    # -- reads -------------------------------------------------------------------------

    def read(self, rows: RowsLike, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[n, width]` slot rectangle (`rect`) and a copy of the rows' lengths on the device."""
        ids = self.row_ids(rows)
        return self.rect(ids, width), torch.from_numpy(self.lengths_array[ids]).to(self.device)

    def rect(self, rows: RowsLike, width: int) -> torch.Tensor:
        """A view of the buffer when rows are the prefix 0..n-1 (a window), else a copy of
        exactly `[n, width]` (a gather: narrowed before the index_select)."""
        ids = self.row_ids(rows)
        if not 0 <= width <= self.max_model_len:
            raise ValueError(f"read width {width} outside 0..{self.max_model_len}")
        if self.is_prefix(ids):
            self.windows += 1
            return self.slots[: len(ids), :width]
        self.gathers += 1
        return self.slots.narrow(1, 0, width).index_select(0, torch.tensor(ids, device=self.device))

    # -- what it says about itself ---------------------------------------------------------

    @property
    def window_share(self) -> float:
        """Fraction of reads that were windows (0.0 before any read)."""
        reads = self.windows + self.gathers
        return self.windows / reads if reads else 0.0

    def counters(self) -> SlotCounters:
        return SlotCounters(
            appended_cells=self.appended_cells,
            resynced_cells=self.resynced_cells,
            resyncs=self.resyncs,
            windows=self.windows,
            gathers=self.gathers,
            resyncs_by_row=tuple(int(x) for x in self._resyncs_by_row),
        )

    def render(self, rows: RowsLike | None = None, max_cols: int = 12) -> str:
        """A text picture of the table: each row's length and its first cells ('.' past the length)."""
        ids = self.row_ids(rows) if rows is not None else np.flatnonzero(self.lengths_array).tolist()
        head = (
            f"SlotTable {self.max_batch_size} x {self.max_model_len} on {self.device}: "
            f"appended {self.appended_cells}, resynced {self.resynced_cells} ({self.resyncs} resyncs), "
            f"{self.windows} windows / {self.gathers} gathers"
        )
        lines = [head, " row   len | slots"]
        cells = self.slots[ids, :max_cols].cpu().tolist() if ids else []
        for row, row_cells in zip(ids, cells):
            length = self.length(row)
            shown = [f"{c:5d}" if col < length else "    ." for col, c in enumerate(row_cells)]
            more = " ..." if length > max_cols else ""
            lines.append(f"{row:4d} {length:5d} |{''.join(shown)}{more}")
        if not ids:
            lines.append("   (no rows hold tokens)")
        return "\n".join(lines)

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.max_batch_size:
            raise ValueError(f"row {row} outside 0..{self.max_batch_size - 1}")
        return row
