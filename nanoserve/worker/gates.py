"""Gates of the device side: invariants of the slot table and a decode step's addressing,
checked at run time. The worker applies the capture gate (`check_mapping_is_window`) before
every compiled decode step, and under NANOSERVE_CHECKS=1 `check_decode_follows` and
`check_window_intact` on every plan; the engine then pits the slot table against the host's
block tables (`check_slots_agree`); the tests and `compile/slotbench.py` apply them after the
operations they drive.

Each `check_*` returns None when its invariant holds and raises GateError naming the rows,
columns or slots at fault and which side owns the fix. A gate comparing live state with live
state cannot fail, so the window gates compare against the plan's own copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.cache.blocks import BlockTable
from nanoserve.cache.gates import GateError, fail_if
from nanoserve.worker.kv_cache import DecodePlan
from nanoserve.worker.plan import DecodeBatch
from nanoserve.worker.slot_table import SlotTable, rebuild_mapping

__all__ = ["GateError", "check_decode_follows", "check_mapping_is_window", "check_plan_addressing",
           "check_plan_fresh", "check_slots_agree", "check_window_intact"]


def check_slots_agree(slot_table: SlotTable, tables: Sequence[BlockTable], rows: Sequence[int]) -> None:
    """Every listed row of the slot table equals rebuild_mapping: same length, same slot in every cell."""
    rows = list(rows)
    expected = rebuild_mapping(tables, rows).cpu()
    held = slot_table.slots[rows, : expected.shape[1]].cpu()
    faults = []
    for i, row in enumerate(rows):
        want, have = tables[row].num_tokens, int(slot_table.lengths_array[row])
        wrong = (held[i, :want] != expected[i, :want]).nonzero().flatten().tolist()
        if have != want:
            faults.append(f"row {row}: slot table length {have}, block table holds {want}")
        elif wrong:
            faults.append(f"row {row} col {wrong[0]}: slot table says {int(held[i, wrong[0]])}, block table "
                          f"says {int(expected[i, wrong[0]])} ({len(wrong)} cells differ)")
    fail_if(faults, "slot table disagrees with the block tables (worker side: a plan's row change was not "
            "applied, or scheduler side: a table changed that no plan told the worker of):")


def check_mapping_is_window(plan: DecodePlan, slot_table: SlotTable) -> None:
    """The plan's slot_mapping is a view of the table's buffer (a capture gate, not a correctness gate)."""
    mapping, buffer = plan.slot_mapping, slot_table.slots
    same_storage = mapping.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    if not (same_storage and mapping.storage_offset() == 0 and mapping.stride(0) == buffer.stride(0)):
        raise GateError(
            f"plan over rows {list(plan.rows)} reads a gathered copy, not a window of the slot table: a captured "
            f"graph replays the addresses it recorded, so its rows must be the prefix 0..{len(plan.rows) - 1}. "
            "Fix on the scheduler side: admit into the lowest free row and compact (move) when a row "
            "in the middle finishes.")


def check_window_intact(plan: DecodePlan) -> None:
    """Each row's last real cell in the (live) window still holds the slot the plan wrote there."""
    if plan.slot_mapping.shape[1] == 0:
        return
    lens = plan.context_lens
    last = plan.slot_mapping.gather(1, (lens - 1).clamp(min=0).view(-1, 1)).view(-1)
    bad = ((lens > 0) & (last != plan.write_slots)).nonzero().flatten().tolist()
    lens, last, written = lens.tolist(), last.tolist(), plan.write_slots.tolist()
    fail_if([f"row {plan.rows[i]} col {lens[i] - 1}: window now says slot {last[i]}, the plan wrote {written[i]}"
              for i in bad], "a held window was rewritten under its plan:",
            "\nA row was reset or re-tenanted while a plan over it was still in use. Fix on the engine side: "
            "finish the step before free / adopt / move on its rows.")


def check_plan_addressing(plan: DecodePlan, tables: Sequence[BlockTable]) -> None:
    """Each row's cells are its block table's slots, and the write slot is its last real cell."""
    lens, mapping = plan.context_lens.tolist(), plan.slot_mapping.cpu().tolist()
    written, positions = plan.write_slots.tolist(), plan.positions.tolist()
    faults = []
    for i, row in enumerate(plan.rows):
        n, table = lens[i], tables[row]
        if not 1 <= n <= min(len(mapping[i]), table.num_tokens):
            faults.append(f"row {row}: context_len {n} outside the rectangle ({len(mapping[i])} wide) "
                          f"or the table ({table.num_tokens} tokens)")
            continue
        wrong = [t for t in range(n) if mapping[i][t] != table.slot(t)]
        if wrong:
            faults.append(f"row {row} col {wrong[0]}: mapping says {mapping[i][wrong[0]]}, "
                          f"block table says {table.slot(wrong[0])}")
        if written[i] != mapping[i][n - 1] or positions[i] != n - 1:
            faults.append(f"row {row}: writes slot {written[i]} at position {positions[i]}, but its last real "
                          f"cell is col {n - 1} = slot {mapping[i][n - 1]}")
    fail_if(faults, "plan addressing is wrong (scheduler side: advance, or worker side: plan_decode):")


def check_plan_fresh(plan: DecodePlan, tables: Sequence[BlockTable]) -> None:
    """The plan's context_lens (a copy) still match the block tables."""
    lens = plan.context_lens.tolist()
    fail_if([f"row {row}: plan says {lens[i]} tokens, block table now holds {tables[row].num_tokens}"
              for i, row in enumerate(plan.rows) if lens[i] != tables[row].num_tokens], "plan is stale:",
            "\nA plan is good for the one step it was made for. Fix on the engine side: call plan_decode "
            "again instead of reusing a plan.")


def check_decode_follows(batch: DecodeBatch, slot_table: SlotTable) -> None:
    """Each decode row writes at the length the worker last applied to it: position p means the
    row holds tokens [0, p). A plan made against other lengths addresses a stale slot."""
    held = slot_table.lengths_array
    fail_if([f"row {row}: the plan writes position {p}, the worker's slot table holds {int(held[row])} tokens"
             for row, p in zip(batch.row_ids, batch.positions) if held[row] != p],
            "plan_decode: the decode rows do not follow the slot table (a stale plan, or a row change the "
            "plan left out):", "\nFix on the scheduler side: every plan lists the frees and moves since the last.")
