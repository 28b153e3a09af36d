"""Prefill's attention backend: several prefill chunks packed into one flat token list.

The model computes q, k, v (rotary applied) and hands them to the backend per layer; the
backend writes this step's K/V into the paged cache and returns the attention output. The
decode backend is `WindowAttention` in `nanoserve/engine/decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ChunkContext:
    """One chunk's place in its sequence: it holds tokens [start, start + length), and
    ``context_slots`` are the slots of tokens [0, start + length) (None when start is 0)."""

    start: int
    length: int
    context_slots: torch.Tensor | None = None


class PackedPrefillAttention:
    """Several chunks packed into one flat token list; each attends causally to its sequence.

    A chunk that starts a sequence has all its keys in this step's k and v, so it attends to
    them directly (no gather). A chunk after cached tokens (an earlier chunk, an adopted
    prefix) reads its keys back through the row's slots once its own K/V are written; query
    ``i`` (position ``start + i``) sees columns ``<= start + i``.

    A sliding-window layer's query ``i`` sees only columns ``start + i - window + 1 ..
    start + i``: a chunk after cached tokens reads back only the cells from its first query's
    window on, and a banded mask does the rest.

    Each chunk runs through ``grouped_causal_attention``: torch's fused CPU kernel, where
    ``enable_gqa`` or a 3-d input would send SDPA down its unfused math path (several times
    slower, and slower still as the context grows).
    """

    def __init__(self, cache, write_slots: torch.Tensor, chunks: list[ChunkContext]) -> None:
        self.cache = cache
        self.write_slots = write_slots
        self.chunks = chunks
        self.lengths = [c.length for c in chunks]
        # Per window: built at the first layer of each, shared by the layers with that window.
        self.masks: dict[int | None, list[torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None) -> torch.Tensor:
        self.cache.write_kv(layer, self.write_slots, k, v)
        if window not in self.masks:
            group = q.shape[1] // k.shape[1]
            self.masks[window] = [
                grouped_causal_mask(c.start - first_key(c, window), c.length, group, q.dtype, q.device, window)
                for c in self.chunks]
        k_cache, v_cache = self.cache.k_caches[layer], self.cache.v_caches[layer]
        outputs = []
        for chunk, mask, q_i, k_i, v_i in zip(self.chunks, self.masks[window], q.split(self.lengths),
                                              k.split(self.lengths), v.split(self.lengths)):
            if chunk.context_slots is not None:
                slots = chunk.context_slots[first_key(chunk, window):]
                k_i, v_i = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            outputs.append(grouped_causal_attention(q_i, k_i, v_i, mask))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def first_key(chunk: ChunkContext, window: int | None) -> int:
    """The first position any of the chunk's queries sees: 0, or its first query's window's
    start for a chunk after cached tokens (a chunk without them holds every key it sees)."""
    if window is None or chunk.context_slots is None:
        return 0
    return max(chunk.start - window + 1, 0)


def grouped_causal_mask(start: int, length: int, group: int, dtype: torch.dtype,
                        device: torch.device, window: int | None = None) -> torch.Tensor:
    """The additive mask [group * length, start + length] of ``grouped_causal_attention``:
    query row ``g * length + i`` (position ``start + i``) sees columns ``0..start + i`` (0), not
    the rest (-inf); with ``window``, only columns from ``start + i - window + 1``. In the
    activations' dtype: a bool mask would be converted in every layer."""
    columns = torch.arange(start + length, device=device).view(1, -1)
    positions = torch.arange(start, start + length, device=device).view(-1, 1)
    hidden = columns > positions
    if window is not None:
        hidden |= columns <= positions - window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return mask.repeat(group, 1)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One chunk's causal attention: q [T, H, D] over its sequence's keys k, v [C, KV, D]
    (H a multiple of KV; the last T keys are the chunk's own), with ``grouped_causal_mask``'s
    mask; returns [T, H, D].

    The ``group`` query heads that share a K/V head become ``group * T`` query rows of that
    head (``[1, KV, group * T, D]``), so K/V are read as they are, without a copy per query
    head, and SDPA gets the 4-d, mask-only input its fused CPU kernel takes."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    queries = q.view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(queries, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask)
    return out.view(num_kv_heads, group, length, head_dim).permute(2, 0, 1, 3).reshape(length, num_heads, head_dim)
