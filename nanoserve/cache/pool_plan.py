"""Sizing the cache: a bytes budget and the model's KV geometry in, `num_blocks` and `max_model_len` out.

Also what the slot table `[max_batch_size, max_model_len]` costs next to vLLM's block-id
table `[max_batch_size, blocks per row]` (the same information, `block_size` times smaller).
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 8  # int64 slots and block ids


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                       v_dtype_bytes: float | None = None) -> int:
    """K and V bytes of one token over every layer, at `dtype_bytes` a value (a dtype's itemsize;
    q8_0's 34 / 32), V at `v_dtype_bytes` when it is stored apart."""
    v_bytes = dtype_bytes if v_dtype_bytes is None else v_dtype_bytes
    return round(num_layers * num_kv_heads * head_dim * (dtype_bytes + v_bytes))


def clamp_max_model_len(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The longest row a pool of `num_blocks` can hold: one block is the cache's scratch block."""
    return min(max_model_len, (num_blocks - 1) * block_size)


def table_bytes(max_batch_size: int, max_model_len: int) -> int:
    """What the slot table reserves for the life of the process."""
    return max_batch_size * max_model_len * INDEX_BYTES


def block_table_bytes(max_batch_size: int, max_model_len: int, block_size: int) -> int:
    return max_batch_size * -(-max_model_len // block_size) * INDEX_BYTES


def resident_share(max_batch_size: int, max_model_len: int, kv_bytes: int) -> float:
    """Share of the cache's resident memory that is slot table (addressing) rather than K/V."""
    addressing = table_bytes(max_batch_size, max_model_len)
    return addressing / (addressing + kv_bytes)


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int  # including the reserved scratch block
    block_size: int
    max_batch_size: int
    max_model_len: int  # clamped to the slots the usable blocks hold
    requested_max_model_len: int
    bytes_per_block: int  # K/V bytes = num_blocks * bytes_per_block


def plan_pool(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
              block_size: int, max_batch_size: int, max_model_len: int, v_dtype_bytes: float | None = None,
              extra_token_bytes: int = 0) -> PoolPlan:
    """The most blocks `budget_bytes` of K/V can hold, and `max_model_len` clamped to them (one
    block is the cache's scratch block); `extra_token_bytes` a token go to more layers over the
    same slots (a draft model's). Raises ValueError below that block and one for a request."""
    if min(num_layers, num_kv_heads, head_dim, block_size, max_batch_size, max_model_len) < 1:
        raise ValueError("plan_pool needs positive sizes")
    bytes_per_block = block_size * (kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, v_dtype_bytes)
                                    + extra_token_bytes)
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"a budget of {budget_bytes} bytes holds {num_blocks} blocks of {bytes_per_block} bytes; "
                         "the cache needs 2 (a scratch block and one for a request): raise the budget or shrink "
                         "block_size")
    return PoolPlan(num_blocks, block_size, max_batch_size, clamp_max_model_len(max_model_len, num_blocks, block_size),
                    max_model_len, bytes_per_block)
