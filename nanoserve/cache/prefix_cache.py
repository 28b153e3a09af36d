"""Prefix caching: full blocks named by a hash of everything before them, kept until needed.

A full block's hash covers its token ids and its parent's hash; the chain starts from a root
hash of a salt (the model, the dtype: anything that changes K/V), so two blocks with one hash
hold the same K/V. Reference counts are the pool's (`BlockPool`): it tells this registry when a
registered block's count reaches zero (`park`: evictable, in an LRU) or leaves it (`unpark`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def root_hash(salt: str) -> BlockHash:  # the parent hash of a sequence's first block
    return hashlib.sha256(b"nanoserve prefix cache\0" + salt.encode()).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + tokens[start:start + block_size].tobytes()).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Hash <-> block, one to one, and the registered blocks no row holds (evictable, LRU first):
    a registered block is evictable exactly while its reference count (the pool's) is zero."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.queries = 0  # tokens of the requests that asked (admit_prefix)
        self.hits = 0  # tokens they adopted
        self.evictions = 0

    @property
    def num_registered(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest registered prefix of `hashes` (a pure query)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a held block by `block_hash` unless the hash names a block already (kept); returns
        whether it did. Raises if the block has a hash."""
        if block in self._hash_of:
            raise ValueError(f"block {block} is already registered; a block's K/V never change while held")
        if block_hash in self._block_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def park(self, block: int) -> None:
        """A registered block's last holder left: now the most recently used evictable block."""
        if block not in self._hash_of or block in self._evictable:
            raise ValueError(f"park({block}): only a registered block that is not yet evictable can be parked")
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """An evictable block is held again (a request adopted it): it is no longer evictable."""
        if block not in self._evictable:
            raise ValueError(f"unpark({block}): the block is not evictable (held, or not registered)")
        del self._evictable[block]

    def evict(self) -> int:
        """Forget the least recently used evictable block and return it (now a plain free block)."""
        if not self._evictable:
            raise ValueError("evict: no evictable block")
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.evictions += 1
        return block

    def record_query(self, tokens: int, hit_tokens: int) -> None:
        self.queries += tokens
        self.hits += hit_tokens

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_blocks": self.num_registered, "prefix_cache_evictions": self.evictions}
