"""Prefill's attention backend: several prompts packed into one flat token list.

The model computes q, k, v (rotary applied) and hands them to the backend per layer; the
backend writes this step's K/V into the paged cache and returns the attention output. The
decode backend is `WindowAttention` in `nanoserve/engine/decode.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedPrefillAttention:
    """Several prompts packed into one flat token list; each attends causally to itself.

    With no prefix cache a prompt's K/V are exactly this step's k and v, so attention runs
    on them directly while the cache is written for the decode steps that follow.
    """

    def __init__(self, cache, write_slots: torch.Tensor, seq_lens: list[int]) -> None:
        self.cache = cache
        self.write_slots = write_slots
        self.seq_lens = seq_lens

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write_kv(layer, self.write_slots, k, v)
        outputs = []
        for q_i, k_i, v_i in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            # [T, H, D] -> [H, T, D]; GQA: the kv heads are shared by groups of query heads.
            out = F.scaled_dot_product_attention(
                q_i.transpose(0, 1), k_i.transpose(0, 1), v_i.transpose(0, 1),
                is_causal=True, enable_gqa=True)
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
