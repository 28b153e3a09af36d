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
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + tokens[start:start + block_size].tobytes()).digest()
        hashes.append(parent)
    return hashes
