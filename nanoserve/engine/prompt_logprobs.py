"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): how likely each prompt token was
given the ones before it, read off the prefill's hidden states."""

from __future__ import annotations

import torch

from nanoserve.engine.sampler import TokenLogprobs, gather_logprobs

CHUNK = 256  # positions scored at once: a long prompt never holds [len, vocab] logits whole


@torch.inference_mode()
def score_prompt(model, hidden: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
    """``hidden`` holds final states [>= len(targets), hidden] of consecutive prompt positions;
    position i's logits score ``targets[i]``, the prompt token after it."""
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    scored: list[TokenLogprobs] = []
    for start in range(0, len(targets), CHUNK):
        end = min(start + CHUNK, len(targets))
        raw = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
        scored.extend(gather_logprobs(raw, target_ids[start:end], [top] * (end - start)))
    return scored
