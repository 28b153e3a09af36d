"""Where a sliding-window layer keeps its K/V: a ring of cells per row, not the pool.

A layer with a window reads only a row's last ``window`` positions, so it needs no more than
``window`` cells a row, plus those a step writes before it reads (a verify step's 1 + k
queries). Each row owns ``ring = window + max_queries - 1`` consecutive cells and one more, its
scratch: position p of row r lives in cell ``r * (ring + 1) + p % ring``. The addressing is
fixed for the life of the cache, so it is one constant table ``[rows, max_model_len + 1]``
(the last column is each row's scratch cell), read by the decode graph as it reads the slot
table: a window ``[:rows, :width]``.

Reads never see an overwritten cell: a decode row reads its last ``window`` positions after
writing at most ``max_queries``; a prefill chunk reads its context (the ``window - 1`` positions
before it) before it writes, and writes only its last ``ring`` positions. A request that moves
row takes its ring with it (``KVCache.move``).

A cached prefix's blocks hold the global layers' K/V alone; restoring it needs the window
layers' K/V of its last positions too, which a ring drops as its row moves on. So with prefix
caching the cache also keeps saved rings, laid out as rows after the live ones: a row's rings
are saved where it stood at a block boundary (its prompt's end, its release), and a row that
adopts that prefix restores them (cache/ring_snapshots.py says which; the plan carries the
copies). For a saved ring to hold the window before its boundary, a ring keeps
``block_size - 1`` more cells.
"""

from __future__ import annotations

import torch


def ring_size(windows: list[int | None], max_queries: int, max_model_len: int, block_size: int = 1) -> int | None:
    """The cells a row's ring holds (without its scratch), or None where rings would not save
    anything: no window layer, no layer without a window to keep the pool, or a ring as long as
    the row itself. With ``block_size`` (rings saved for prefix caching) a ring also keeps the
    window before the last block boundary a row passed, up to ``block_size - 1`` positions ago."""
    sliding = [w for w in windows if w is not None]
    if not sliding or len(sliding) == len(windows):
        return None
    ring = max(sliding) + max_queries - 1 + block_size - 1
    return ring if ring < max_model_len else None


class WindowRing:
    """The rings of ``max_batch_size`` rows, ``ring`` cells each (plus a scratch cell), and
    ``snapshots`` saved rows' worth after them."""

    def __init__(self, ring: int, max_batch_size: int, max_model_len: int, device: torch.device,
                 snapshots: int = 0) -> None:
        self.ring, self.max_batch_size, self.snapshots = ring, max_batch_size, snapshots
        stride = ring + 1
        positions = torch.arange(max_model_len + 1, device=device)
        cells = torch.where(positions < max_model_len, positions % ring, ring)  # the last column: the scratch
        self.table = torch.arange(max_batch_size, device=device).view(-1, 1) * stride + cells

    @property
    def num_cells(self) -> int:
        return (self.max_batch_size + self.snapshots) * (self.ring + 1)

    def row_cells(self, row: int) -> slice:
        """A row's ring and scratch, as a range of cells."""
        stride = self.ring + 1
        return slice(row * stride, (row + 1) * stride)

    def snapshot_cells(self, slot: int) -> slice:
        """Saved ring ``slot``'s cells: laid out as a row's, so a position keeps its cell's offset."""
        if not 0 <= slot < self.snapshots:
            raise ValueError(f"ring snapshot {slot} outside 0..{self.snapshots - 1}")
        return self.row_cells(self.max_batch_size + slot)


def ring_writes(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The ring cells queries write: query i of row ``rows[i]`` at ``positions[i]``; a padded
    query (length 0) writes its row's scratch cell."""
    cells = table[rows, positions]
    return torch.where(lengths > 0, cells, table[rows, -1])
