"""BlockPool and BlockTable: allocation accounting, clear errors, slot arithmetic, adopt's refusal."""

from __future__ import annotations

import pytest

from nanoserve.cache.blocks import BlockFreeError, BlockPool, BlockTable, PoolExhaustedError


def test_pool_hands_out_lowest_ids_first_and_counts():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert (pool.num_free, pool.num_used, pool.num_blocks, pool.block_size, pool.num_slots) == (3, 3, 6, 4, 24)
    pool.free([1])
    assert pool.allocate(1) == [1]  # freed blocks come back before untouched ones


def test_pool_exhaustion_names_the_shortfall_and_takes_nothing():
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate(2)
    with pytest.raises(PoolExhaustedError, match=r"asked for 2 blocks, 1 of 3 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_pool_refuses_double_free():
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockFreeError, match="double free of block 0"):
        pool.free([0])
    assert pool.num_free == 4


def test_pool_refuses_a_block_repeated_in_one_call_and_frees_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate(2)
    with pytest.raises(BlockFreeError, match="double free of block 1"):
        pool.free([1, 1])
    assert pool.num_used == 2


@pytest.mark.parametrize("block", [-1, 4, 99])
def test_pool_refuses_foreign_blocks(block):
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate(4)
    with pytest.raises(BlockFreeError, match="not from this pool"):
        pool.free([block])


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    with pytest.raises(ValueError):
        BlockPool(4, 4).allocate(-1)


def test_table_slot_arithmetic():
    table = BlockTable(block_size=4)
    table.add_blocks([7, 2])
    table.advance(6)
    assert [table.slot(t) for t in range(6)] == [28, 29, 30, 31, 8, 9]
    assert (table.num_tokens, table.num_blocks, table.capacity) == (6, 2, 8)


def test_table_blocks_needed_counts_partial_blocks():
    table = BlockTable(block_size=4)
    assert table.blocks_needed(1) == 1
    assert table.blocks_needed(8) == 2
    table.add_blocks([0])
    table.advance(3)
    assert table.blocks_needed(1) == 0
    assert table.blocks_needed(2) == 1


def test_table_cannot_hold_more_than_its_blocks():
    table = BlockTable(block_size=4)
    table.add_blocks([0])
    with pytest.raises(ValueError, match="cannot hold 5 tokens in 1 blocks"):
        table.advance(5)


def test_adopt_refuses_a_non_empty_table():
    table, other = BlockTable(4), BlockTable(4)
    table.add_blocks([0])
    table.advance(1)
    other.add_blocks([1])
    with pytest.raises(ValueError, match="adopt refused: this table still holds 1 tokens"):
        table.adopt(other)
    assert other.blocks == (1,)


def test_adopt_refuses_a_table_with_blocks_but_no_tokens():
    table, other = BlockTable(4), BlockTable(4)
    table.add_blocks([0])
    with pytest.raises(ValueError, match="adopt refused"):
        table.adopt(other)


def test_adopt_moves_blocks_and_tokens_and_empties_the_source():
    table, other = BlockTable(4), BlockTable(4)
    other.add_blocks([3, 5])
    other.advance(6)
    table.adopt(other)
    assert (table.blocks, table.num_tokens) == ((3, 5), 6)
    assert other.is_empty and other.blocks == ()


def test_adopt_refuses_another_block_size():
    with pytest.raises(ValueError, match="block_size mismatch"):
        BlockTable(4).adopt(BlockTable(8))


def test_clear_returns_blocks_and_empties():
    table = BlockTable(4)
    table.add_blocks([2, 3])
    table.advance(5)
    assert table.clear() == [2, 3]
    assert table.is_empty and table.capacity == 0


def test_the_free_list_is_a_stack_freed_blocks_first_the_last_freed_first():
    pool = BlockPool(6, 4)
    assert pool.allocate(3) == [0, 1, 2]  # untouched blocks: lowest id first
    pool.free([2, 0])
    assert pool.allocate(3) == [0, 2, 3]
