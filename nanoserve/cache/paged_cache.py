"""The paged KV cache: K/V tensors, the block pool, one block table per row, and the slot table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.cache.blocks import BlockPool, BlockTable, PoolExhaustedError
from nanoserve.cache.pool_plan import clamp_max_model_len
from nanoserve.cache.prefix_cache import BlockHash, BlockHashes, chain_hashes, root_hash
from nanoserve.slots import RowsLike, SlotTable, is_prefix


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's addressing; good for that step only.

    slot_mapping [n, width]: a window of the slot table when rows are a prefix, else a copy;
        width is the longest context. Live storage: later appends land past each row's length.
    context_lens [n]: lengths counting this step's token, a copy (the staleness gates rely on it);
        total_context is their sum, from the host.
    write_slots [n], positions [n]: where this step's K/V goes, and its position.
    """

    rows: tuple[int, ...]
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    total_context: int
    write_slots: torch.Tensor
    positions: torch.Tensor
    is_window: bool

    @property
    def width(self) -> int:
        return self.slot_mapping.shape[1]


class BatchedPagedKVCache:
    """K/V storage for up to `max_batch_size` rows, addressed through a persistent SlotTable.

    One block is reserved at construction; its first slot is `scratch_slot`, where padded rows
    write and no row reads. `max_model_len` is clamped to the slots the other blocks hold.
    Every operation that fails raises before it changes anything.

    Two layers. The host operations (`claim_prefix`, `grow`, `advance`, `move`, `free`,
    `cache_full_blocks`) change only the pool, the block tables and the lengths, and return
    plain numbers: the scheduler plans a step with them and the runner writes the slot table's
    cells from the plan. The seed's operations (`admit_prefix`, `allocate_prompt`, `plan_decode`,
    `move_row`, `adopt_row`) make the host change and the slot table's write together: the
    standalone cache, as the tests and benchmarks drive it.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 max_batch_size: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", enable_prefix_caching: bool = False,
                 prefix_salt: str = "") -> None:
        if min(num_layers, num_kv_heads, head_dim, max_model_len) < 1:
            raise ValueError(f"cache sizes must be positive: {num_layers} layers, {num_kv_heads} KV heads, "
                             f"head_dim {head_dim}, max_model_len {max_model_len}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the reserved scratch block)")
        self.device = torch.device(device)
        self.block_size, self.max_batch_size = block_size, max_batch_size
        self.pool = BlockPool(num_blocks, block_size)
        self._scratch_block = self.pool.allocate(1)[0]
        self.scratch_slot = self._scratch_block * block_size
        self.max_model_len = clamp_max_model_len(max_model_len, num_blocks, block_size)
        # One tensor per layer: when a compiled graph writes a slice of a stacked tensor in
        # place, inductor copies the whole stack every step.
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.slot_table = SlotTable(max_batch_size, self.max_model_len, self.device)
        lengths = self.slot_table.lengths_array
        self.tables = [BlockTable(block_size, lengths, row) for row in range(max_batch_size)]
        self._claimed = [False] * max_batch_size  # a reset row stays claimed, with no tokens
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = root_hash(prefix_salt)
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens admitted, and of them adopted

    @property
    def live_rows(self) -> list[int]:
        return [row for row, claimed in enumerate(self._claimed) if claimed]

    def num_tokens(self, row: int) -> int:
        """Tokens whose K/V the row holds (adopted or computed): the one count of them."""
        return self.tables[self._row(row)].num_tokens

    def _claim(self, row: int) -> None:
        self._claimed[row] = True

    def _claim_and_sync(self, row: int) -> None:
        self._claim(row)
        self.slot_table.resync(self.tables[row], row)

    def adopt_row(self, row: int, table: BlockTable) -> None:
        """Hand `table`'s blocks and tokens to the empty `row` (claiming it), leaving `table`
        empty. The blocks must come from this pool and be held by no other row."""
        if table.num_tokens > self.max_model_len:
            raise ValueError(f"row {row}: adopted table holds {table.num_tokens} tokens; "
                             f"max_model_len is {self.max_model_len}")
        if len(set(table.blocks)) != table.num_blocks:
            raise ValueError(f"row {row}: adopted table lists a block twice: {table.blocks}")
        holder = {block: f"row {r}" for r, held in enumerate(self.tables) for block in held.blocks}
        holder[self._scratch_block] = "the scratch block"
        for block in table.blocks:
            if block in holder or not (0 <= block < self.pool.num_blocks and self.pool.ref_count(block)):
                owner = f"held by {holder[block]}" if block in holder else "free in the pool"
                raise ValueError(f"row {row}: cannot adopt block {block}: it is {owner}")
        self.tables[self._row(row)].adopt(table)
        self._claim_and_sync(row)

    def grow(self, row: int, num_tokens: int) -> None:
        """Host: grow `row` (claiming it) by `num_tokens` tokens in new blocks. Raises
        ValueError past max_model_len and PoolExhaustedError, changing nothing."""
        table = self.tables[self._row(row)]
        start = table.num_tokens
        if num_tokens < 1 or start + num_tokens > self.max_model_len:
            raise ValueError(f"row {row}: cannot add {num_tokens} tokens to {start} (max_model_len {self.max_model_len})")
        table.add_blocks(self.pool.allocate(table.blocks_needed(num_tokens)))
        table.advance(num_tokens)
        self._claim(row)

    def slots_of(self, row: int, end: int) -> list[int]:
        """Host: the slots of the row's tokens [0, end)."""
        table = self.tables[self._row(row)]
        if not 0 <= end <= table.num_tokens:
            raise ValueError(f"row {row} holds {table.num_tokens} tokens, not {end}")
        return table.slots(end)

    def allocate_prompt(self, row: int, num_tokens: int) -> torch.Tensor:
        """`grow`, and the row's cells written to the slot table; returns the new tokens' slots."""
        start = self.num_tokens(row)
        self.grow(row, num_tokens)
        self.slot_table.resync(self.tables[row], row)
        return self.slot_table.slots[row, start : start + num_tokens].clone()

    def reset_row(self, row: int) -> None:
        """Give the row's blocks back and set its length to zero; the row stays claimed."""
        table = self.tables[self._row(row)]
        self.pool.free(table.blocks[::-1])  # a prefix's tail turns evictable first, so it goes first
        table.clear()  # the length is the slot table's: this resets the row there too

    def free(self, row: int) -> None:
        """Give back the row's blocks and the row itself."""
        self.reset_row(row)
        self._claimed[row] = False

    def move(self, src: int, dst: int) -> None:
        """Host: move a request from `src` to the empty row `dst` (compaction); `src` ends free."""
        if src == dst or not self._claimed[self._row(src)]:
            raise ValueError(f"move_row({src}, {dst}): the source must be a live row other than the destination")
        if not self.tables[self._row(dst)].is_empty:
            raise ValueError(f"move_row: destination row {dst} still holds {self.num_tokens(dst)} tokens; free it first")
        self.tables[dst].adopt(self.tables[src])
        self._claimed[src] = False
        self._claim(dst)

    def move_row(self, src: int, dst: int) -> None:
        """`move`, and the row's cells copied in the slot table."""
        self.move(src, dst)
        self.slot_table.resync(self.tables[dst], dst)

    def blocks_needed(self, num_tokens: int, row: int | None = None) -> int:
        """Blocks to allocate before `num_tokens` more tokens fit in `row` (or in a fresh row)."""
        if row is None:
            return -(-num_tokens // self.block_size)
        return self.tables[self._row(row)].blocks_needed(num_tokens)

    def blocks_to_append(self, rows: RowsLike) -> int:
        """Blocks one more decode step over `rows` would allocate (rows whose blocks are full)."""
        return len(self._full_rows(self.slot_table.row_ids(rows)))

    def can_append(self, rows: RowsLike) -> bool:
        return self.blocks_to_append(rows) <= self.pool.num_free

    def _full_rows(self, ids: list[int]) -> list[int]:
        return [row for row in ids if self.tables[row].num_tokens >= self.tables[row].capacity]

    def advance(self, rows: RowsLike) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Host: advance every row by one token, the full rows taking a block each (in row
        order); returns the row ids, the positions written and the write slots. Raises, changing
        nothing, ValueError for rows not live or at max_model_len and PoolExhaustedError when
        the pool lacks blocks (`can_append` first)."""
        ids = self.slot_table.row_ids(rows)
        idle = [row for row in ids if not self._claimed[row]]
        if idle:
            raise ValueError(f"plan_decode: rows {idle} are not live; prefill or adopt them first")
        positions = self.slot_table.lengths_array[ids]  # the token each row writes this step (a copy)
        lens = positions.tolist()
        at_limit = [row for row, n in zip(ids, lens) if n >= self.max_model_len]
        if at_limit:
            raise ValueError(f"plan_decode: rows {at_limit} are at max_model_len={self.max_model_len}; finish them")
        full = self._full_rows(ids)
        if len(full) > self.pool.num_free:
            raise PoolExhaustedError(f"rows {full} each need a new block and the pool has {self.pool.num_free} "
                                     "free; the scheduler should preempt before planning (can_append tells it)")
        for row, block in zip(full, self.pool.allocate(len(full))):
            self.tables[row].add_blocks((block,))
        write_slots = np.array([self.tables[row].slot(n) for row, n in zip(ids, lens)], dtype=np.int64)
        self.slot_table.lengths_array[ids] = positions + 1  # the block tables' counts
        return ids, positions, write_slots

    def plan_decode(self, rows: RowsLike) -> DecodePlan:
        """`advance`, then address the step: one indexed write puts the write slots in the slot
        table and the slot_mapping is read out of it (raising as `advance` does)."""
        ids, positions, write_slots = self.advance(rows)
        host = np.stack([write_slots, positions, positions + 1])  # write slots, positions, context lengths
        is_window = is_prefix(ids)
        rows = len(ids) if is_window else ids  # a prefix passed by its size: checked once, above
        write_slots_t, positions_t, context_lens = torch.from_numpy(host).to(self.device).unbind()
        self.slot_table.write_cells(rows, positions_t, write_slots_t)
        return DecodePlan(tuple(ids), self.slot_table.rect(rows, int(host[2].max())), context_lens,
                          int(host[2].sum()), write_slots_t, positions_t, is_window)

    # The prefix operations take a sequence's tokens and, optionally, its chain of block hashes
    # (`block_hashes()`, kept with a request); without them the chain is hashed from the tokens.

    def block_hashes(self) -> BlockHashes:
        """An empty hash chain under this cache's root, for one sequence to grow."""
        return BlockHashes(self.block_size, self._root_hash)

    def blocks_to_admit(self, token_ids: Sequence[int], adopt: bool = True,
                        hashes: Sequence[BlockHash] | None = None) -> int:
        """Free blocks a new row holding `token_ids` plus one decode token takes: its blocks,
        less the cached prefix (when it adopts one) that other rows already hold and so are not
        counted free (a cached block no row holds is counted free, so it counts here too)."""
        prefix = self._cached_prefix(token_ids, hashes) if adopt else []
        return self.blocks_needed(len(token_ids) + 1) - sum(self.pool.ref_count(b) > 0 for b in prefix)

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` a new request could adopt now (a pure query)."""
        return len(self._cached_prefix(token_ids)) * self.block_size

    def claim_prefix(self, row: int, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> int:
        """Host: claim the empty `row` and adopt the longest cached prefix of `token_ids` (each
        block gains a holder); returns the tokens adopted (0 with caching off) and counts the
        query. Raises ValueError (changing nothing) when the row holds blocks or tokens."""
        table = self.tables[self._row(row)]
        if not table.is_empty:
            raise ValueError(f"admit_prefix: row {row} still holds {table.num_tokens} tokens in {table.blocks}; "
                             "free or reset it first")
        blocks = self._cached_prefix(token_ids, hashes)
        self.pool.share(blocks)
        table.add_blocks(blocks)
        table.advance(len(blocks) * self.block_size)
        self._claim(row)
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += table.num_tokens
        return table.num_tokens

    def admit_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """`claim_prefix`, and the adopted cells written to the slot table."""
        adopted = self.claim_prefix(row, token_ids)
        self.slot_table.resync(self.tables[row], row)
        return adopted

    def cache_full_blocks(self, row: int, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> list[int]:
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
                raise RuntimeError(f"row {row} block {i} (physical {block}) is cached under another prefix than "
                                   "the tokens given: the engine passed tokens that are not this row's")
        return registered

    def prefix_cache_stats(self) -> dict[str, int]:
        return {"prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                "prefix_cache_blocks": self.pool.num_registered, "prefix_cache_evictions": self.pool.evictions}

    def _cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> list[int]:
        # Whole blocks, at most len(token_ids) - 1 tokens: one is always computed, for the logits.
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = chain_hashes(token_ids[:usable * self.block_size], self.block_size, self._root_hash)
        return self.pool.lookup(hashes[:usable])

    def write_kv(self, layer: int, write_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V [n, kv_heads, head_dim] at `write_slots` [n]."""
        self.k_caches[layer].index_copy_(0, write_slots, k)
        self.v_caches[layer].index_copy_(0, write_slots, v)

    def _row(self, row: int) -> int:
        if not 0 <= row < self.max_batch_size:
            raise ValueError(f"row {row} outside 0..{self.max_batch_size - 1}")
        return row
