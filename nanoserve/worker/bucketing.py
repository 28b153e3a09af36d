"""Bucketing arithmetic: the small set of [rows, width] shapes the decode graph ever sees.

A step with ``n`` running rows and a longest context of ``w`` tokens is padded up to
``(row_bucket(n), width_bucket(w))``. A padded row has length 0 and attends over nothing; a
padded column is masked by ``context_lens`` (or never read, by the CPU decode kernel). The
price is padding, reported as waste.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


def default_row_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 to 32, then steps of 16, capped by (and ending at)
    ``max_batch_size``: fine where small batches are common, coarse where padding is cheap."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size = size * 2 if size < 8 else size + (8 if size < 32 else 16)
    buckets.append(max_batch_size)
    return tuple(buckets)


def default_width_buckets(block_size: int, max_model_len: int, growth: float = 2.0,
                          first: int | None = None) -> tuple[int, ...]:
    """Multiples of ``block_size`` growing geometrically, the last one ``max_model_len``."""
    if growth <= 1.0:
        raise ValueError(f"growth must be > 1, got {growth}")
    width = first or min(4 * block_size, max_model_len)
    buckets = []
    while width < max_model_len:
        buckets.append(width)
        width = -(-int(width * growth) // block_size) * block_size  # round up to a block
    buckets.append(max_model_len)
    return tuple(buckets)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n. Raises ValueError past the largest."""
    index = bisect_left(buckets, n)
    if n < 1 or index == len(buckets):
        raise ValueError(f"{n} does not fit the buckets {list(buckets)}")
    return buckets[index]


def default_query_buckets(num_speculative_tokens: int) -> tuple[int, ...]:
    """A verify step's tokens per row (1 + proposals): every count to 5, then 7, 9, 13, 17, ...
    below 1 + k, and 1 + k. Where a small model's verify is compute-bound a padded query costs
    as much as a real one, so the common small counts are exact."""
    top, buckets, size = num_speculative_tokens + 1, [1], 2
    while size < top:
        buckets.append(size)
        size = size + 1 if size < 5 else size + (size - 1) // 2
    return tuple(buckets + [top]) if top > 1 else (1,)


@dataclass(frozen=True)
class Buckets:
    """The decode grid ``rows`` x ``widths``; with speculation, also the verify grid: row
    buckets up to ``verify_rows`` x ``queries`` past 1 x ``widths``."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    queries: tuple[int, ...] = (1,)
    verify_rows: int = 0  # the largest row bucket a verify step uses (0: none)

    def __post_init__(self) -> None:
        if self.queries[0] != 1:
            raise ValueError(f"query buckets must start at 1 (a plain decode step), got {self.queries}")
        for name, values in (("rows", self.rows), ("widths", self.widths), ("queries", self.queries)):
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} buckets must be distinct, increasing and >= 1, got {values}")

    @classmethod
    def default(cls, max_batch_size: int, block_size: int, max_model_len: int) -> Buckets:
        return cls(default_row_buckets(max_batch_size), default_width_buckets(block_size, max_model_len))

    def shape_for(self, num_rows: int, max_context: int) -> tuple[int, int]:
        return bucket_for(num_rows, self.rows), bucket_for(max_context, self.widths)

    @property
    def grid(self) -> list[tuple[int, int]]:
        return [(r, w) for r in self.rows for w in self.widths]

    @property
    def verify_grid(self) -> list[tuple[int, int, int]]:
        """Every (rows, queries, width) a verify graph is built for."""
        return [(r, q, w) for r in self.rows if r <= self.verify_rows for q in self.queries[1:] for w in self.widths]


def step_shape(buckets: Buckets | None, num_rows: int, max_context: int, queries: int = 1) -> tuple[int, int, int]:
    """(rows, width, queries) of a decode step (queries > 1: a verify step), bucketed, or
    exact without buckets. Raises ValueError for a verify past the verify grid's rows."""
    if buckets is None:
        return num_rows, max_context, queries
    rows, width = buckets.shape_for(num_rows, max_context)
    if queries == 1:
        return rows, width, 1
    if rows > buckets.verify_rows:
        raise ValueError(f"{num_rows} rows do not verify: the verify grid ends at {buckets.verify_rows} rows")
    return rows, width, bucket_for(queries, buckets.queries)


@dataclass
class PaddingWaste:
    """Cells the forward's attention read vs cells that held a real token."""

    padded_cells: int = 0
    real_cells: int = 0

    def add(self, cells_read: int, context_lens_sum: int) -> None:
        self.padded_cells += cells_read - context_lens_sum
        self.real_cells += context_lens_sum

    @property
    def ratio(self) -> float:
        """Padded cells per real cell (0 means no padding at all)."""
        return self.padded_cells / self.real_cells if self.real_cells else 0.0
