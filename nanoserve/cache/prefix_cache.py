"""Prefix caching's block names: a full block is named by a hash of everything before it.

A full block's hash covers its token ids and its parent's hash; the chain starts from a root
hash of a salt (the model, the dtype: anything that changes K/V), so two blocks with one hash
hold the same K/V. The pool (`BlockPool.register`/`lookup`) keeps the hash <-> block maps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def root_hash(salt: str) -> BlockHash:
    """The parent hash of a sequence's first block."""
    return hashlib.sha256(b"nanoserve prefix cache\0" + salt.encode()).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    """One hash per full block of `token_ids`; the partial tail has none."""
    return BlockHashes(block_size, root).update(token_ids)


class BlockHashes:
    """One sequence's chain of full-block hashes, kept with its request and grown with its
    tokens, so each block is hashed once (tokens are only ever appended)."""

    def __init__(self, block_size: int, root: BlockHash) -> None:
        self.block_size, self.root = block_size, root
        self.hashes: list[BlockHash] = []

    def update(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of every full block of `token_ids`, which extend the tokens seen before."""
        size, parent = self.block_size, self.hashes[-1] if self.hashes else self.root
        tokens = np.asarray(token_ids[len(self.hashes) * size:len(token_ids) // size * size], dtype=np.int64)
        for start in range(0, len(tokens), size):
            parent = hashlib.sha256(parent + tokens[start:start + size].tobytes()).digest()
            self.hashes.append(parent)
        return self.hashes
