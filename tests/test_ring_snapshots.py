"""The host's index of saved window rings (cache/ring_snapshots.py): a block boundary's ring is
saved once, the least recently used goes first, and a row adopts a cached prefix only as far as
the longest boundary with a saved ring."""

from __future__ import annotations

from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.ring_snapshots import RingSnapshots


def test_a_boundary_is_saved_once_and_the_least_recently_used_goes_first():
    snapshots = RingSnapshots(2)
    assert snapshots.take(b"a") == 0 and snapshots.take(b"b") == 1
    assert snapshots.take(b"a") is None  # the same prefix's K/V: not saved again, but used now
    assert snapshots.take(b"c") == 1  # b was the least recently used
    assert snapshots.longest([b"x", b"b"]) == 0 and snapshots.longest([b"a", b"x", b"c", b"y"]) == 3
    assert snapshots.restore(b"a") == 0 and snapshots.take(b"d") == 1  # c went: a was restored after it
    assert (snapshots.saved, snapshots.restored, len(snapshots)) == (4, 1, 2)


def test_a_row_adopts_a_cached_prefix_up_to_its_longest_saved_ring():
    blocks = BlockManager(16, 4, 2, 64, enable_prefix_caching=True, ring_snapshots=2)
    tokens = list(range(20))
    hashes = blocks.block_hashes().update(tokens)
    blocks.grow(0, 20)
    blocks.cache_full_blocks(0, tokens, hashes)
    assert blocks.cached_prefix(tokens + [99], hashes) == []  # cached, but no ring holds a window
    assert blocks.ring_to_save(hashes, 11) == (0, 8)  # 11 tokens: the boundary at 8
    assert blocks.ring_to_save(hashes, 9) is None  # the same boundary: saved already
    assert len(blocks.cached_prefix(tokens + [99], hashes)) == 2
    blocks.free(0)
    assert blocks.claim_prefix(1, tokens + [99], hashes) == 8
    assert blocks.ring_to_restore(hashes, 8) == 0 and blocks.ring_to_restore(hashes, 0) is None
    plain = BlockManager(16, 4, 2, 64, enable_prefix_caching=True)  # no rings: the whole prefix
    assert plain.snapshots is None and plain.ring_to_save(hashes, 11) is None
