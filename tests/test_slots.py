"""SlotTable, rebuild_mapping and the cache's decode step, one behaviour per test."""

from __future__ import annotations

import pytest
import torch
from paired_cache import PairedCache, resync, sync
from slot_table_support import append, is_window, lengths, read

from compile.slotbench import CellCount
from nanoserve.cache import BlockTable, PoolExhaustedError
from nanoserve.worker.gates import check_plan_addressing, check_slots_agree
from nanoserve.worker.slot_table import SlotTable, rebuild_mapping


def table_of(blocks, num_tokens, block_size=4) -> BlockTable:
    table = BlockTable(block_size)
    table.add_blocks(blocks)
    table.advance(num_tokens)
    return table


def small_cache(device="cpu", **overrides) -> PairedCache:
    options = dict(num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=32, block_size=4,
                   max_batch_size=4, max_model_len=64, device=device)
    options.update(overrides)
    return PairedCache(**options)


# -- rebuild_mapping -----------------------------------------------------------------------


def test_rebuild_mapping_is_every_slot_zero_padded():
    tables = [table_of([5, 1], 6), table_of([2], 3)]
    mapping = rebuild_mapping(tables, [0, 1])
    assert mapping.tolist() == [[20, 21, 22, 23, 4, 5], [8, 9, 10, 0, 0, 0]]


def test_rebuild_mapping_width_narrower_than_a_row_raises():
    with pytest.raises(ValueError, match="narrower than row lengths"):
        rebuild_mapping([table_of([0], 3)], [0], width=2)


def test_rebuild_mapping_of_empty_rows_is_zero_wide():
    assert rebuild_mapping([BlockTable(4)], [0]).shape == (1, 0)


# -- SlotTable -----------------------------------------------------------------------------


def test_append_and_read(device):
    table = SlotTable(4, 8, device)
    resync(table, table_of([1], 3), 2)
    append(table, [0, 2], torch.tensor([11, 12], device=device))
    append(table, [0, 1, 2], torch.tensor([13, 14, 15], device=device))
    rect, lens = read(table, [0, 1, 2], 5)
    assert rect[:, :5].tolist() == [[11, 13, 0, 0, 0], [14, 0, 0, 0, 0], [4, 5, 6, 12, 15]]
    assert lens.tolist() == [2, 1, 5] and lengths(table, [0, 1, 2]).tolist() == [2, 1, 5]
    with pytest.raises(ValueError, match=r"rows \[2\] already hold"):
        for _ in range(4):
            append(table, [2], torch.tensor([0]))


def test_table_allocates_once_on_device(device):
    table = SlotTable(4, 16, device)
    assert table.slots.shape == (4, 16) and table.slots.dtype == torch.int64
    assert table.slots.device.type == device
    address = table.slots.data_ptr()
    for _ in range(12):
        append(table, [0, 1], torch.tensor([3, 4], device=device))
    resync(table, table_of([1], 2), 2)
    table.lengths_array[0] = 0
    assert table.slots.data_ptr() == address


def test_append_writes_each_row_at_its_own_next_column(device):
    table = SlotTable(4, 8, device)
    count = CellCount(table)
    resync(table, table_of([1], 3), 2)
    append(table, [0, 2], torch.tensor([11, 12], device=device))
    assert table.slots[0, 0].item() == 11 and table.slots[2, 3].item() == 12
    assert table.lengths_array.tolist() == [1, 0, 4, 0]
    assert count.appended_cells == 2


def test_append_to_a_full_row_names_it():
    table = SlotTable(2, 2)
    append(table, [0, 1], torch.tensor([1, 2]))
    append(table, [1], torch.tensor([3]))
    with pytest.raises(ValueError, match=r"rows \[1\] already hold max_model_len=2"):
        append(table, [0, 1], torch.tensor([4, 5]))


def test_append_needs_one_slot_per_row():
    with pytest.raises(ValueError, match=r"append needs \[2\] slots"):
        append(SlotTable(4, 8), [0, 1], torch.tensor([1, 2, 3]))


def test_a_prefix_given_by_size_or_range_is_the_same_row_set():
    table = SlotTable(4, 8)
    assert table.row_ids(3) == table.row_ids(range(3)) == [0, 1, 2]
    assert table.rect(3, 2).data_ptr() == table.slots.data_ptr()  # read as a window
    assert table.row_ids(torch.tensor([2, 1])) == [2, 1]
    assert table.rect(range(1, 3), 2).data_ptr() != table.slots.data_ptr()  # not a prefix: a gather


@pytest.mark.parametrize("rows", [[0, 0], [4], [-1], [], 0, 5, range(0)])
def test_bad_row_sets_are_refused(rows):
    with pytest.raises(ValueError):
        SlotTable(4, 8).row_ids(rows)


def test_read_over_a_prefix_is_a_view_of_the_buffer(device):
    table = SlotTable(4, 8, device)
    append(table, [0, 1, 2], torch.tensor([5, 6, 7], device=device))
    rect, lens = read(table, [0, 1, 2], 3)
    assert rect.shape == (3, 3)
    assert rect.data_ptr() == table.slots.data_ptr() and rect.stride() == table.slots.stride()
    append(table, [0], torch.tensor([9], device=device))
    assert rect[0, 1].item() == 9  # live storage
    assert lens.tolist() == [1, 1, 1]  # a copy: it did not move
    assert table.windows == 1 and table.gathers == 0


def test_read_over_scattered_rows_is_a_copy_of_exactly_the_rectangle(device):
    table = SlotTable(4, 8, device)
    append(table, [1, 3], torch.tensor([5, 6], device=device))
    rect, lens = read(table, [3, 1], 2)
    assert rect.shape == (2, 2) and rect.is_contiguous()
    assert rect.data_ptr() != table.slots.data_ptr()
    assert rect[:, 0].tolist() == [6, 5] and lens.tolist() == [1, 1]
    append(table, [3], torch.tensor([8], device=device))
    assert rect[0, 1].item() == 0
    assert table.gathers == 1


def test_reset_zeroes_the_length_and_clears_nothing(device):
    cache = small_cache(device)
    written = cache.allocate_prompt(0, 4).tolist()
    cache.reset_row(0)
    assert cache.slot_table.lengths_array[0] == 0
    assert cache.slot_table.slots[0, :4].tolist() == written


def test_slot_table_reset_zeroes_one_length_and_the_next_append_writes_column_zero(device):
    table = SlotTable(3, 8, device)
    append(table, [0, 1], torch.tensor([5, 6], device=device))
    append(table, [0, 1], torch.tensor([7, 8], device=device))
    table.reset(1)
    assert lengths(table, [0, 1]).tolist() == [2, 0]
    assert table.slots[1, :2].tolist() == [6, 8]  # nothing cleared: the length masks it
    append(table, [1], torch.tensor([9], device=device))
    assert table.slots[1, :2].tolist() == [9, 8] and lengths(table, [1]).tolist() == [1]
    with pytest.raises(ValueError):
        table.reset(3)


def test_sync_resyncs_exactly_the_rows_whose_length_disagrees(device):
    table = SlotTable(3, 8, device)
    tables = [table_of([2], 3), table_of([1], 2), table_of([4, 5], 6)]
    for row in range(3):
        resync(table, tables[row], row)
    tables[1].advance(1)  # row 1 grew in its block table only
    table.reset(2)  # row 2 lost its length
    count = CellCount(table)
    assert sync(table, tables, range(3)) == [1, 2]
    assert (count.resyncs, count.resynced_cells) == (2, 3 + 6)
    check_slots_agree(table, tables, range(3))
    assert sync(table, tables, [0, 1, 2]) == []


@pytest.mark.parametrize("rows, window", [(3, True), (range(2), True), ([0, 1], True), ([1, 0], False),
                                          ([0, 2], False), ([1], False)])
def test_is_window_is_the_prefix_condition_and_read_follows_it(rows, window):
    table = SlotTable(4, 8)
    assert is_window(table, rows) == window
    rect, _ = read(table, rows, 2)
    assert (rect.data_ptr() == table.slots.data_ptr()) == window and (table.windows, table.gathers) == (window, not window)


def test_resync_copies_the_row_and_counts(device):
    table = SlotTable(2, 8, device)
    count = CellCount(table)
    resync(table, table_of([3, 0], 6), 1)
    assert table.slots[1, :6].tolist() == [12, 13, 14, 15, 0, 1]
    assert (count.resyncs, count.resynced_cells) == (1, 6)


def test_adopting_a_row_longer_than_the_table_raises_naming_adopt():
    with pytest.raises(ValueError, match="adopt: row 0 would hold 9 tokens"):
        resync(SlotTable(2, 8), table_of([0, 1, 2], 9), 0)


# -- the cache -----------------------------------------------------------------------------


def test_cache_reserves_a_scratch_block_and_clamps_max_model_len():
    cache = small_cache(num_blocks=5, max_model_len=1000)
    assert cache.pool.num_used == 1 and cache.scratch_slot == 0
    assert cache.max_model_len == 16 and cache.slot_table.max_model_len == 16
    assert cache.allocate_prompt(0, 16).tolist() == list(range(4, 20))  # never the scratch block


def test_cache_keeps_one_tensor_per_layer():
    cache = small_cache()
    assert len(cache.layers.k_cells) == 2 and len(cache.layers.v_cells) == 2
    pointers = {t.untyped_storage().data_ptr() for t in cache.layers.k_cells + cache.layers.v_cells}
    assert len(pointers) == 4
    assert cache.layers.k_cells[0].shape == (32 * 4, 2, 4)


def test_allocate_prompt_returns_its_slots_and_resyncs(device):
    cache = small_cache(device)
    slots = cache.allocate_prompt(1, 6)
    assert slots.tolist() == [cache.tables[1].slot(t) for t in range(6)]
    assert 1 in cache.live_rows and cache.num_tokens(1) == 6
    check_slots_agree(cache.slot_table, cache.tables, [1])


def test_allocate_prompt_past_max_model_len_raises():
    cache = small_cache(max_model_len=8)
    with pytest.raises(ValueError, match="cannot add 9 tokens to 0"):
        cache.allocate_prompt(0, 9)


def test_plan_decode_addresses_the_step(device):
    cache = small_cache(device)
    cache.allocate_prompt(0, 5)
    cache.allocate_prompt(1, 2)
    plan = cache.plan_decode([0, 1])
    assert plan.context_lens.tolist() == [6, 3] and plan.positions.tolist() == [5, 2]
    assert plan.write_slots.tolist() == [cache.tables[0].slot(5), cache.tables[1].slot(2)]
    assert plan.is_window and plan.slot_mapping.data_ptr() == cache.slot_table.slots.data_ptr()
    assert plan.width >= 6
    check_plan_addressing(plan, cache.tables)


def test_plan_decode_over_many_steps_matches_rebuild_every_step(device):
    cache = small_cache(device)
    for row, n in enumerate([1, 4, 7]):
        cache.allocate_prompt(row, n)
    for _ in range(30):
        plan = cache.plan_decode([0, 1, 2])
        check_plan_addressing(plan, cache.tables)
        expected = rebuild_mapping(cache.tables, [0, 1, 2], device=device)
        lens = plan.context_lens.tolist()
        for i in range(3):
            assert torch.equal(plan.slot_mapping[i, : lens[i]], expected[i, : lens[i]])


def test_plan_decode_over_scattered_rows_gathers(device):
    cache = small_cache(device)
    cache.allocate_prompt(1, 3)
    cache.allocate_prompt(3, 2)
    plan = cache.plan_decode([3, 1])
    assert not plan.is_window and plan.slot_mapping.data_ptr() != cache.slot_table.slots.data_ptr()
    assert plan.context_lens.tolist() == [3, 4]
    check_plan_addressing(plan, cache.tables)


def test_a_held_plan_keeps_its_own_vectors():
    cache = small_cache()
    cache.allocate_prompt(0, 2)
    first = cache.plan_decode([0])
    held = [t.clone() for t in (first.context_lens, first.write_slots, first.positions)]
    for _ in range(6):
        cache.plan_decode([0])
    assert all(torch.equal(a, b) for a, b in zip(held, (first.context_lens, first.write_slots, first.positions)))


def test_plan_decode_refuses_rows_that_are_not_live():
    cache = small_cache()
    with pytest.raises(ValueError, match=r"rows \[2\] are not live"):
        cache.plan_decode([2])


def test_plan_decode_at_max_model_len_names_the_row():
    cache = small_cache(max_model_len=8)
    cache.allocate_prompt(0, 8)
    with pytest.raises(ValueError, match=r"rows \[0\] are at max_model_len=8"):
        cache.plan_decode([0])


def test_plan_decode_without_blocks_raises_and_changes_nothing():
    cache = small_cache(num_blocks=3)  # scratch + 2
    cache.allocate_prompt(0, 4)
    cache.allocate_prompt(1, 4)
    assert not cache.can_append([0, 1]) and cache.blocks_to_append([0, 1]) == 2
    with pytest.raises(PoolExhaustedError, match=r"rows \[0, 1\] each need a new block"):
        cache.plan_decode([0, 1])
    assert cache.num_tokens(0) == 4 and cache.slot_table.lengths_array[0] == 4


def blocks_held_exactly(cache: PairedCache, rows) -> bool:
    """No row holds a block before a token needs it."""
    return all(cache.tables[r].num_blocks == -(-cache.num_tokens(r) // cache.block_size) for r in rows)


def test_decode_crosses_block_boundaries_taking_each_block_on_the_step_that_needs_it():
    cache = small_cache(num_blocks=64)
    count = CellCount(cache.slot_table)
    for row, n in enumerate([1, 4, 6]):  # rows cross at different steps
        cache.allocate_prompt(row, n)
    used = [cache.pool.num_used]
    for _ in range(40):
        plan = cache.plan_decode([0, 1, 2])
        check_plan_addressing(plan, cache.tables)
        assert blocks_held_exactly(cache, [0, 1, 2])
        used.append(cache.pool.num_used)
    assert count.resyncs == 3  # the prompts: 40 steps over 30 block crossings resynced nothing
    assert used[-1] - used[0] == sum(-(-(n + 40) // 4) - (-(-n // 4)) for n in [1, 4, 6])


def test_someone_else_using_the_pool_between_steps_is_respected(device):
    cache = small_cache(device)
    cache.allocate_prompt(0, 3)
    cache.allocate_prompt(1, 1)
    cache.plan_decode([0, 1])
    taken = cache.pool.allocate(2)  # the ids rows 0 and 1 would take next
    for _ in range(12):
        plan = cache.plan_decode([0, 1])
        check_plan_addressing(plan, cache.tables)
    held = set(cache.tables[0].blocks) | set(cache.tables[1].blocks)
    assert not held & set(taken) and blocks_held_exactly(cache, [0, 1])
    cache.pool.free(taken)  # and a free between steps changes the next ids again
    for _ in range(12):
        check_plan_addressing(cache.plan_decode([0, 1]), cache.tables)
    assert blocks_held_exactly(cache, [0, 1])
    check_slots_agree(cache.slot_table, cache.tables, [0, 1])


def test_decode_stops_at_the_step_whose_block_the_pool_lacks():
    cache = small_cache(num_blocks=5)  # scratch + 4
    cache.allocate_prompt(0, 2)  # 1 block each; 2 left: each row can cross once
    cache.allocate_prompt(1, 4)
    steps = 0
    with pytest.raises(PoolExhaustedError, match=r"rows \[1\] each need a new block and the pool has 0 free"):
        for _ in range(10):
            cache.plan_decode([0, 1])
            steps += 1
    assert steps == 4  # row 1 crossed at step 0; row 0 at step 2; row 1 needs its third block at step 4
    assert cache.num_tokens(1) == 8 and cache.slot_table.lengths_array[1] == 8 and cache.pool.num_free == 0
    cache.free(0)
    check_plan_addressing(cache.plan_decode([1]), cache.tables)


def test_admission_arithmetic():
    cache = small_cache(num_blocks=6)  # 5 usable blocks of 4
    assert cache.blocks_needed(9) == 3 and cache.blocks_needed(20) <= cache.pool.num_free < cache.blocks_needed(21)
    cache.allocate_prompt(0, 3)
    assert cache.blocks_needed(1, row=0) == 0 and cache.blocks_needed(2, row=0) == 1
    assert cache.can_append([0])


def test_free_gives_back_blocks_and_the_row():
    cache = small_cache()
    cache.allocate_prompt(0, 9)
    cache.free(0)
    assert cache.pool.num_used == 1 and 0 not in cache.live_rows and cache.live_rows == []


def test_reset_row_keeps_the_row_and_zeroes_its_length():
    cache = small_cache()
    cache.allocate_prompt(2, 5)
    cache.reset_row(2)
    assert 2 in cache.live_rows and cache.num_tokens(2) == 0 and cache.slot_table.lengths_array[2] == 0


def test_adopt_row_takes_a_table_and_resyncs():
    cache = small_cache()
    table = table_of(cache.pool.allocate(2), 7)
    cache.adopt_row(3, table)
    assert table.is_empty and cache.num_tokens(3) == 7
    check_slots_agree(cache.slot_table, cache.tables, [3])


def test_adopt_row_refuses_a_non_empty_row():
    cache = small_cache()
    cache.allocate_prompt(0, 2)
    with pytest.raises(ValueError, match="row 0 still holds 2 tokens"):
        cache.adopt_row(0, table_of(cache.pool.allocate(1), 1))


def test_adopt_row_refuses_blocks_another_row_holds_or_the_pool_has_free():
    cache = small_cache()
    cache.allocate_prompt(0, 2)
    held = cache.tables[0].blocks[0]
    with pytest.raises(ValueError, match=f"block {held}: it is held by row 0"):
        cache.adopt_row(1, table_of([held], 1))
    with pytest.raises(ValueError, match="block 30: it is free in the pool"):
        cache.adopt_row(1, table_of([30], 1))
    with pytest.raises(ValueError, match="it is held by the scratch block"):
        cache.adopt_row(1, table_of([0], 1))
    twice = cache.pool.allocate(1) * 2
    with pytest.raises(ValueError, match="lists a block twice"):
        cache.adopt_row(1, table_of(twice, 5))


def test_move_row_compacts_and_frees_the_source(device):
    cache = small_cache(device)
    cache.allocate_prompt(0, 3)
    cache.allocate_prompt(2, 6)
    cache.plan_decode([0, 2])
    cache.free(0)
    cache.move_row(2, 0)
    assert cache.live_rows == [0] and cache.num_tokens(0) == 7 and cache.slot_table.lengths_array[2] == 0
    check_slots_agree(cache.slot_table, cache.tables, [0])
    plan = cache.plan_decode([0])
    assert plan.is_window and plan.context_lens.tolist() == [8]
    check_plan_addressing(plan, cache.tables)


def test_move_row_refuses_an_occupied_destination():
    cache = small_cache()
    cache.allocate_prompt(0, 1)
    cache.allocate_prompt(1, 1)
    with pytest.raises(ValueError, match="destination row 0 still holds 1 tokens"):
        cache.move_row(1, 0)


def test_write_kv_stores_at_the_write_slots(device):
    cache = small_cache(device)
    cache.allocate_prompt(0, 3)
    plan = cache.plan_decode([0])
    k = torch.randn(1, 2, 4, device=device)
    cache.write_kv(1, plan.write_slots, k, -k)
    assert torch.equal(cache.layers.k_cells[1][plan.write_slots], k)
    assert torch.equal(cache.layers.v_cells[1][plan.write_slots], -k)


def test_a_prompt_the_pool_cannot_hold_claims_nothing():
    cache = small_cache(num_blocks=4)  # scratch + 3
    cache.allocate_prompt(0, 8)
    with pytest.raises(PoolExhaustedError):
        cache.allocate_prompt(1, 5)
    assert 1 not in cache.live_rows and cache.tables[1].is_empty and cache.pool.num_free == 1
    assert cache.slot_table.lengths_array[1] == 0


def test_a_long_steady_batch_matches_rebuild_and_takes_blocks_lowest_id_first():
    cache = small_cache(num_blocks=400, max_model_len=400)
    for row, n in enumerate([1, 5, 9, 2]):
        cache.allocate_prompt(row, n)
    freed = cache.tables[1].blocks
    cache.free(1)
    cache.allocate_prompt(1, 5)
    assert cache.tables[1].blocks == freed  # the blocks just given back, reused first
    for _ in range(300):
        free_before = sorted(set(range(400)) - {b for t in cache.tables for b in t.blocks} - {0})
        full = [r for r in range(4) if cache.num_tokens(r) == cache.tables[r].capacity]
        plan = cache.plan_decode(4)
        assert [cache.tables[r].blocks[-1] for r in full] == free_before[: len(full)]
    check_plan_addressing(plan, cache.tables)
    check_slots_agree(cache.slot_table, cache.tables, range(4))
