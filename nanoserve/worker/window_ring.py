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

Restoring a cached prefix would need the window layers' K/V of the prefix's last positions,
which no ring keeps once its row moves on; so a cache with rings is built only with prefix
caching off (the engine decides: nanoserve.engine.build).
"""

from __future__ import annotations

import torch


def ring_size(windows: list[int | None], max_queries: int, max_model_len: int) -> int | None:
    """The cells a row's ring holds (without its scratch), or None where rings would not save
    anything: no window layer, no layer without a window to keep the pool, or a ring as long as
    the row itself."""
    sliding = [w for w in windows if w is not None]
    if not sliding or len(sliding) == len(windows):
        return None
    ring = max(sliding) + max_queries - 1
    return ring if ring < max_model_len else None


class WindowRing:
    """The rings of ``max_batch_size`` rows, ``ring`` cells each (plus a scratch cell)."""

    def __init__(self, ring: int, max_batch_size: int, max_model_len: int, device: torch.device) -> None:
        self.ring, self.max_batch_size = ring, max_batch_size
        stride = ring + 1
        positions = torch.arange(max_model_len + 1, device=device)
        cells = torch.where(positions < max_model_len, positions % ring, ring)  # the last column: the scratch
        self.table = torch.arange(max_batch_size, device=device).view(-1, 1) * stride + cells

    @property
    def num_cells(self) -> int:
        return self.max_batch_size * (self.ring + 1)

    def row_cells(self, row: int) -> slice:
        """A row's ring and scratch, as a range of cells."""
        stride = self.ring + 1
        return slice(row * stride, (row + 1) * stride)


def ring_writes(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The ring cells queries write: query i of row ``rows[i]`` at ``positions[i]``; a padded
    query (length 0) writes its row's scratch cell."""
    cells = table[rows, positions]
    return torch.where(lengths > 0, cells, table[rows, -1])
