"""Prefix caching in the pool: chained hashes, the hash <-> block maps, the LRU of cached blocks."""

from __future__ import annotations

import pytest

from nanoserve.cache.blocks import BlockFreeError, BlockPool
from nanoserve.cache.prefix_cache import chain_hashes, root_hash

ROOT = root_hash("model-a/float32")


def test_chain_hashes_one_per_full_block_and_none_for_the_partial_tail():
    assert len(chain_hashes(list(range(11)), 4, ROOT)) == 2
    assert len(chain_hashes(list(range(12)), 4, ROOT)) == 3
    assert chain_hashes([1, 2, 3], 4, ROOT) == []


def test_a_block_hash_depends_on_its_parent_not_only_its_tokens():
    first = chain_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, ROOT)
    other = chain_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4, ROOT)
    assert first[0] != other[0]
    assert first[1] != other[1]  # same tokens in block 1, different parents


def test_the_salt_changes_every_hash():
    tokens = list(range(8))
    assert root_hash("model-a/float32") != root_hash("model-a/bfloat16")
    salted = chain_hashes(tokens, 4, root_hash("model-a/bfloat16"))
    assert all(a != b for a, b in zip(chain_hashes(tokens, 4, ROOT), salted))


def test_equal_prefixes_hash_equal_and_a_shared_stem_shares_its_leading_hashes():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0], 4, ROOT)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4, ROOT)
    assert a == chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert a[0] == b[0] and a[1] != b[1]


def held_pool(num_blocks: int = 10) -> BlockPool:
    pool = BlockPool(num_blocks, 4)
    assert pool.allocate(num_blocks) == list(range(num_blocks))
    return pool


def test_lookup_returns_the_longest_registered_prefix():
    pool = held_pool()
    h = chain_hashes(list(range(16)), 4, ROOT)
    assert pool.register(7, h[0]) and pool.register(3, h[1]) and pool.register(5, h[3])
    assert pool.lookup(h) == [7, 3]  # block 5 is unreachable: the chain's third hash names nothing
    assert pool.lookup(h[2:]) == []
    assert pool.num_registered == 3 and pool.num_cached == 0  # held blocks are not cached


def test_register_keeps_the_block_already_named_by_a_hash_and_refuses_a_second_name():
    pool = held_pool()
    h = chain_hashes([1, 2, 3, 4], 4, ROOT)[0]
    assert pool.register(2, h)
    assert not pool.register(6, h)
    assert pool.lookup([h]) == [2] and pool.hash_of(6) is None
    with pytest.raises(ValueError, match="no hash"):
        pool.register(2, chain_hashes([9, 9, 9, 9], 4, ROOT)[0])
    pool.free([6])
    with pytest.raises(ValueError, match="held"):
        pool.register(6, root_hash("x"))  # an empty block's K/V mean nothing
    pool.free([2])
    with pytest.raises(ValueError, match="held"):
        pool.register(2, root_hash("x"))  # cached, not held


def test_freed_registered_blocks_are_cached_and_evicted_least_recently_freed_first():
    pool = held_pool(6)
    hashes = chain_hashes(list(range(12)), 4, ROOT)
    for block, h in zip((4, 1, 2), hashes):
        pool.register(block, h)
    pool.free([2, 1, 4, 0])  # 0 has no hash: it goes back empty
    assert (pool.num_cached, pool.num_free) == (3, 4)
    pool.share([1])  # adopted again: out of the LRU
    pool.free([1])  # and back, now the most recently freed
    assert pool.allocate(3) == [0, 2, 4]  # the empty block first, then eviction in LRU order
    assert pool.hash_of(2) is None and pool.lookup(hashes) == []  # block 4 (the chain's first) is gone
    assert pool.lookup(hashes[1:]) == [1] and pool.num_cached == 1 and pool.num_registered == 1
    assert pool.evictions == 2 and pool.num_used == 5


def test_share_refuses_an_empty_block_and_changes_nothing():
    pool = held_pool(4)
    pool.register(1, root_hash("a"))
    pool.free([1, 3])
    with pytest.raises(BlockFreeError, match=r"\[3\]"):
        pool.share([1, 3])
    assert pool.ref_count(1) == 0 and pool.is_cached(1) and pool.num_free == 2
    pool.share([1, 1, 0])  # a cached block taken back, a used one shared
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 1, 0] and not pool.is_cached(1)


def test_without_registration_no_block_is_ever_cached():
    pool = held_pool(5)
    pool.free([3, 1, 4])
    assert pool.num_cached == 0 and pool.num_free == 3
    assert pool.allocate(3) == [4, 1, 3] and pool.evictions == 0  # the free list is a stack
