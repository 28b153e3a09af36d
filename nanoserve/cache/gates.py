"""Gates of the host side: invariants of the block manager, checked at run time (on the engine
path under NANOSERVE_CHECKS=1, and by the tests after the operations they drive).

Each `check_*` returns None when its invariant holds and raises GateError naming the rows or
blocks at fault and which side owns the fix. The device side's gates are nanoserve.worker.gates.
"""

from __future__ import annotations

from collections import Counter

from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.pool_plan import block_table_bytes, resident_share, table_bytes


class GateError(AssertionError):
    """An addressing invariant does not hold."""


def fail_if(faults: list[str], why: str, fix: str = "") -> None:
    """Raise GateError listing the first faults (none: return)."""
    if faults:
        more = f"\n  ... and {len(faults) - 8} more" if len(faults) > 8 else ""
        raise GateError(why + "\n  " + "\n  ".join(faults[:8]) + more + fix)


def check_pool_agrees(manager: BlockManager) -> None:
    """Every block's reference count is the number of rows holding it (the scratch block: one),
    and no row lists a block twice: a block freed while a row still holds it, or freed twice,
    would be handed out again under that row's K/V."""
    holders = Counter(block for table in manager.tables for block in table.blocks)
    holders[manager.scratch_block] += 1
    pool = manager.pool
    faults = []
    for block in range(pool.num_blocks):
        refs, held = pool.ref_count(block), holders.get(block, 0)
        if refs != held:
            rows = [row for row, table in enumerate(manager.tables) if block in table.blocks]
            state = "free in the pool" if refs == 0 else f"counted {refs} times"
            faults.append(f"block {block}: {state}, but held by rows {rows}" if rows else
                          f"block {block}: {state}, held by no row")
    for row, table in enumerate(manager.tables):
        if len(set(table.blocks)) != table.num_blocks:
            faults.append(f"row {row} lists a block twice: {table.blocks}")
    fail_if(faults, "the pool disagrees with the block tables (scheduler side: a block freed while held, "
            "freed twice, or shared without a reference):")


def check_table_fits(max_batch_size: int, max_model_len: int, block_size: int, kv_bytes: int,
                     max_share: float = 0.10) -> None:
    """The slot table's reservation is at most `max_share` of the cache's resident memory."""
    share = resident_share(max_batch_size, max_model_len, kv_bytes)
    if share > max_share:
        raise GateError(
            f"slot table [{max_batch_size}, {max_model_len}] int64 reserves "
            f"{table_bytes(max_batch_size, max_model_len):,} bytes, {share:.1%} of resident cache memory (limit "
            f"{max_share:.0%}, K/V is {kv_bytes:,} bytes). A block-id table [{max_batch_size}, "
            f"{-(-max_model_len // block_size)}] would be {block_table_bytes(max_batch_size, max_model_len, block_size):,}"
            f" bytes ({block_size}x smaller, with the multiply moved into the kernel). Fix on the launch side: pass "
            "the max_model_len the pool was planned around (PoolPlan.max_model_len), or lower max_batch_size.")
