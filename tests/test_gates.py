"""Every gate holds on a healthy cache and fails on the fault it guards against."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paired_cache import PairedCache, resync

from compile.slotbench import CellCount, check_appends_incremental
from nanoserve.cache import BlockTable
from nanoserve.cache.gates import GateError, check_table_fits
from nanoserve.worker.gates import (
    check_mapping_is_window,
    check_plan_addressing,
    check_plan_fresh,
    check_slots_agree,
    check_window_intact,
)


def counted_cache() -> tuple[PairedCache, CellCount]:
    cache = PairedCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=40, block_size=4,
                                max_batch_size=4, max_model_len=64)
    count = CellCount(cache.slot_table)
    cache.allocate_prompt(0, 8)
    cache.allocate_prompt(1, 3)
    return cache, count


@pytest.fixture
def cache() -> PairedCache:
    return counted_cache()[0]


def adopt_fresh(cache: PairedCache, row: int, length: int) -> None:
    cache.pool.allocate(2)  # so the new tenant's blocks differ from the ones just given back
    table = BlockTable(cache.block_size)
    table.add_blocks(cache.pool.allocate(table.blocks_needed(length)))
    table.advance(length)
    cache.adopt_row(row, table)


# -- check_slots_agree ---------------------------------------------------------------------


def test_slots_agree_holds_after_decode(cache):
    for _ in range(6):
        cache.plan_decode([0, 1])
    check_slots_agree(cache.slot_table, cache.tables, [0, 1])


def test_slots_agree_names_a_wrong_cell(cache):
    cache.slot_table.slots[1, 2] += 100
    with pytest.raises(GateError, match=r"row 1 col 2: slot table says \d+, block table says \d+"):
        check_slots_agree(cache.slot_table, cache.tables, [0, 1])


def test_slots_agree_names_a_wrong_length(cache):
    # A cache's rows share their lengths with the table; tables of its own can disagree.
    tables = [BlockTable(cache.block_size) for _ in range(2)]
    for table, row in zip(tables, (0, 1)):
        table.add_blocks(cache.tables[row].blocks)
        table.advance(cache.num_tokens(row))
    cache.slot_table.lengths_array[0] = 0
    with pytest.raises(GateError, match=r"row 0: slot table length 0, block table holds 8"):
        check_slots_agree(cache.slot_table, tables, [0, 1])


# -- check_mapping_is_window ---------------------------------------------------------------


def test_mapping_is_window_holds_for_prefix_rows(cache):
    check_mapping_is_window(cache.plan_decode([0, 1]), cache.slot_table)


def test_mapping_is_window_fails_for_scattered_rows_and_names_them(cache):
    cache.allocate_prompt(3, 2)
    plan = cache.plan_decode([0, 3])
    with pytest.raises(GateError, match=r"rows \[0, 3\] reads a gathered copy.*scheduler side"):
        check_mapping_is_window(plan, cache.slot_table)


# -- check_window_intact (a live window against the plan's copies) ----------------------------


def test_window_intact_holds_under_later_appends(cache):
    plan = cache.plan_decode([0, 1])
    for _ in range(5):  # row 1's appends land inside the held window, past its context_len
        cache.plan_decode([0, 1])
    check_window_intact(plan)


def test_window_intact_fails_when_a_retenanted_row_rewrites_a_held_window(cache):
    plan = cache.plan_decode([0, 1])  # row 1: context_len 4, its last real cell is col 3
    cache.reset_row(1)
    adopt_fresh(cache, 1, 5)  # the resync rewrites cols 0..4 of row 1, under the held window
    with pytest.raises(GateError, match=r"row 1 col 3: window now says slot \d+, the plan wrote \d+\n.*engine side"):
        check_window_intact(plan)


def test_window_intact_compares_against_the_plans_copies_not_the_live_table(cache):
    # A gate comparing the window with the block tables cannot fail here: both moved together.
    plan = cache.plan_decode([0, 1])
    cache.reset_row(1)
    adopt_fresh(cache, 1, 5)
    check_slots_agree(cache.slot_table, cache.tables, [0, 1])  # live vs live: agrees
    with pytest.raises(GateError):
        check_window_intact(plan)


# -- the plan's own gates -----------------------------------------------------------------


def test_plan_addressing_holds(cache):
    check_plan_addressing(cache.plan_decode([1, 0]), cache.tables)


def test_plan_addressing_names_a_wrong_cell(cache):
    plan = cache.plan_decode([0, 1])
    wrong = plan.slot_mapping.clone()
    wrong[0, 1] += 1
    with pytest.raises(GateError, match=r"row 0 col 1: mapping says \d+, block table says \d+"):
        check_plan_addressing(dataclasses.replace(plan, slot_mapping=wrong), cache.tables)


def test_plan_addressing_names_a_wrong_write_slot(cache):
    plan = cache.plan_decode([0, 1])
    wrong = plan.write_slots + torch.tensor([0, 1])
    with pytest.raises(GateError, match=r"row 1: writes slot \d+ at position 3, but its last real cell is col 3"):
        check_plan_addressing(dataclasses.replace(plan, write_slots=wrong), cache.tables)


def test_plan_fresh_holds_for_the_current_plan(cache):
    check_plan_fresh(cache.plan_decode([0, 1]), cache.tables)


def test_plan_fresh_fails_for_a_reused_plan(cache):
    plan = cache.plan_decode([0, 1])
    cache.plan_decode([0, 1])
    with pytest.raises(GateError, match=r"row 0: plan says 9 tokens, block table now holds 10"):
        check_plan_fresh(plan, cache.tables)


# -- the slot benchmark's gate ----------------------------------------------------------------


def test_appends_incremental_holds_for_a_decode_run():
    cache, count = counted_cache()
    for _ in range(9):
        cache.plan_decode([0, 1])
    check_appends_incremental(count, rows=2, steps=9)


def test_appends_incremental_fails_when_a_row_is_rebuilt_mid_run():
    cache, count = counted_cache()
    cache.plan_decode([0, 1])
    resync(cache.slot_table, cache.tables[1], 1)  # a row rebuilt instead of appended to
    cache.plan_decode([0, 1])
    with pytest.raises(GateError, match=r"appended 4 cells with 3 resyncs; an incremental table appends exactly 4 "
                                        r"with 2"):
        check_appends_incremental(count, rows=2, steps=2)


# -- check_table_fits ----------------------------------------------------------------------


def test_table_fits_when_planned_around_the_pool():
    check_table_fits(max_batch_size=8, max_model_len=2048, block_size=16, kv_bytes=1 << 30)


def test_table_fits_fails_and_prints_the_block_table_alternative():
    # 256 rows at 131,072 tokens is 268 MB of addressing.
    with pytest.raises(GateError, match=r"reserves 268,435,456 bytes.*would be 16,777,216 bytes \(16x smaller"):
        check_table_fits(max_batch_size=256, max_model_len=131072, block_size=16, kv_bytes=1 << 30)
