"""One sequence, no engine: a contiguous K/V cache and a greedy/sampled token loop.

This is what `nanoserve generate` runs until the engine replaces it, and what tests use to
decode many tokens from the real model cheaply. The paged cache lives in nanoserve.cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.model.llama import LlamaModel


class ContiguousKVAttention:
    """Attention callable for a single sequence whose K/V grow by concatenation, layer by layer."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past_k, past_v = self.keys[layer_idx], self.values[layer_idx]
        if past_k is not None:
            k, v = torch.cat([past_k, k]), torch.cat([past_v, v])
        self.keys[layer_idx], self.values[layer_idx] = k, v
        n, total = q.shape[0], k.shape[0]
        # Query i (absolute position total - n + i) sees keys 0..total - n + i.
        mask = None if n == 1 else torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, enable_gqa=True,
        )
        return out[0].transpose(0, 1)


@dataclass(frozen=True)
class SimpleSampling:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 switch those filters off."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, params: SimpleSampling, generator: torch.Generator | None) -> int:
    """One token id from last-position logits [vocab]."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.inference_mode()
def generate_tokens(model: LlamaModel, prompt_ids: Sequence[int], params: SimpleSampling,
                    stop_ids: Sequence[int] = ()) -> Iterator[int]:
    """Yield up to `params.max_tokens` new ids; a stop id is yielded, then generation ends."""
    if not prompt_ids:
        raise ValueError("prompt is empty: need at least one token")
    vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's {limit} positions")
    device = model.embed_tokens.weight.device
    generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
    attention = ContiguousKVAttention(model.config.num_layers)
    ids = torch.tensor(list(prompt_ids), device=device)
    positions = torch.arange(len(ids), device=device)
    for _ in range(params.max_tokens):
        hidden = model(ids, positions, attention)
        token = sample_next(model.compute_logits(hidden[-1:])[0], params, generator)
        yield token
        if token in stop_ids:
            return
        ids, positions = torch.tensor([token], device=device), positions[-1:] + 1
