"""Paged attention: each row's one query over its cached K/V, read through its slot mapping.

`paged_attention_reference` is the oracle; the decode step uses nanoserve's
`decode_attention` kernel where `decode_attention_kernel` names a tier for it, else
`window_mask` and `attend_window` (torch's fused SDPA). Padding in
`slot_mapping` only has to be a legal slot index: the gather reads it and the mask
(`column >= context_lens[row]`) throws it away.

A sliding-window layer (``window``) reads the same row of slots, restricted to its last
``window`` cells: column c of a row of length L is visible when L - window <= c < L.
"""

from __future__ import annotations

import torch

from nanoserve.model import cpu_kernels


def decode_attention_kernel(cache: torch.Tensor, tier: str | None) -> int | None:
    """The handle of the kernel tier (cpu_kernels) whose decode_attention reads this K (or V)
    cache [slots, kv_heads, head_dim] in decode steps, or None for SDPA: on the CPU, with a tier
    of nanoserve's running the packed weights (the dense formats keep torch's path as the
    reference), bf16 or fp32 cells, and a head_dim the kernels' 16-lane loads cover."""
    if tier is None or cache.device.type != "cpu" or cache.shape[-1] % 16:
        return None
    if cache.dtype not in (torch.bfloat16, torch.float32):
        return None
    return cpu_kernels.handle(tier)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over that row's cached tokens (its last ``window``
    ones only, when given).

    q [n, H, D]; k_cache, v_cache [num_slots, KV, D] with H a multiple of KV (grouped-query
    heads share a K/V head); slot_mapping [n, W]; context_lens [n] (<= W). Returns [n, H, D]
    in q's dtype. A row with context_len 0 (padding) returns zeros.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    width = slot_mapping.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or slot_mapping.shape[0] != n:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    # The grouping below reads each K/V head once per group through a reshape of q instead
    # of copying K/V `group` times (repeat_interleave).
    keys, values = gather_rows(k_cache, slot_mapping), gather_rows(v_cache, slot_mapping)
    queries = q.view(n, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries, keys.transpose(2, 3)).float() * scale  # [n, KV, group, W]
    masked = hidden_columns(context_lens.view(n, 1), width, window)  # [n, W]
    scores.masked_fill_(masked.view(n, 1, 1, width), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A row with nothing to attend to softmaxes all -inf into NaN; it attends to nothing instead.
    probs = probs.masked_fill(masked.view(n, 1, 1, width), 0.0).to(values.dtype)
    out = torch.matmul(probs, values)  # [n, KV, group, D]
    return out.reshape(n, num_heads, head_dim).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The same read as `paged_attention_reference`, through torch's fused SDPA kernel.

    The reference stays the oracle (tests pit this against it). A row with context_len 0
    returns zeros, as there.
    """
    mask = window_mask(context_lens, slot_mapping.shape[1], q.dtype, window)
    out = attend_window(q, k_cache, v_cache, slot_mapping, mask, scale)
    return out * (context_lens > 0).view(-1, 1, 1).to(q.dtype)


def window_mask(context_lens: torch.Tensor, width: int, dtype: torch.dtype,
                window: int | None = None) -> torch.Tensor:
    """The additive mask [n, 1, 1, W] every layer of a decode step with this ``window`` shares:
    0 over each row's visible cells, -inf elsewhere. Built once per step, in q's dtype: a bool
    mask would be converted by SDPA in every layer. A row of length 0 (padding) may see column
    0, so the kernel never softmaxes an empty row."""
    n = context_lens.shape[0]
    hidden = hidden_columns(context_lens.clamp(min=1).view(n, 1), width, window)
    mask = torch.zeros(n, width, dtype=dtype, device=context_lens.device).masked_fill_(hidden, float("-inf"))
    return mask.view(n, 1, 1, width)


def hidden_columns(lengths: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[n, W] True where a row of length ``lengths[row]`` ([n, 1]) does not look: past its
    length, and before its last ``window`` cells."""
    columns = torch.arange(width, device=lengths.device)
    hidden = columns >= lengths
    return hidden if window is None else hidden | (columns < lengths - window)


def attend_window(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q [n, H, D] over each row's window through `window_mask`'s mask; [n, H, D].

    One gather per K and V, then SDPA reads the [n, KV, W, D] view of it by its strides. The
    query heads that share a K/V head are handed to SDPA as that head's query rows
    ([n, KV, group, D]): one small matrix product per K/V head instead of a GQA expansion
    per query head. A padded row's output is finite garbage.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    keys, values = gather_rows(k_cache, slot_mapping), gather_rows(v_cache, slot_mapping)
    queries = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def gather_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Each row's cached K (or V) through its slots: [n, W] slots -> [n, KV, W, D], one copy
    (the gather) and a transposed view of it."""
    n, width = slot_mapping.shape
    return cache.index_select(0, slot_mapping.reshape(-1)).view(n, width, *cache.shape[1:]).transpose(1, 2)
