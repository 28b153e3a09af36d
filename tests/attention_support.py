"""The paged decode read the tests hold every backend to: ``paged_attention_reference``, plain
matrix products over each row's gathered cells, and ``paged_attention``, the same read through
the engine's SDPA path (nanoserve.worker.attention), which the tests pit against it."""

from __future__ import annotations

import torch

from nanoserve.worker.attention import attend_window, gather_rows, hidden_columns, window_mask


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over that row's cached tokens (its last ``window``
    ones only, when given; with ``sinks`` [H], each head's sink logit in the softmax).

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
    if sinks is not None:  # the sink's column takes its share of the softmax and is dropped
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(n, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same read as `paged_attention_reference`, through torch's fused SDPA kernel (with
    ``sinks``: through ``attend_with_sinks``).

    The reference stays the oracle (tests pit this against it). A row with context_len 0
    returns zeros, as there.
    """
    mask = window_mask(context_lens, slot_mapping.shape[1], q.dtype, window)
    keys, values = gather_rows(k_cache, slot_mapping), gather_rows(v_cache, slot_mapping)
    out = attend_window(q, keys, values, mask, scale, sinks)
    return out * (context_lens > 0).view(-1, 1, 1).to(q.dtype)
