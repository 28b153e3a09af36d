"""The paged KV cache: K/V tensors, the block pool, one block table per row, and the slot table.

A decode step is `plan_decode(rows)`: it appends each row's write slot to the `SlotTable`
and reads the step's `slot_mapping` window out of it. The host keeps every row's block ids
(`block_ids`, like vLLM's block tables) and token counts. Within a *run* (steps over the
same rows with nothing changed in between) every row's write slot, position and length go
up by one per step, so a run's vectors are laid out once, for all of its steps, in a few
array operations, and its cells are staged into the slot table in one indexed write. A row
that crosses into a new block mid-run does not end the run: the block it will get is the
pool's next free id, known in advance while nothing else touches the pool (`pool.version`
says), and is taken from the pool on the step that needs it, so the pool's accounting is
exactly what a step-by-step allocator's would be. A step inside a run is two counters, a
view and the plan: no Python loop over rows and no tensor built from a list. Only a row
that takes a new block costs Python of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.cache.blocks import BlockPool, BlockTable, PoolExhaustedError, _Counts
from nanoserve.slots import Rows, RowsLike, SlotTable

_NO_OWNER = -1
_SCRATCH_OWNER = -2


@dataclass(slots=True)
class DecodePlan:
    """Everything one decode step needs to address the cache. A value: nothing changes it
    after plan_decode returns (not frozen only because frozen construction costs a
    measurable share of a decode step).

    slot_mapping [n, width]: a window of the slot table when rows are a prefix, else a copy;
        width is the longest context.
    context_lens [n]: the rows' lengths counting the token written this step. Not a view of
        the table: a held plan's lengths never move (the staleness gates rely on it).
    write_slots [n], positions [n]: where this step's K/V goes, and its position.
    """

    rows: tuple[int, ...]
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    write_slots: torch.Tensor
    positions: torch.Tensor
    is_window: bool

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return self.slot_mapping.shape[1]


@dataclass
class _Run:
    """A decode run: consecutive steps over the same rows with nothing changed in between.
    Every per-row vector is an arithmetic progression over the run, so all of them are laid
    out at once. A row crossing into a new block mid-run does not end it: the block it will
    get is the pool's next free id (`BlockPool.peek`), known while nothing else touches the
    pool, and the step that needs it takes it for real."""

    rows: Rows
    counts_version: int
    table_version: int
    pool_version: int
    length: int
    first_width: int  # the longest context at the run's first step; one more each step
    write_slots: tuple[torch.Tensor, ...]  # one [n] view per step
    # length + 1 views: a step's context lengths are the next step's positions, so the same
    # (never written) view serves both.
    positions: tuple[torch.Tensor, ...]
    # (step, row ids, block ids) for each step where rows take a block, last step first
    grows: list[tuple[int, np.ndarray, np.ndarray]]
    next_grow: int  # the step of grows[-1], or -1
    step: int = 0


class BatchedPagedKVCache:
    """K/V storage for up to `max_batch_size` rows, addressed through a persistent SlotTable.

    One block is reserved at construction; its first slot is `scratch_slot`, where padded
    rows may write and no real row ever reads. `max_model_len` is clamped to the slots the
    rest of the pool holds.
    """

    # A run laid out but cut short wastes its unused steps (a few hundred ns each); one that
    # is used up doubles the next, so a steady batch spends little on starts.
    MAX_RUN_STEPS = 256

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     max_batch_size=max_batch_size, max_model_len=max_model_len)
        if any(v < 1 for v in sizes.values()):
            raise ValueError(f"cache sizes must be positive: {sizes}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the reserved scratch block)")
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.pool = BlockPool(num_blocks, block_size)
        self._scratch_block = self.pool.allocate(1)[0]
        self.scratch_slot = self._scratch_block * block_size
        self.max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        self.max_blocks_per_row = -(-self.max_model_len // block_size)
        # One tensor per layer: a slice of a stacked tensor written in place inside a compiled
        # graph made inductor copy the whole cache every step (DESIGN.md, compile notes).
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._counts = _Counts(max_batch_size)
        self.tables = [BlockTable._in_counts(block_size, self._counts, row) for row in range(max_batch_size)]
        self.slot_table = SlotTable(max_batch_size, self.max_model_len, self.device)
        # Each row's block ids, on the host like vLLM's block tables: decode runs are laid out here.
        self.block_ids = np.zeros((max_batch_size, self.max_blocks_per_row), dtype=np.int64)
        self._capacity = np.zeros(max_batch_size, dtype=np.int64)  # slots each row's blocks hold
        self._live = np.zeros(max_batch_size, dtype=bool)
        self._owner = np.full(num_blocks, _NO_OWNER, dtype=np.int64)
        self._owner[self._scratch_block] = _SCRATCH_OWNER
        self._steps = np.arange(self.MAX_RUN_STEPS + 1, dtype=np.int64).reshape(-1, 1)
        self._run: _Run | None = None
        self._run_steps = block_size  # the next run's length: doubles while runs are used up

    # -- rows ------------------------------------------------------------------------

    @property
    def live_rows(self) -> list[int]:
        return np.flatnonzero(self._live).tolist()

    @property
    def num_free_rows(self) -> int:
        return int(self.max_batch_size - self._live.sum())

    def is_live(self, row: int) -> bool:
        return bool(self._live[self._check_row(row)])

    def allocate_row(self) -> int:
        """Claim the lowest free row (keeps running rows a prefix when rows finish in order)."""
        free = np.flatnonzero(~self._live)
        if not free.size:
            raise RuntimeError(f"all {self.max_batch_size} rows are live; finish or preempt one first")
        row = int(free[0])
        self._live[row] = True
        return row

    def num_tokens(self, row: int) -> int:
        return self.tables[self._check_row(row)].num_tokens

    def adopt_row(self, row: int, table: BlockTable) -> None:
        """Hand `table`'s blocks and tokens to `row` (claiming it), leaving `table` empty.

        The blocks must be allocated from this cache's pool and held by no other row.
        Raises if the row's own table is not empty (reset it first).
        """
        self._check_row(row)
        if table.num_tokens > self.max_model_len or table.num_blocks > self.max_blocks_per_row:
            raise ValueError(f"row {row}: adopted table holds {table.num_tokens} tokens in {table.num_blocks} "
                             f"blocks; max_model_len is {self.max_model_len}")
        if len(set(table.blocks)) != table.num_blocks:
            raise ValueError(f"row {row}: adopted table lists a block twice: {table.blocks}")
        for block in table.blocks:
            if not self.pool.is_used(block) or self._owner[block] != _NO_OWNER:
                owner = "free in the pool" if not self.pool.is_used(block) else f"held by {self._owner_name(block)}"
                raise ValueError(f"row {row}: cannot adopt block {block}: it is {owner}")
        blocks = table.blocks
        self.tables[row].adopt(table)
        self._live[row] = True
        self._owner[list(blocks)] = row
        self._mirror_blocks(row, 0)
        self.slot_table.resync(self.tables[row], row)

    def allocate_prompt(self, row: int, num_tokens: int) -> torch.Tensor:
        """Grow `row` (claiming it if free) by `num_tokens` new tokens; returns their slots [num_tokens].

        Allocates the blocks they need and resyncs the row. Raises ValueError past
        max_model_len and PoolExhaustedError (changing nothing) when blocks run out.
        """
        self._check_row(row)
        table = self.tables[row]
        start = table.num_tokens
        if num_tokens < 1 or start + num_tokens > self.max_model_len:
            raise ValueError(f"row {row}: cannot add {num_tokens} tokens to {start} (max_model_len {self.max_model_len})")
        self._give_blocks(row, self.pool.allocate(table.blocks_needed(num_tokens)))
        self._live[row] = True
        table.advance(num_tokens)
        self.slot_table.resync(table, row)
        positions = np.arange(start, start + num_tokens)
        slots = self.block_ids[row, positions // self.block_size] * self.block_size + positions % self.block_size
        return torch.from_numpy(slots).to(self.device)

    def reset_row(self, row: int) -> None:
        """Give the row's blocks back and set its length to zero; the row stays claimed."""
        blocks = self.tables[self._check_row(row)].clear()
        self.pool.free(blocks)
        self._owner[blocks] = _NO_OWNER
        self._capacity[row] = 0
        self.slot_table.reset(row)

    def free(self, row: int) -> None:
        """Give back the row's blocks and the row itself."""
        self.reset_row(row)
        self._live[row] = False

    def move_row(self, src: int, dst: int) -> None:
        """Move a request from `src` to the empty row `dst` (compaction); `src` ends free."""
        self._check_row(src)
        self._check_row(dst)
        if src == dst or not self._live[src]:
            raise ValueError(f"move_row({src}, {dst}): the source must be a live row other than the destination")
        if not self.tables[dst].is_empty:
            raise ValueError(f"move_row: destination row {dst} still holds {self.num_tokens(dst)} tokens; free it first")
        self.tables[dst].adopt(self.tables[src])
        blocks = list(self.tables[dst].blocks)
        self._owner[blocks] = dst
        self._capacity[dst], self._capacity[src] = self._capacity[src], 0
        self.block_ids[dst] = self.block_ids[src]
        self._live[dst], self._live[src] = True, False
        self.slot_table.resync(self.tables[dst], dst)
        self.slot_table.reset(src)

    # -- admission arithmetic -----------------------------------------------------------

    def blocks_needed(self, num_tokens: int, row: int | None = None) -> int:
        """Blocks to allocate before `num_tokens` more tokens fit in `row` (or in a fresh row)."""
        if row is None:
            return -(-num_tokens // self.block_size)
        return self.tables[self._check_row(row)].blocks_needed(num_tokens)

    def can_allocate(self, num_tokens: int, row: int | None = None) -> bool:
        """Whether the pool has the blocks for `num_tokens` more tokens (length limits aside)."""
        return self.blocks_needed(num_tokens, row) <= self.pool.num_free

    def blocks_to_append(self, rows: RowsLike) -> int:
        """Blocks one more decode step over `rows` would allocate (rows whose blocks are full)."""
        index = self.slot_table.rows(rows).index
        return int(np.count_nonzero(self._counts.array[index] >= self._capacity[index]))

    def can_append(self, rows: RowsLike) -> bool:
        """Whether the pool has a block for every row that needs one to decode one more token."""
        return self.blocks_to_append(rows) <= self.pool.num_free

    # -- the decode step ----------------------------------------------------------------

    def plan_decode(self, rows: RowsLike) -> DecodePlan:
        """Advance every row by one token and address the step.

        Syncs the mirror, grows block tables that are full, appends the write slots to the
        slot table (staged once per run, advanced each step) and takes the plan's
        slot_mapping out of it (`[n, longest context]`).
        Raises PoolExhaustedError (before changing anything) when rows need blocks the
        pool lacks; `can_append` says so beforehand.
        """
        table = self.slot_table
        rows = table.rows(rows)
        run = self._run
        # The run still holds: same rows, and nothing changed the tables, the table or the pool.
        current = (run is not None and run.rows is rows and run.counts_version == self._counts.version
                   and run.table_version == table.version and run.pool_version == self.pool.version)
        if not current or run.step == run.length:
            run = self._run = self._start_run(rows, continued=current)
        else:
            self._counts.steps += 1  # every row's block table holds one more token
            if run.step == run.next_grow:
                self._take_blocks(run)
        k = run.step
        run.step = k + 1
        table.advance(rows)  # this step's write slots were staged when the run began
        return DecodePlan(
            rows=rows.ids,
            slot_mapping=table.rect(rows, run.first_width + k),
            context_lens=run.positions[k + 1],
            write_slots=run.write_slots[k],
            positions=run.positions[k],
            is_window=rows.is_prefix,
        )

    def _start_run(self, rows: Rows, continued: bool) -> _Run:
        """The slow path, once per run: sync the mirror, plan the blocks rows will cross
        into, lay out every step's vectors and stage the run's cells in the slot table.
        `continued`: the last run was over these rows, ran to its end and nothing else changed
        since, so the rows are still live and the table still agrees; such runs also double."""
        index, counts, block_size, table = rows.index, self._counts.array, self.block_size, self.slot_table
        # A prefix is addressed by a slice: numpy views, no fancy-index copies.
        pick = slice(0, rows.n) if rows.is_prefix else index
        if not continued and not self._live[pick].all():
            raise ValueError(f"plan_decode: rows {index[~self._live[index]].tolist()} are not live; "
                             "prefill or adopt them first")
        positions = counts[pick].copy()  # the token each row writes this step
        if not continued:
            table.sync(self.tables, rows, lengths=positions)  # from here the table agrees
        longest = int(positions.max())
        if longest >= self.max_model_len:
            raise ValueError(f"plan_decode: rows {index[positions >= self.max_model_len].tolist()} are at "
                             f"max_model_len={self.max_model_len}; finish them")
        self._run_steps = min(2 * self._run_steps, self.MAX_RUN_STEPS) if continued else block_size
        length = min(self._run_steps, self.max_model_len - longest)
        # Every row's position goes up by one per step: [step, row] arrays for the whole run.
        tokens = positions + self._steps[: length + 1]
        block, offset = np.divmod(tokens[:length], block_size)
        # A row crosses into a block it does not hold where its token starts a block past its
        # capacity; nonzero lists those (step, row) pairs step-major, the order they allocate in.
        steps, at = np.nonzero((offset == 0) & (tokens[:length] >= self._capacity[pick]))
        if len(steps):
            length, grows = self._plan_grows(rows, steps, at, block[steps, at], length)
            tokens, block, offset = tokens[: length + 1], block[:length], offset[:length]
        else:
            grows = []
        counts[pick] = positions + 1
        self._counts.step(pick)
        write_slots = self.block_ids[index, block] * block_size + offset
        table.stage(rows, write_slots)  # every step's cells, one indexed write
        run = _Run(
            rows=rows,
            counts_version=self._counts.version,
            table_version=table.version,
            pool_version=self.pool.version,
            length=length,
            first_width=longest + 1,
            # One view per step, all made by one call: cheaper than slicing every step.
            write_slots=torch.from_numpy(write_slots).to(self.device).unbind(0),
            positions=torch.from_numpy(tokens).to(self.device).unbind(0),
            grows=grows,
            next_grow=grows[-1][0] if grows else -1,
        )
        if run.next_grow == 0:
            self._take_blocks(run)
        return run

    def _plan_grows(self, rows: Rows, steps: np.ndarray, at: np.ndarray, blocks: np.ndarray,
                    length: int) -> tuple[int, list]:
        """Give each crossing (at batch index `at[i]`, step `steps[i]`, into block number
        `blocks[i]` of its row) the id the pool will hand out for it, written ahead into the
        mirror, and group them by step. Cuts the run before the first crossing the pool
        cannot serve; raises PoolExhaustedError when that is the run's first step."""
        free = self.pool.num_free
        if len(steps) > free:
            length = int(steps[free])  # the first crossing left without a block ends the run
            if length == 0:
                short = rows.index[at[steps == 0]].tolist()
                raise PoolExhaustedError(
                    f"rows {short} each need a new block and the pool has {free} free; "
                    "the scheduler should preempt before planning (can_append tells it)")
            steps, at, blocks = steps[:free], at[:free], blocks[:free]
            keep = steps < length
            steps, at, blocks = steps[keep], at[keep], blocks[keep]
            if not len(steps):
                return length, []
        grown = rows.index[at]
        ids = np.asarray(self.pool.peek(len(steps)), dtype=np.int64)
        self.block_ids[grown, blocks] = ids
        starts = np.flatnonzero(steps[1:] != steps[:-1]) + 1
        bounds = [0, *starts.tolist(), len(steps)]
        grows = [(int(steps[a]), grown[a:b], ids[a:b]) for a, b in zip(bounds[-2::-1], bounds[:0:-1])]
        return length, grows

    def _take_blocks(self, run: _Run) -> None:
        """This step's crossings: the rows take the blocks the run planned for them."""
        _, grown, ids = run.grows.pop()
        taken = self.pool.allocate(len(ids))
        if taken != ids.tolist():  # the run checks pool.version every step: a bug, not a race
            raise RuntimeError(f"the pool handed out blocks {taken}, the run planned {ids.tolist()}")
        tables = self.tables
        for row, block in zip(grown.tolist(), taken):
            tables[row].add_blocks((block,))
        self._owner[ids] = grown
        self._capacity[grown] += self.block_size
        run.counts_version = self._counts.version
        run.pool_version = self.pool.version
        run.next_grow = run.grows[-1][0] if run.grows else -1

    # -- K/V -------------------------------------------------------------------------

    def write_kv(self, layer: int, write_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V [n, kv_heads, head_dim] at `write_slots` [n]."""
        self.k_caches[layer].index_copy_(0, write_slots, k)
        self.v_caches[layer].index_copy_(0, write_slots, v)

    # -- helpers -----------------------------------------------------------------------

    def _give_blocks(self, row: int, blocks: list[int]) -> None:
        if not blocks:
            return
        table = self.tables[row]
        first = table.num_blocks
        table.add_blocks(blocks)
        self._owner[blocks] = row
        self._capacity[row] = table.capacity
        self._mirror_blocks(row, first)

    def _mirror_blocks(self, row: int, first: int) -> None:
        """Copy the row's block ids from `first` on into the mirror."""
        blocks = self.tables[row].blocks
        self._capacity[row] = len(blocks) * self.block_size
        self.block_ids[row, first:len(blocks)] = blocks[first:]

    def _owner_name(self, block: int) -> str:
        owner = int(self._owner[block])
        return "the scratch block" if owner == _SCRATCH_OWNER else f"row {owner}"

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.max_batch_size:
            raise ValueError(f"row {row} outside 0..{self.max_batch_size - 1}")
        return row
