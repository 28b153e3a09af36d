"""The gates the engine runs on every step under NANOSERVE_CHECKS=1 (README: debug runs): the
plan against the block manager before the worker applies it, and the worker's addressing and
slot table against the block tables after. Each raises GateError naming the rows at fault."""

from __future__ import annotations

from collections import Counter

from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.gates import check_pool_agrees, fail_if
from nanoserve.worker.gates import check_plan_addressing, check_plan_fresh
from nanoserve.worker.plan import StepPlan
from nanoserve.worker.worker import StepOutput, Worker


def check_plan_against_blocks(plan: StepPlan, blocks: BlockManager) -> None:
    """Every slot the plan addresses is its row's block table's, a decode row writes its last
    token, no two writes share a slot, and every written block is held (not free in the pool)."""
    tables, pool, faults, written = blocks.tables, blocks.pool, [], []
    if plan.decode is not None:
        batch = plan.decode
        for i, (row, position) in enumerate(zip(batch.row_ids, batch.positions)):
            table, slots = tables[row], batch.row_slots(i)  # the fed token's, then its proposals'
            last = position + len(slots) - 1
            if last != table.num_tokens - 1 or any(
                    slot != table.slot(position + j) for j, slot in enumerate(slots) if position + j < table.capacity):
                held = [table.slot(p) if p < table.capacity else "none" for p in range(position, last + 1)]
                wrote, where, put = ((f"slot {slots[0]}", f"position {position}", f"position {position} at slot {held[0]}")
                                     if len(slots) == 1 else (f"slots {list(slots)}", f"positions {position}..{last}",
                                                              f"those positions at {held}"))
                faults.append(f"decode row {row}: writes {wrote} at {where}; its block table holds {table.num_tokens} "
                              f"tokens and puts {put}")
            written += [(row, slot) for slot in slots]
    for chunk in plan.prefill:
        table = tables[chunk.row]
        if chunk.end > table.num_tokens or list(chunk.slots) != table.slots(chunk.end):
            faults.append(f"prefill row {chunk.row}: the chunk's slots for tokens [0, {chunk.end}) are not its "
                          f"block table's ({table.num_tokens} tokens in blocks {table.blocks})")
        written += [(chunk.row, slot) for slot in chunk.write_slots]
    twice = [slot for slot, count in Counter(slot for _, slot in written).items() if count > 1]
    if twice:
        faults.append(f"slots {sorted(twice)[:8]} are written twice in one step (a block handed out twice)")
    free = sorted({(row, slot // blocks.block_size) for row, slot in written
                   if not pool.ref_count(slot // blocks.block_size)})
    faults += [f"row {row} writes into block {block}, which is free in the pool" for row, block in free]
    fail_if(faults, "the step plan disagrees with the block manager (scheduler side):")


def check_step(plan: StepPlan, blocks: BlockManager) -> None:
    """Before the worker runs a plan: the pool agrees with the tables, the plan with both."""
    check_pool_agrees(blocks)
    check_plan_against_blocks(plan, blocks)


def check_applied(result: StepOutput, worker: Worker, blocks: BlockManager) -> None:
    """After the worker ran a plan: the decode rows' addressing is their block tables' and
    fresh, and the slot table equals the block tables on every live row."""
    if result.decode is not None:
        check_plan_addressing(result.decode, blocks.tables)
        check_plan_fresh(result.decode, blocks.tables)
    rows = blocks.live_rows
    if rows:
        worker.check_slots(blocks.tables, rows)
