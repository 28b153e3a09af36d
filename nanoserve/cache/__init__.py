"""The paged KV cache: blocks, block tables, the pool plan and the cache that owns the slot table."""

from nanoserve.cache.blocks import BlockFreeError, BlockPool, BlockTable, PoolExhaustedError
from nanoserve.cache.paged_cache import BatchedPagedKVCache, DecodePlan

__all__ = ["BatchedPagedKVCache", "BlockFreeError", "BlockPool", "BlockTable", "DecodePlan", "PoolExhaustedError"]
