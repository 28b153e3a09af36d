"""Physical blocks and the per-request tables that map tokens onto them.

Token t of a `BlockTable` lives at slot `blocks[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from nanoserve.cache.prefix_cache import BlockHash


class PoolExhaustedError(RuntimeError):
    """The pool has fewer free blocks than were asked for."""


class BlockFreeError(ValueError):
    """A block was freed twice, or never came from this pool."""


class BlockPool:
    """`num_blocks` blocks of `block_size` slots, each with a reference count (its holders).

    A block is empty (on the free list), used (count positive) or cached (count zero, its K/V
    registered under a prefix hash, kept until an allocation finds the free list short and
    evicts it, least recently freed first). `num_free` = empty + cached. The free list is a
    stack (O(1) both ways): untouched blocks go out lowest id first, and freed blocks before
    them, the last freed first. Only prefix caching registers blocks, so without it none is ever cached.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots = num_blocks * block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest id first
        self._refs = [0] * num_blocks
        self._block_of: dict[BlockHash, int] = {}  # registered blocks, one to one with their hashes
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, held by none; LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_registered(self) -> int:
        return len(self._hash_of)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, empty ones first, then evicting cached ones (forgetting their
        hashes). Raises PoolExhaustedError (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise PoolExhaustedError(
                f"pool exhausted: asked for {n} blocks, {self.num_free} of {self.num_blocks} free "
                f"(block_size {self.block_size}); the scheduler should preempt or wait (compare blocks_needed with num_free first)")
        blocks = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(blocks) < n:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.evictions += 1
            blocks.append(block)
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Add a holder to each block (a request adopting a cached prefix). Raises BlockFreeError
        (changing nothing) on an empty block: its K/V mean nothing."""
        empty = [b for b in blocks if not self._refs[b] and b not in self._cached]
        if empty:
            raise BlockFreeError(f"cannot share blocks {empty}: they are empty (on the free list)")
        for block in blocks:
            self._cached.pop(block, None)
            self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop a holder of each block; one left with none is cached if registered, else empty.
        Raises BlockFreeError (freeing nothing) on a foreign or over-freed block."""
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            if not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
                raise BlockFreeError(f"block {block!r} is not from this pool (ids 0..{self.num_blocks - 1})")
            drops[int(block)] = drops.get(int(block), 0) + 1
            if drops[int(block)] > self._refs[block]:
                raise BlockFreeError(f"double free of block {block}: it is already free")
        emptied = []
        for block in map(int, blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._cached[block] = None  # the most recently freed
            else:
                emptied.append(block)
        self._free.extend(emptied)  # the last freed is the first reused

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a held block by `block_hash` unless the hash names a block already (kept);
        returns whether it did. Raises if the block is not held or has a hash."""
        if not self._refs[block] or block in self._hash_of:
            raise ValueError(f"register({block}): only a held block with no hash can be registered; "
                             "a block's K/V never change while held")
        if block_hash in self._block_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest registered prefix of `hashes` (a pure query)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks


class BlockTable:
    """One request's blocks and token count: the one record of a row's length (the block
    manager is its only writer)."""

    __slots__ = ("block_size", "_blocks", "num_tokens")

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks: list[int] = []
        self.num_tokens = 0

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        return len(self._blocks) * self.block_size

    @property
    def is_empty(self) -> bool:
        return not self._blocks and self.num_tokens == 0

    def slot(self, t: int) -> int:
        return self._blocks[t // self.block_size] * self.block_size + t % self.block_size

    def slots(self, end: int, start: int = 0) -> list[int]:
        """The slots of tokens [start, end)."""
        first = start // self.block_size
        blocks = np.asarray(self._blocks[first:-(-end // self.block_size)], dtype=np.int64)
        cells = (blocks[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        return cells[start - first * self.block_size:end - first * self.block_size].tolist()

    def blocks_needed(self, extra_tokens: int) -> int:
        return max(0, -(-(self.num_tokens + extra_tokens) // self.block_size) - len(self._blocks))

    def add_blocks(self, blocks: Sequence[int]) -> None:
        self._blocks.extend(map(int, blocks))

    def advance(self, num_tokens: int = 1) -> None:
        """Count `num_tokens` more tokens as held. Raises if the blocks cannot take them."""
        total = self.num_tokens + num_tokens
        if num_tokens < 0 or total > self.capacity:
            raise ValueError(f"cannot hold {total} tokens in {len(self._blocks)} blocks of {self.block_size}")
        self.num_tokens = total

    def adopt(self, other: BlockTable) -> None:
        """Take over `other`'s blocks and tokens, leaving it empty. Refuses a non-empty table: a
        slot table trusts that a row's slots change only by appends or after a reset."""
        if not self.is_empty:
            raise ValueError(f"adopt refused: this table still holds {self.num_tokens} tokens in blocks "
                             f"{self._blocks}; reset the row (giving its blocks back) before handing it on")
        if other.block_size != self.block_size:
            raise ValueError(f"block_size mismatch: {other.block_size} adopted into {self.block_size}")
        self._blocks, self.num_tokens = other._blocks, other.num_tokens
        other._blocks, other.num_tokens = [], 0

    def truncate(self, num_tokens: int) -> list[int]:
        """Keep the first `num_tokens` tokens; returns the blocks no longer needed (the caller
        gives them back). Raises if the table holds fewer."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        dropped, self._blocks = self._blocks[keep:], self._blocks[:keep]
        self.num_tokens = num_tokens
        return dropped

    def clear(self) -> list[int]:
        blocks, self._blocks = self._blocks, []
        self.num_tokens = 0
        return blocks
