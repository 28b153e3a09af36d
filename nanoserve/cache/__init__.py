"""The host side of the paged KV cache: blocks, block tables, prefix hashes, the pool plan and
the block manager that holds them. Imports no torch: the scheduler's bookkeeping is plain numbers."""

from nanoserve.cache.block_manager import BlockManager
from nanoserve.cache.blocks import BlockFreeError, BlockPool, BlockTable, PoolExhaustedError

__all__ = ["BlockFreeError", "BlockManager", "BlockPool", "BlockTable", "PoolExhaustedError"]
