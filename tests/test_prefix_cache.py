"""The prefix-cache registry on its own: chained hashes, the hash <-> block maps, the LRU."""

from __future__ import annotations

import pytest

from nanoserve.cache.prefix_cache import PrefixCache, chain_hashes, root_hash

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


def test_lookup_returns_the_longest_registered_prefix():
    cache = PrefixCache()
    h = chain_hashes(list(range(16)), 4, ROOT)
    cache.register(7, h[0])
    cache.register(3, h[1])
    cache.register(5, h[3])  # unreachable: block 2 of the chain is not registered
    assert cache.lookup(h) == [7, 3]
    assert cache.lookup(h[2:]) == []
    assert cache.num_registered == 3


def test_register_keeps_the_block_already_named_by_a_hash():
    cache = PrefixCache()
    h = chain_hashes([1, 2, 3, 4], 4, ROOT)[0]
    assert cache.register(2, h)
    assert not cache.register(6, h)
    assert cache.lookup([h]) == [2] and cache.hash_of(6) is None
    with pytest.raises(ValueError, match="already registered"):
        cache.register(2, chain_hashes([9, 9, 9, 9], 4, ROOT)[0])


def test_eviction_takes_the_least_recently_parked_block_and_forgets_its_hash():
    cache = PrefixCache()
    hashes = chain_hashes(list(range(12)), 4, ROOT)
    for block, h in zip((4, 1, 8), hashes):
        cache.register(block, h)
    cache.park(8)
    cache.park(1)
    cache.park(4)
    cache.unpark(1)  # adopted again: out of the LRU
    cache.park(1)  # and back, now the most recent
    assert [cache.evict(), cache.evict()] == [8, 4]
    assert cache.hash_of(8) is None and cache.lookup(hashes[2:]) == []
    assert cache.lookup(hashes) == []  # block 4 (the chain's first) is gone too
    assert cache.num_evictable == 1 and cache.num_registered == 1 and cache.evictions == 2


def test_park_and_unpark_refuse_blocks_in_the_wrong_state():
    cache = PrefixCache()
    with pytest.raises(ValueError, match="registered"):
        cache.park(3)  # never registered: it belongs on the free list
    cache.register(3, root_hash("x"))
    cache.park(3)
    with pytest.raises(ValueError):
        cache.park(3)
    with pytest.raises(ValueError, match="not evictable"):
        cache.unpark(5)
    with pytest.raises(ValueError, match="no evictable"):
        PrefixCache().evict()


def test_stats_name_queries_hits_blocks_and_evictions():
    cache = PrefixCache()
    cache.record_query(10, 8)
    cache.record_query(5, 0)
    cache.register(0, root_hash("a"))
    assert cache.stats() == {"prefix_cache_queries": 15, "prefix_cache_hits": 8,
                             "prefix_cache_blocks": 1, "prefix_cache_evictions": 0}
