"""The seed's standalone cache for the tests: the host's BlockManager and the worker's KVCache
driven together, each operation making its host change and then applying it to the device
through the operation a step plan drives there (`adopt`, `move`, `free`, `plan_decode`), as an
engine step does. Only tests use this pairing; the engine splits it between its scheduler and
its worker."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.blocks import BlockTable
from nanoserve.worker.kv_cache import DecodePlan, KVCache
from nanoserve.worker.plan import DecodeBatch
from nanoserve.worker.slot_table import RowsLike, SlotTable, rebuild_mapping


class PairedCache:
    """K/V storage for up to `max_batch_size` rows with its block manager (the seed's one
    cache object): the host operations are the manager's, and the seed's operations
    (`admit_prefix`, `allocate_prompt`, `plan_decode`, `move_row`, `adopt_row`, `reset_row`,
    `free`) make the host change and apply it to the device cache."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 max_batch_size: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", enable_prefix_caching: bool = False,
                 prefix_salt: str = "") -> None:
        if min(num_layers, num_kv_heads, head_dim, max_model_len) < 1:
            raise ValueError(f"cache sizes must be positive: {num_layers} layers, {num_kv_heads} KV heads, "
                             f"head_dim {head_dim}, max_model_len {max_model_len}")
        self.blocks = BlockManager(num_blocks, block_size, max_batch_size, max_model_len,
                                   enable_prefix_caching=enable_prefix_caching, prefix_salt=prefix_salt)
        self.kv = KVCache(num_layers, num_kv_heads, head_dim, num_blocks, block_size, max_batch_size,
                          self.blocks.max_model_len, self.blocks.scratch_slot, dtype=dtype, device=device)

    # The host's state and queries, and the device's tensors, read through.
    def __getattr__(self, name: str):
        for side in ("blocks", "kv"):
            owner = self.__dict__.get(side)
            if owner is not None and hasattr(owner, name):
                return getattr(owner, name)
        raise AttributeError(name)

    def prefix_cache_stats(self) -> dict[str, int]:
        b = self.blocks
        return {"prefix_cache_queries": b.prefix_queries, "prefix_cache_hits": b.prefix_hits,
                "prefix_cache_blocks": b.pool.num_registered, "prefix_cache_evictions": b.pool.evictions}

    def _adopt(self, row: int) -> None:
        slots = self.blocks.slots_of(row, self.blocks.num_tokens(row))
        self.kv.adopt(row, torch.tensor(slots, dtype=torch.long, device=self.kv.device))

    def admit_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        adopted = self.blocks.claim_prefix(row, token_ids)
        self._adopt(row)
        return adopted

    def allocate_prompt(self, row: int, num_tokens: int) -> torch.Tensor:
        """Grow the row and adopt its cells; returns the new tokens' slots."""
        start = self.blocks.num_tokens(row)
        self.blocks.grow(row, num_tokens)
        self._adopt(row)
        return self.kv.slot_table.slots[row, start:start + num_tokens].clone()

    def plan_decode(self, rows: RowsLike) -> DecodePlan:
        """Advance the rows on the host and address their step on the device (raising as
        `BlockManager.advance` does); the rectangle is as wide as the longest context."""
        ids = self.kv.slot_table.row_ids(rows)
        positions, slots = self.blocks.advance(ids)
        n = len(ids)
        batch = DecodeBatch(("",) * n, tuple(ids), (0,) * n, tuple(positions), tuple(slots), n, max(positions) + 1)
        return self.kv.plan_decode(batch)

    def move_row(self, src: int, dst: int) -> None:
        length = self.blocks.num_tokens(src)
        self.blocks.move(src, dst)
        self.kv.move(src, dst, length)

    def adopt_row(self, row: int, table: BlockTable) -> None:
        """Hand `table`'s blocks and tokens to the empty `row` (claiming it), leaving `table`
        empty. The blocks must come from this pool and be held by no other row."""
        blocks = self.blocks
        if table.num_tokens > blocks.max_model_len:
            raise ValueError(f"adopt_row: row {row}: the table holds {table.num_tokens} tokens; "
                             f"max_model_len is {blocks.max_model_len}")
        if len(set(table.blocks)) != table.num_blocks:
            raise ValueError(f"adopt_row: row {row}: the table lists a block twice: {table.blocks}")
        holder = {block: f"row {r}" for r, held in enumerate(blocks.tables) for block in held.blocks}
        holder[blocks.scratch_block] = "the scratch block"
        for block in table.blocks:
            if block in holder or not (0 <= block < blocks.pool.num_blocks and blocks.pool.ref_count(block)):
                owner = f"held by {holder[block]}" if block in holder else "free in the pool"
                raise ValueError(f"adopt_row: row {row} cannot adopt block {block}: it is {owner}")
        blocks.claim_prefix(row, [])  # claims the empty row (raising if it is not), adopting nothing
        blocks.tables[row].adopt(table)
        self._adopt(row)

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` a new request could adopt now (a pure query)."""
        return len(self.blocks.cached_prefix(token_ids)) * self.blocks.block_size

    def reset_row(self, row: int) -> None:
        self.blocks.reset_row(row)
        self.kv.free(row)

    def free(self, row: int) -> None:
        self.blocks.free(row)
        self.kv.free(row)


def resync(slot_table: SlotTable, table: BlockTable, row: int) -> None:
    """Rebuild one row of the slot table from its block table (the oracle, cell by cell)."""
    slot_table.adopt(row, rebuild_mapping([table], [0], device=slot_table.device)[0])


def sync(slot_table: SlotTable, tables: Sequence[BlockTable], rows: RowsLike) -> list[int]:
    """Resync every listed row whose length is not its table's; returns those rows."""
    stale = [row for row in slot_table.row_ids(rows) if slot_table.lengths_array[row] != tables[row].num_tokens]
    for row in stale:
        resync(slot_table, tables[row], row)
    return stale
