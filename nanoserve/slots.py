"""The persistent slot table: where every row's tokens live, kept on the device.

`SlotTable` is one `[max_batch_size, max_model_len]` int64 buffer allocated once.
A decode step appends one cell per row (one indexed write, one length update) and
reads its rectangle. `append` also comes in two halves: `stage` writes the cells of
several steps at once (one indexed write) and `advance` is then each step's length
update. Either way: a *window* (`slots[:n, :width]`, a view of the buffer) when the
rows are the prefix `0..n-1`, a *gather* (narrow, then `index_select`) otherwise.
The lengths always come back as a copy: a later append writes at column `length`,
which for a short row is inside a rectangle somebody may still hold, and only a
`context_lens` that did not move keeps that cell out of the read.

`rebuild_mapping` is the construction the table replaced: every cell from its
block table, one `slot()` call at a time. It is the resync path and the oracle.
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

    Day 50's construction, kept plain on purpose: it is the oracle the table is
    graded against, and its cost (rows * width slot() calls and one build onto the
    device, every call) is what the benchmark's rebuild arm measures.
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


@dataclass(frozen=True, eq=False)
class Rows:
    """A batch's row ids, validated once, in every form one SlotTable indexes with."""

    ids: tuple[int, ...]
    n: int
    index: np.ndarray
    device_index: torch.Tensor
    is_prefix: bool
    owner: object


RowsLike = Rows | int | Sequence[int] | torch.Tensor | np.ndarray


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

    Allocated once on `device` and never reallocated. Rows change by `append`
    (one cell per row at the row's own next column), by `resync` (a whole row
    copied in from its block table) and by `reset` (length to zero, nothing cleared).
    """

    _MEMO_LIMIT = 64

    def __init__(
        self, max_batch_size: int, max_model_len: int, device: str | torch.device = "cpu",
        numpy_writes: bool | None = None,
    ) -> None:
        """`numpy_writes` (default: on the CPU) writes through numpy views of the buffers;
        False runs the device path (torch ops plus a host copy of the lengths) anywhere."""
        if max_batch_size < 1 or max_model_len < 1:
            raise ValueError(f"SlotTable needs positive sizes, got {max_batch_size} x {max_model_len}")
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.slots = torch.zeros((max_batch_size, max_model_len), dtype=torch.int64, device=self.device)
        self._lens = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        # On the host the buffers are plain memory, and a numpy view is the cheapest handle on
        # them for small indexed writes (a numpy call costs a fraction of a torch dispatch).
        # Elsewhere the host keeps its own copy of the lengths, so it never waits on the device.
        self._on_host = self.device.type == "cpu" if numpy_writes is None else numpy_writes
        if self._on_host and self.device.type != "cpu":
            raise ValueError(f"numpy_writes needs a CPU table, not {self.device}")
        self._host_slots = self.slots.numpy() if self._on_host else None
        self._host_lens = self._lens.numpy() if self._on_host else np.zeros(max_batch_size, dtype=np.int64)
        self._ones = torch.ones(max_batch_size, dtype=torch.int64, device=self.device)
        self._resyncs_by_row = np.zeros(max_batch_size, dtype=np.int64)
        self._rows_memo: dict[tuple[int, ...], Rows] = {}
        self._strides = self.slots.stride()
        self.appended_cells = 0
        self.resynced_cells = 0
        self.resyncs = 0
        self.windows = 0
        self.gathers = 0
        self.version = 0  # bumped by everything but stage/advance: lets a caller tell that rows moved under it
        self._staged_rows: Rows | None = None  # what the last stage() wrote, and how many columns are left
        self._staged_left = 0
        # Columns advance() took into the staged rows that the lengths do not count yet: a
        # step costs a counter, and the lengths catch up (one add) before anything reads them.
        self._advanced = 0

    # -- rows --------------------------------------------------------------------------

    def rows(self, rows: RowsLike) -> Rows:
        """Normalise a row set (validated once, then remembered)."""
        if isinstance(rows, Rows):
            if rows.owner is self:
                return rows
            rows = rows.ids
        elif isinstance(rows, range) and rows.start == 0 and rows.step == 1:
            rows = rows.stop  # the prefix of that many rows
        elif isinstance(rows, (torch.Tensor, np.ndarray)):
            rows = rows.tolist()
        if isinstance(rows, int):  # a prefix, remembered under its size: no tuple to build and hash
            cached = self._rows_memo.get(rows)
            if cached is None:
                cached = self._rows_memo[rows] = self.rows(tuple(range(rows)))
            return cached
        key = tuple(rows)
        cached = self._rows_memo.get(key)
        if cached is not None:
            return cached
        ids = tuple(int(r) for r in key)
        if not ids:
            raise ValueError("empty row set")
        bad = [r for r in ids if not 0 <= r < self.max_batch_size]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"rows {list(ids)} must be distinct ids in 0..{self.max_batch_size - 1}")
        is_prefix = ids == tuple(range(len(ids)))
        index = np.asarray(ids, dtype=np.int64)
        built = Rows(
            ids=ids,
            n=len(ids),
            index=index,
            device_index=torch.tensor(ids, dtype=torch.int64, device=self.device),
            is_prefix=is_prefix,
            owner=self,
        )
        if len(self._rows_memo) >= self._MEMO_LIMIT:
            self._rows_memo.clear()
        self._rows_memo[key] = built
        return built

    def is_window(self, rows: RowsLike) -> bool:
        """Whether a read over `rows` is a view of the buffer (rows are the prefix 0..n-1)."""
        return self.rows(rows).is_prefix

    @property
    def lens(self) -> torch.Tensor:
        """The rows' lengths on the table's device `[max_batch_size]` (the buffer itself)."""
        self._settle()
        return self._lens

    def length(self, row: int) -> int:
        self._settle()
        return int(self._host_lens[self._check_row(row)])

    def lengths(self, rows: RowsLike) -> np.ndarray:
        """The host's copy of the rows' lengths (no device read)."""
        self._settle()
        return self._host_lens[self.rows(rows).index].copy()

    # -- writes ------------------------------------------------------------------------

    def append(self, rows: RowsLike, slots: torch.Tensor | np.ndarray) -> None:
        """Write `slots[i]` at row `rows[i]`'s next column, then advance those lengths by one.

        `slots` is an int64 tensor, or a numpy array (what a host table writes with anyway).
        One indexed write and one length update for all rows. Raises ValueError when a
        row is already `max_model_len` long.
        """
        rows = self.rows(rows)
        if slots.shape != (rows.n,):
            raise ValueError(f"append needs [{rows.n}] slots, got {tuple(slots.shape)}")
        self.stage(rows, slots.reshape(1, rows.n))  # raises past the edge, before any length moves
        self.advance(rows)
        self._staged_left = 0
        self.version += 1

    def stage(self, rows: RowsLike, slots: torch.Tensor | np.ndarray) -> None:
        """Write the next ``steps`` cells of every row past its length: ``slots`` [steps, n],
        row ``rows[i]``'s cells in column i. One indexed write; no length moves, so nothing
        staged is read yet. ``advance(rows)`` then takes one staged column per call into the
        rows: ``append`` split in two, so a decode run writes its cells once and each of its
        steps is a length update. Anything else that changes the table drops what is staged.
        Raises ValueError past ``max_model_len``.
        """
        rows = self.rows(rows)
        if slots.ndim != 2 or slots.shape[1] != rows.n:
            raise ValueError(f"stage needs [steps, {rows.n}] slots, got {tuple(slots.shape)}")
        steps = slots.shape[0]
        self._settle()
        start = self._host_lens[rows.index]
        if int(start.max()) + steps > self.max_model_len:
            raise self._full_error(rows, steps)
        cols = start + np.arange(steps).reshape(steps, 1)  # [steps, n]
        if self._on_host:
            self._host_slots[rows.index, cols] = slots if isinstance(slots, np.ndarray) else slots.numpy()
        else:
            if isinstance(slots, np.ndarray):
                slots = torch.from_numpy(slots).to(self.device)
            index = rows.device_index.expand(steps, rows.n)
            self.slots.index_put_((index, torch.from_numpy(cols).to(self.device)), slots)
        self._staged_rows, self._staged_left = rows, steps

    def advance(self, rows: RowsLike) -> None:
        """One step of staged cells becomes part of the rows: each length goes up by one.
        The step itself is a counter; every read of the lengths settles them first (one add
        per run of steps, on the device too, not one per step). Raises ValueError when
        nothing is staged for exactly these rows."""
        rows = self.rows(rows)
        if self._staged_rows is not rows or not self._staged_left:
            raise ValueError(f"advance: no staged cells for rows {list(rows.ids)}; stage() them first "
                             "(a resync, reset or append since then drops them)")
        self._staged_left -= 1
        self._advanced += 1
        self.appended_cells += rows.n

    def _settle(self) -> None:
        """Bring the lengths up to date with the columns advance() took since they last were."""
        steps = self._advanced
        if not steps:
            return
        self._advanced = 0
        rows = self._staged_rows
        self._host_lens[rows.index] += steps
        if not self._on_host:
            self._lens.index_add_(0, rows.device_index, self._ones[: rows.n] * steps)

    def resync(self, table: TableLike, row: int) -> None:
        """Copy a whole row in from its block table (rebuild_mapping for one row)."""
        self._check_row(row)
        self._settle()
        n = table.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"row {row}: table holds {n} tokens, the slot table is {self.max_model_len} wide")
        if self._on_host:  # numpy views of the buffers: a fraction of torch's setitem
            if n:
                self._host_slots[row, :n] = rebuild_mapping([table], [0]).numpy()[0]
        else:
            if n:
                self.slots[row, :n] = rebuild_mapping([table], [0], device=self.device)[0]
            self._lens[row] = n
        self._host_lens[row] = n
        self.resynced_cells += n
        self.resyncs += 1
        self._resyncs_by_row[row] += 1
        self._staged_left = 0
        self.version += 1

    def sync(self, tables: Sequence[TableLike], rows: RowsLike, lengths: np.ndarray | None = None) -> list[int]:
        """Resync every row whose length disagrees with its table; returns those rows.

        Length alone is enough because a row's slots only change by append (which the
        table does itself) or by a tenant change, which goes through a reset to zero.
        `lengths`, if given, are the tables' token counts in row order (saves asking each).
        """
        rows = self.rows(rows)
        if lengths is None:
            lengths = np.fromiter((tables[r].num_tokens for r in rows.ids), dtype=np.int64, count=rows.n)
        self._settle()
        stale = rows.index[self._host_lens[rows.index] != lengths].tolist()
        for row in stale:
            self.resync(tables[row], row)
        return stale

    def reset(self, row: int) -> None:
        """Set a row's length to zero. Clears nothing: the old cells sit past the length, unread."""
        self._check_row(row)
        self._settle()
        if not self._on_host:
            self._lens[row] = 0
        self._host_lens[row] = 0
        self._staged_left = 0
        self.version += 1

    # -- reads -------------------------------------------------------------------------

    def read(self, rows: RowsLike, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[n, width]` slot rectangle and a copy of the rows' lengths.

        A view of the buffer when rows are the prefix 0..n-1 (a window), else a copy of
        exactly `[n, width]` (a gather: narrowed before the index_select).
        """
        rows = self.rows(rows)
        rect = self.rect(rows, width)
        lens = self.lens
        if rows.is_prefix:
            return rect, lens[: rows.n].clone()
        return rect, lens.index_select(0, rows.device_index)

    def rect(self, rows: RowsLike, width: int) -> torch.Tensor:
        """Just the rectangle of `read`: a window for a prefix, a gathered copy otherwise."""
        rows = self.rows(rows)
        if not 0 <= width <= self.max_model_len:
            raise ValueError(f"read width {width} outside 0..{self.max_model_len}")
        if rows.is_prefix:
            self.windows += 1
            # slots[:n, :width]; as_strided makes the same view for a third of the dispatch cost.
            return self.slots.as_strided((rows.n, width), self._strides)
        self.gathers += 1
        return self.slots.narrow(1, 0, width).index_select(0, rows.device_index)

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
        self._settle()
        ids = self.rows(rows).ids if rows is not None else tuple(np.flatnonzero(self._host_lens).tolist())
        head = (
            f"SlotTable {self.max_batch_size} x {self.max_model_len} on {self.device}: "
            f"appended {self.appended_cells}, resynced {self.resynced_cells} ({self.resyncs} resyncs), "
            f"{self.windows} windows / {self.gathers} gathers"
        )
        lines = [head, " row   len | slots"]
        host = self.slots[list(ids), :max_cols].cpu().tolist() if ids else []
        for row, cells in zip(ids, host):
            length = self.length(row)
            shown = [f"{c:5d}" if col < length else "    ." for col, c in enumerate(cells)]
            more = " ..." if length > max_cols else ""
            lines.append(f"{row:4d} {length:5d} |{''.join(shown)}{more}")
        if not ids:
            lines.append("   (no rows hold tokens)")
        return "\n".join(lines)

    # -- helpers -----------------------------------------------------------------------

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.max_batch_size:
            raise ValueError(f"row {row} outside 0..{self.max_batch_size - 1}")
        return row

    def _full_error(self, rows: Rows, steps: int = 1) -> ValueError:
        full = rows.index[self._host_lens[rows.index] + steps > self.max_model_len].tolist()
        more = "" if steps == 1 else f" (or cannot take {steps} more)"
        return ValueError(
            f"rows {full} already hold max_model_len={self.max_model_len} tokens{more}; "
            "the scheduler must finish or preempt them before another decode step"
        )
