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
    """

    def __init__(self, cache, write_slots: torch.Tensor, chunks: list[ChunkContext]) -> None:
        self.cache = cache
        self.write_slots = write_slots
        self.chunks = chunks
        self.lengths = [c.length for c in chunks]
        dtype = cache.k_caches[0].dtype
        self.masks = [None if c.context_slots is None else _offset_causal_mask(c.start, c.length, dtype, write_slots.device)
                      for c in chunks]  # built once per step, shared by every layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write_kv(layer, self.write_slots, k, v)
        k_cache, v_cache = self.cache.k_caches[layer], self.cache.v_caches[layer]
        outputs = []
        for chunk, mask, q_i, k_i, v_i in zip(self.chunks, self.masks, q.split(self.lengths),
                                              k.split(self.lengths), v.split(self.lengths)):
            if chunk.context_slots is not None:
                k_i, v_i = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            # [T, H, D] -> [H, T, D]; GQA: the kv heads are shared by groups of query heads.
            out = F.scaled_dot_product_attention(
                q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _offset_causal_mask(start: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[length, start + length] additive mask: query i sees columns 0..start + i (0), not the
    rest (-inf). In the K/V dtype, as the decode mask: a bool mask is converted on every call."""
    columns = torch.arange(start + length, device=device)
    hidden = columns.view(1, -1) > torch.arange(start, start + length, device=device).view(-1, 1)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
