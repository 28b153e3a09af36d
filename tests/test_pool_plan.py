"""The pool plan and the addressing arithmetic, with worked numbers."""

from __future__ import annotations

import pytest
import torch
from paired_cache import PairedCache

from nanoserve.cache.pool_plan import (
    block_table_bytes,
    kv_bytes_per_token,
    plan_pool,
    resident_share,
    table_bytes,
)


def test_kv_bytes_per_token_counts_k_and_v_in_every_layer():
    assert kv_bytes_per_token(30, 3, 64, torch.float32.itemsize) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(2, 1, 8, torch.bfloat16.itemsize) == 2 * 2 * 1 * 8 * 2


def test_table_arithmetic_matches_the_seed():
    # 256 rows at 131,072 tokens is 268 MB of addressing; block ids are the same thing 16x smaller.
    assert table_bytes(256, 131072) == 33_554_432 * 8 == 268_435_456
    assert block_table_bytes(256, 131072, 16) == 2_097_152 * 8
    assert table_bytes(256, 131072) // block_table_bytes(256, 131072, 16) == 16
    assert block_table_bytes(2, 17, 16) == 4 * 8  # partial blocks round up


def test_resident_share():
    assert resident_share(4, 1024, kv_bytes=4 * 1024 * 8 * 3) == pytest.approx(0.25)


def test_plan_turns_a_budget_into_blocks_and_clamps_max_model_len():
    per_block = 16 * kv_bytes_per_token(2, 2, 8, 4)
    plan = plan_pool(10 * per_block + 5, 2, 2, 8, 4, 16, max_batch_size=4, max_model_len=4096)
    assert (plan.num_blocks, plan.bytes_per_block) == (10, per_block)
    assert plan.max_model_len == 9 * 16 and plan.requested_max_model_len == 4096  # one block is scratch
    assert plan.num_blocks * plan.block_size == 160 and table_bytes(4, plan.max_model_len) == 4 * 144 * 8
    assert block_table_bytes(4, plan.max_model_len, 16) == 4 * 9 * 8
    assert 0 < resident_share(4, plan.max_model_len, plan.num_blocks * plan.bytes_per_block) < 1


def test_plan_keeps_a_max_model_len_the_pool_can_hold():
    plan = plan_pool(1 << 30, 2, 2, 8, 4, 16, max_batch_size=4, max_model_len=100)
    assert plan.max_model_len == 100


def test_a_budget_below_two_blocks_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"holds 1 blocks of 4096 bytes; the cache needs 2"):
        plan_pool(5000, 2, 2, 8, 4, 16, max_batch_size=4, max_model_len=100)


def test_a_cache_built_from_the_plan_agrees_with_it():
    plan = plan_pool(1 << 20, 2, 2, 8, 4, 16, max_batch_size=4, max_model_len=1 << 20)
    cache = PairedCache(2, 2, 8, plan.num_blocks, plan.block_size, 4, plan.requested_max_model_len)
    assert cache.max_model_len == plan.max_model_len
    assert sum(t.numel() * t.element_size() for t in cache.layers.k_cells + cache.layers.v_cells) == plan.num_blocks * plan.bytes_per_block
