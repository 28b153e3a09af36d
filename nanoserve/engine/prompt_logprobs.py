"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): how likely each prompt token was
given the ones before it, read off the prefill's hidden states."""

from __future__ import annotations

import torch

from nanoserve.engine.sampler import TokenLogprobs, gather_logprobs

CHUNK = 256  # positions scored at once: a long prompt never holds [len, vocab] logits whole


@torch.inference_mode()
def score_prompt(model, hidden: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs | None]:
    """``hidden`` is the prompt's [len, hidden] final states. Position i's logits score token
    i + 1; the first token has nothing before it, so its entry is None."""
    targets = torch.tensor(token_ids[1:], device=hidden.device)
    scored: list[TokenLogprobs | None] = [None]
    for start in range(0, len(targets), CHUNK):
        end = min(start + CHUNK, len(targets))
        raw = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
        scored.extend(gather_logprobs(raw, targets[start:end], [top] * (end - start)))
    return scored
