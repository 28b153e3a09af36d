"""Prefix caching in the paged cache: adopting cached blocks, registering written ones, the
pool's three-way accounting, and eviction when the pool runs short."""

from __future__ import annotations

import pytest
from paired_cache import PairedCache

from nanoserve.cache import BlockFreeError, PoolExhaustedError
from nanoserve.worker.gates import check_slots_agree

BS = 4


def make_cache(num_blocks: int = 12, caching: bool = True, salt: str = "") -> PairedCache:
    return PairedCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BS,
                               max_batch_size=4, max_model_len=32, enable_prefix_caching=caching,
                               prefix_salt=salt)


def prefill(cache: PairedCache, row: int, tokens: list[int]) -> int:
    """What an engine does for a new request: adopt, allocate the rest, (write K/V), register."""
    adopted = cache.admit_prefix(row, tokens)
    cache.allocate_prompt(row, len(tokens) - adopted)
    cache.cache_full_blocks(row, tokens)
    return adopted


def accounting(cache: PairedCache) -> tuple[int, int, int]:
    pool = cache.pool
    num_empty = sum(not pool.ref_count(b) and not pool.is_cached(b) for b in range(pool.num_blocks))  # neither held nor cached
    assert num_empty + pool.num_cached + pool.num_used == pool.num_blocks
    assert pool.num_free == num_empty + pool.num_cached
    return num_empty, pool.num_cached, pool.num_used


STEM = list(range(100, 112))  # three full blocks


def test_a_second_request_adopts_the_first_ones_full_blocks_and_its_row_starts_with_their_slots():
    cache = make_cache()
    assert prefill(cache, 0, STEM + [1, 2]) == 0
    assert cache.match_prefix(STEM + [7]) == 12
    assert prefill(cache, 1, STEM + [7]) == 12
    shared = cache.tables[0].blocks[:3]
    assert cache.tables[1].blocks[:3] == shared
    assert [cache.pool.ref_count(b) for b in shared] == [2, 2, 2]
    assert cache.tables[1].blocks[3] not in cache.tables[0].blocks  # the partial tail is private
    assert cache.slot_table.slots[1, :12].tolist() == cache.slot_table.slots[0, :12].tolist()
    check_slots_agree(cache.slot_table, cache.tables, [0, 1])
    assert cache.prefix_cache_stats() == {"prefix_cache_queries": 14 + 13, "prefix_cache_hits": 12,
                                          "prefix_cache_blocks": 3, "prefix_cache_evictions": 0}


def test_match_prefix_leaves_at_least_one_token_to_compute():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    assert cache.match_prefix(STEM) == 8  # all 12 cached, but the last token must be computed
    assert cache.match_prefix(STEM + [5]) == 12
    assert cache.match_prefix(STEM[:1]) == 0 and cache.match_prefix([]) == 0
    assert cache.match_prefix([0] + STEM) == 0  # same tokens, other parents
    assert cache.prefix_cache_stats()["prefix_cache_queries"] == 13  # a query is pure


def test_the_salt_separates_caches():
    a, b = make_cache(salt="model-a"), make_cache(salt="model-b")
    prefill(a, 0, STEM + [1])
    prefill(b, 0, STEM + [1])
    assert a.pool.hash_of(a.tables[0].blocks[0]) != b.pool.hash_of(b.tables[0].blocks[0])


def test_freed_blocks_with_known_prefixes_stay_cached_and_are_adopted_again():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    blocks = cache.tables[0].blocks
    cache.free(0)
    assert accounting(cache) == (12 - 1 - 3, 3, 1)  # the tail went back empty; the scratch block is used
    assert prefill(cache, 2, STEM + [9, 9]) == 12
    assert cache.tables[2].blocks[:3] == blocks[:3]
    assert accounting(cache) == (12 - 1 - 4, 0, 5)


def test_allocation_evicts_least_recently_used_cached_blocks_and_never_a_held_one():
    cache = make_cache(num_blocks=9)  # 8 usable
    prefill(cache, 0, [1] * 8 + [0])  # blocks 1, 2 cached, 3 tail
    prefill(cache, 1, [2] * 8 + [0])  # blocks 4, 5 cached, 6 tail
    first, second = cache.tables[0].blocks[:2], cache.tables[1].blocks[:2]
    cache.free(0)
    cache.free(1)
    assert accounting(cache) == (4, 4, 1)
    cache.allocate_prompt(2, 20)  # 5 blocks: the 4 empty ones, then one evicted
    # a chain's tail is freed first, so it is evicted first; the older chain goes first
    assert cache.pool.hash_of(first[1]) is None and cache.pool.hash_of(first[0]) is not None
    assert cache.match_prefix([1] * 8 + [0]) == 4 and cache.match_prefix([2] * 8 + [0]) == 8
    assert prefill(cache, 3, [2] * 8 + [0, 0]) == 8  # adopts the second chain; its tail evicts first[0]
    assert cache.tables[3].blocks[:2] == second and cache.pool.hash_of(first[0]) is None
    assert cache.prefix_cache_stats()["prefix_cache_evictions"] == 2
    assert accounting(cache) == (0, 0, 9)
    with pytest.raises(PoolExhaustedError):
        cache.allocate_prompt(3, 4)


def test_a_hash_already_cached_keeps_its_block_and_the_duplicate_goes_back_empty():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    cache.allocate_prompt(1, 13)  # the same prompt computed again, e.g. both in one prefill step
    cache.cache_full_blocks(1, STEM + [1])
    assert cache.prefix_cache_stats()["prefix_cache_blocks"] == 3
    assert all(cache.pool.hash_of(b) is None for b in cache.tables[1].blocks)
    cache.free(1)
    assert accounting(cache) == (12 - 1 - 4, 0, 5)


def test_cache_full_blocks_refuses_tokens_that_are_not_the_rows():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    with pytest.raises(RuntimeError, match="another prefix"):
        cache.cache_full_blocks(0, [0] + STEM)
    with pytest.raises(ValueError, match="holds 13 tokens"):
        cache.cache_full_blocks(0, STEM + [1, 2])


def test_admit_prefix_refuses_a_row_that_holds_tokens_and_changes_nothing():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    before = (cache.tables[0].blocks, accounting(cache), cache.prefix_cache_stats())
    with pytest.raises(ValueError, match="row 0 still holds 13 tokens"):
        cache.admit_prefix(0, STEM + [1])
    assert (cache.tables[0].blocks, accounting(cache), cache.prefix_cache_stats()) == before


def test_a_shared_block_is_given_back_only_by_its_last_holder():
    cache = make_cache()
    prefill(cache, 0, STEM + [1])
    prefill(cache, 1, STEM + [2])
    shared = cache.tables[0].blocks[:3]
    cache.free(0)
    assert [cache.pool.ref_count(b) for b in shared] == [1, 1, 1] and cache.pool.num_cached == 0
    cache.move_row(1, 0)  # compaction carries the blocks, counts unchanged
    assert cache.tables[0].blocks[:3] == shared and [cache.pool.ref_count(b) for b in shared] == [1, 1, 1]
    cache.reset_row(0)
    assert cache.pool.num_cached == 3
    with pytest.raises(BlockFreeError, match="double free"):
        cache.pool.free([shared[0]])
    with pytest.raises(BlockFreeError, match="empty"):
        cache.pool.share([cache.pool._free[-1]])


def test_with_caching_off_nothing_is_adopted_cached_or_counted():
    cache = make_cache(caching=False)
    assert prefill(cache, 0, STEM + [1]) == 0
    assert prefill(cache, 1, STEM + [1]) == 0
    assert cache.match_prefix(STEM + [1]) == 0
    assert cache.tables[0].blocks == (1, 2, 3, 4) and cache.tables[1].blocks == (5, 6, 7, 8)
    cache.free(0)
    assert accounting(cache) == (7, 0, 5)
    assert cache.pool.allocate(1) == [1]  # lowest id first, as without a prefix cache
    assert cache.prefix_cache_stats() == dict.fromkeys(
        ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_blocks", "prefix_cache_evictions"), 0)
