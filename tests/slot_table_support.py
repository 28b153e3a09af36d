"""What the tests do with a SlotTable besides the operations a step plan drives: append one cell
to each of some rows, read rows with their lengths, ask whether rows read as a window."""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.worker.slot_table import SlotTable, is_prefix


def lengths(table: SlotTable, rows) -> np.ndarray:
    return table.lengths_array[table.row_ids(rows)]


def is_window(table: SlotTable, rows) -> bool:
    """Whether reading `rows` gives a window (a view): they are the prefix 0..n-1."""
    return is_prefix(table.row_ids(rows))


def append(table: SlotTable, rows, slots: torch.Tensor | np.ndarray) -> None:
    """Write `slots[i]` at row `rows[i]`'s next column and bump those lengths: one indexed write.
    Raises ValueError (changing nothing) when a row is already `max_model_len` long."""
    ids = table.row_ids(rows)
    if tuple(slots.shape) != (len(ids),):
        raise ValueError(f"append needs [{len(ids)}] slots, got {tuple(slots.shape)}")
    cols = table.lengths_array[ids]
    full = [r for r, n in zip(ids, cols.tolist()) if n >= table.max_model_len]
    if full:
        raise ValueError(f"rows {full} already hold max_model_len={table.max_model_len} tokens; "
                         "the scheduler must finish or preempt them before another decode step")
    columns = torch.from_numpy(np.asarray(cols))
    table.write_cells(ids, columns, torch.as_tensor(slots, dtype=torch.int64))
    table.lengths_array[ids] = cols + 1


def read(table: SlotTable, rows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' `[n, width]` rectangle (`rect`) and a copy of their lengths on the device."""
    return table.rect(rows, width), torch.from_numpy(lengths(table, rows)).to(table.device)
