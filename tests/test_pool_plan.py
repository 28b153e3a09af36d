"""The pool plan and the addressing arithmetic, with the seed's numbers."""

from __future__ import annotations

import pytest
import torch

from nanoserve.cache import BatchedPagedKVCache
from nanoserve.cache.pool_plan import (
    block_table_bytes,
    block_table_cells,
    incremental_cells,
    kv_bytes_per_token,
    plan_pool,
    rebuilt_cells,
    resident_share,
    table_bytes,
    table_cells,
)


def test_kv_bytes_per_token_counts_k_and_v_in_every_layer():
    assert kv_bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(2, 1, 8, torch.bfloat16) == 2 * 2 * 1 * 8 * 2


def test_table_arithmetic_matches_the_seed():
    # 256 rows at 131,072 tokens is 268 MB of addressing; block ids are the same thing 16x smaller.
    assert table_cells(256, 131072) == 33_554_432
    assert table_bytes(256, 131072) == 268_435_456
    assert block_table_cells(256, 131072, 16) == 2_097_152
    assert table_bytes(256, 131072) // block_table_bytes(256, 131072, 16) == 16
    assert block_table_cells(2, 17, 16) == 4  # partial blocks round up


@pytest.mark.parametrize("steps,rebuilt,written", [(8, 656, 96), (64, 12_416, 320), (128, 41_216, 576),
                                                   (512, 558_080, 2_112)])
def test_cell_counts_match_the_seed(steps, rebuilt, written):
    assert rebuilt_cells(4, 16, steps) == rebuilt
    assert incremental_cells(4, 16, steps) == written


def test_resident_share():
    assert resident_share(4, 1024, kv_bytes=4 * 1024 * 8 * 3) == pytest.approx(0.25)


def test_plan_turns_a_budget_into_blocks_and_clamps_max_model_len():
    per_block = 16 * kv_bytes_per_token(2, 2, 8, torch.float32)
    plan = plan_pool(10 * per_block + 5, 2, 2, 8, torch.float32, 16, max_batch_size=4, max_model_len=4096)
    assert (plan.num_blocks, plan.bytes_per_block, plan.kv_bytes) == (10, per_block, 10 * per_block)
    assert plan.max_model_len == 9 * 16 and plan.requested_max_model_len == 4096  # one block is scratch
    assert plan.num_slots == 160 and plan.table_bytes == 4 * 144 * 8
    assert plan.block_table_bytes == 4 * 9 * 8 and 0 < plan.resident_share < 1


def test_plan_keeps_a_max_model_len_the_pool_can_hold():
    plan = plan_pool(1 << 30, 2, 2, 8, torch.float32, 16, max_batch_size=4, max_model_len=100)
    assert plan.max_model_len == 100


def test_a_budget_below_two_blocks_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"holds 1 blocks of 4096 bytes; the cache needs 2"):
        plan_pool(5000, 2, 2, 8, torch.float32, 16, max_batch_size=4, max_model_len=100)


def test_a_cache_built_from_the_plan_agrees_with_it():
    plan = plan_pool(1 << 20, 2, 2, 8, torch.float32, 16, max_batch_size=4, max_model_len=1 << 20)
    cache = BatchedPagedKVCache(2, 2, 8, plan.num_blocks, plan.block_size, 4, plan.requested_max_model_len)
    assert cache.max_model_len == plan.max_model_len
    assert sum(t.numel() * t.element_size() for t in cache.k_caches + cache.v_caches) == plan.kv_bytes
