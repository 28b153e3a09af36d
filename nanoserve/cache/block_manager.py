"""The host side of the paged KV cache: the block pool, one block table per row, the rows'
claims and the prefix cache's names. Plain numbers only; the scheduler is its one writer, and
the worker learns of every change from the step plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.cache.blocks import BlockPool, BlockTable, PoolExhaustedError
from nanoserve.cache.pool_plan import clamp_max_model_len
from nanoserve.cache.prefix_cache import BlockHash, BlockHashes, chain_hashes, root_hash
from nanoserve.cache.ring_snapshots import RingSnapshots

SCRATCH_BLOCK = 0  # the block a manager reserves: a fresh pool's first allocation


class BlockManager:
    """Blocks for up to `max_batch_size` rows. One block is reserved at construction (the null
    block); its first slot is `scratch_slot`, where padded decode rows write and no row reads.
    `max_model_len` is clamped to the slots the other blocks hold. Every operation that fails
    raises before it changes anything, naming itself."""

    def __init__(self, num_blocks: int, block_size: int, max_batch_size: int, max_model_len: int,
                 enable_prefix_caching: bool = False, prefix_salt: str = "", ring_snapshots: int | None = None) -> None:
        if max_model_len < 1 or max_batch_size < 1:
            raise ValueError(f"block manager sizes must be positive: {max_batch_size} rows, "
                             f"max_model_len {max_model_len}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the reserved scratch block)")
        self.block_size, self.max_batch_size = block_size, max_batch_size
        self.pool = BlockPool(num_blocks, block_size)
        self.scratch_block = self.pool.allocate(1)[0]
        if self.scratch_block != SCRATCH_BLOCK:  # the worker is built knowing it
            raise RuntimeError(f"the pool reserved block {self.scratch_block}, not block {SCRATCH_BLOCK}")
        self.scratch_slot = self.scratch_block * block_size
        self.max_model_len = clamp_max_model_len(max_model_len, num_blocks, block_size)
        self.tables = [BlockTable(block_size) for _ in range(max_batch_size)]
        self._claimed = [False] * max_batch_size  # a reset row stays claimed, with no tokens
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = root_hash(prefix_salt)
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens admitted, and of them adopted
        # With sliding-window rings and prefix caching: the rings' saved states (``ring_snapshots``
        # of them), which bound what a row may adopt; None where the window layers keep the pool's cells.
        self.snapshots = RingSnapshots(ring_snapshots) if ring_snapshots is not None and enable_prefix_caching \
            else None

    @property
    def live_rows(self) -> list[int]:
        return [row for row, claimed in enumerate(self._claimed) if claimed]

    def num_tokens(self, row: int) -> int:
        """Tokens whose K/V the row holds (adopted or computed): the one count of them."""
        return self.tables[self._row(row)].num_tokens

    def grow(self, row: int, num_tokens: int) -> None:
        """Grow `row` (claiming it) by `num_tokens` tokens in new blocks. Raises ValueError
        past max_model_len and PoolExhaustedError, changing nothing."""
        table = self.tables[self._row(row)]
        start = table.num_tokens
        if num_tokens < 1 or start + num_tokens > self.max_model_len:
            raise ValueError(f"grow: row {row} cannot add {num_tokens} tokens to {start} "
                             f"(max_model_len {self.max_model_len})")
        table.add_blocks(self.pool.allocate(table.blocks_needed(num_tokens)))
        table.advance(num_tokens)
        self._claimed[row] = True

    def slots_of(self, row: int, end: int, start: int = 0) -> list[int]:
        """The slots of the row's tokens [start, end)."""
        table = self.tables[self._row(row)]
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"slots_of: row {row} holds {table.num_tokens} tokens, not [{start}, {end})")
        return table.slots(end, start)

    def reset_row(self, row: int) -> None:
        """Give the row's blocks back and set its length to zero; the row stays claimed."""
        table = self.tables[self._row(row)]
        self.pool.free(table.blocks[::-1])  # a prefix's tail turns evictable first, so it goes first
        table.clear()

    def free(self, row: int) -> None:
        """Give back the row's blocks and the row itself."""
        self.reset_row(row)
        self._claimed[row] = False

    def move(self, src: int, dst: int) -> None:
        """Move a request from `src` to the empty row `dst` (compaction); `src` ends free."""
        if src == dst or not self._claimed[self._row(src)]:
            raise ValueError(f"move({src}, {dst}): the source must be a live row other than the destination")
        if not self.tables[self._row(dst)].is_empty:
            raise ValueError(f"move({src}, {dst}): destination row {dst} still holds {self.num_tokens(dst)} "
                             "tokens; free it first")
        self.tables[dst].adopt(self.tables[src])
        self._claimed[src] = False
        self._claimed[dst] = True

    def blocks_needed(self, num_tokens: int, row: int | None = None) -> int:
        """Blocks to allocate before `num_tokens` more tokens fit in `row` (or in a fresh row)."""
        if row is None:
            return -(-num_tokens // self.block_size)
        return self.tables[self._row(row)].blocks_needed(num_tokens)

    def blocks_to_append(self, rows: Sequence[int]) -> int:
        """Blocks one more decode step over `rows` would allocate (their full rows)."""
        return sum(self.tables[row].num_tokens >= self.tables[row].capacity for row in self._rows(rows, "blocks_to_append"))

    def can_append(self, rows: Sequence[int]) -> bool:
        return self.blocks_to_append(rows) <= self.pool.num_free

    def advance(self, rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """Advance each of `rows` by one token, the full rows taking a block each (in row order);
        returns the positions written and their slots. Raises, changing nothing, ValueError for
        rows not live or at max_model_len and PoolExhaustedError when the pool lacks blocks
        (`can_append` first)."""
        rows = self._rows(rows, "advance")
        tables = [self.tables[row] for row in rows]
        positions = [table.num_tokens for table in tables]  # the token each row writes this step
        limit, claimed = self.max_model_len, self._claimed
        if not all(claimed[row] and n < limit for row, n in zip(rows, positions)):
            idle = [row for row in rows if not claimed[row]]
            if idle:
                raise ValueError(f"advance: rows {idle} are not live; prefill or adopt them first")
            at_limit = [row for row, n in zip(rows, positions) if n >= limit]
            raise ValueError(f"advance: rows {at_limit} are at max_model_len={limit}; finish them")
        full = [row for row, table, n in zip(rows, tables, positions) if n >= table.capacity]
        if len(full) > self.pool.num_free:
            raise PoolExhaustedError(f"advance: rows {full} each need a new block and the pool has "
                                     f"{self.pool.num_free} free; the scheduler should preempt first (can_append)")
        for row, block in zip(full, self.pool.allocate(len(full))):
            self.tables[row].add_blocks((block,))
        slots = []
        for table, n in zip(tables, positions):
            slots.append(table.slot(n))
            table.num_tokens = n + 1
        return positions, slots

    def extend(self, row: int, num_tokens: int) -> list[int] | None:
        """Grow the live `row` by `num_tokens` speculative tokens if the pool and max_model_len
        allow, returning their slots; None (changing nothing) if they do not fit."""
        table = self.tables[self._row(row)]
        start = table.num_tokens
        if num_tokens < 1 or start + num_tokens > self.max_model_len \
                or table.blocks_needed(num_tokens) > self.pool.num_free:
            return None
        table.add_blocks(self.pool.allocate(table.blocks_needed(num_tokens)))
        table.advance(num_tokens)
        return [table.slot(t) for t in range(start, start + num_tokens)]

    def truncate(self, row: int, num_tokens: int) -> None:
        """The row keeps its first `num_tokens` tokens (a verify step's rejected tokens go); the
        blocks past them go back to the pool. Those blocks held only speculative tokens, which
        are never registered in the prefix cache."""
        self.pool.free(self.tables[self._row(row)].truncate(num_tokens)[::-1])

    # The prefix operations take a sequence's tokens and, optionally, its chain of block hashes
    # (`block_hashes()`, kept with a request); without them the chain is hashed from the tokens.

    def block_hashes(self) -> BlockHashes:
        """An empty hash chain under this manager's root, for one sequence to grow."""
        return BlockHashes(self.block_size, self._root_hash)

    def blocks_to_admit(self, token_ids: Sequence[int], adopt: bool = True,
                        hashes: Sequence[BlockHash] | None = None) -> int:
        """Free blocks a new row holding `token_ids` plus one decode token takes: its blocks,
        less the cached prefix (when it adopts one) that other rows already hold and so are not
        counted free (a cached block no row holds is counted free, so it counts here too)."""
        prefix = self.cached_prefix(token_ids, hashes) if adopt else []
        return self.blocks_needed(len(token_ids) + 1) - sum(self.pool.ref_count(b) > 0 for b in prefix)

    def claim_prefix(self, row: int, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> int:
        """Claim the empty `row` and adopt the longest cached prefix of `token_ids` (each block
        gains a holder); returns the tokens adopted (0 with caching off) and counts the query.
        Raises ValueError (changing nothing) when the row holds blocks or tokens."""
        table = self.tables[self._row(row)]
        if not table.is_empty:
            raise ValueError(f"claim_prefix: row {row} still holds {table.num_tokens} tokens in {table.blocks}; "
                             "free or reset it first")
        blocks = self.cached_prefix(token_ids, hashes)
        self.pool.share(blocks)
        table.add_blocks(blocks)
        table.advance(len(blocks) * self.block_size)
        self._claimed[row] = True
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += table.num_tokens
        return table.num_tokens

    def cache_full_blocks(self, row: int, token_ids: Sequence[int],
                          hashes: Sequence[BlockHash] | None = None) -> list[int]:
        """Register the row's full blocks among its first len(token_ids) tokens under their prefix hashes
        (K/V written, or written by this step's forward before any read); a hash that already names a block
        keeps it. Returns the blocks newly registered (none with caching off). Raises if the row holds fewer
        tokens, or a registered block disagrees."""
        if not self.enable_prefix_caching:
            return []
        table = self.tables[self._row(row)]
        if len(token_ids) > table.num_tokens:
            raise ValueError(f"cache_full_blocks: row {row} holds {table.num_tokens} tokens, not {len(token_ids)}")
        full = len(token_ids) // self.block_size
        hashes = chain_hashes(token_ids, self.block_size, self._root_hash) if hashes is None else hashes[:full]
        registered = []
        for i, (block, block_hash) in enumerate(zip(table.blocks, hashes)):
            known = self.pool.hash_of(block)
            if known is None:
                if self.pool.register(block, block_hash):
                    registered.append(block)
            elif known != block_hash:
                raise RuntimeError(f"cache_full_blocks: row {row} block {i} (physical {block}) is cached under "
                                   "another prefix than the tokens given: the engine passed tokens that are not "
                                   "this row's")
        return registered

    def cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> list[int]:
        """The blocks of the longest cached prefix of `token_ids` a new row would adopt (a pure
        query): whole blocks, at most len(token_ids) - 1 tokens, since one is always computed
        for the logits. None with caching off."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = chain_hashes(token_ids[:usable * self.block_size], self.block_size, self._root_hash)
        blocks = self.pool.lookup(hashes[:usable])
        if self.snapshots is not None:  # the window layers' last positions must come back too
            blocks = blocks[:self.snapshots.longest(list(hashes[:len(blocks)]))]
        return blocks

    def ring_to_restore(self, hashes: Sequence[BlockHash], adopted: int) -> int | None:
        """The ring snapshot a row that adopted ``adopted`` tokens of a prefix restores (None when
        rings are not snapshotted or it adopted nothing)."""
        if self.snapshots is None or not adopted:
            return None
        return self.snapshots.restore(hashes[adopted // self.block_size - 1])

    def ring_to_save(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, int] | None:
        """Where a row holding ``num_tokens`` tokens saves its rings: (the snapshot slot, the
        block boundary it stands for), or None (no snapshots, no full block, or already saved)."""
        blocks = num_tokens // self.block_size
        if self.snapshots is None or not blocks:
            return None
        slot = self.snapshots.take(hashes[blocks - 1])
        return None if slot is None else (slot, blocks * self.block_size)

    def _rows(self, rows: Sequence[int], operation: str) -> Sequence[int]:
        if isinstance(rows, range) and rows.start == 0 and rows.step == 1 and 0 < rows.stop <= self.max_batch_size:
            return rows  # the decode rows' prefix, checked at a glance
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.max_batch_size for r in rows):
            raise ValueError(f"{operation}: rows {list(rows)} must be a non-empty set of distinct ids in "
                             f"0..{self.max_batch_size - 1}")
        return rows

    def _row(self, row: int) -> int:
        if not 0 <= row < self.max_batch_size:
            raise ValueError(f"row {row} outside 0..{self.max_batch_size - 1}")
        return row
