"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): how likely each prompt token was
given the ones before it, read off the prefill's hidden states."""

from __future__ import annotations

import torch

from nanoserve.engine.plan import PrefillChunk
from nanoserve.engine.request import Request
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


def score_chunk(model, request: Request, chunk: PrefillChunk, hidden: torch.Tensor) -> str | None:
    """Score the prompt tokens a chunk covers into ``request.prompt_logprobs``; the error
    message if scoring raised (the request's own work: it fails alone), else None."""
    # Position p's logits score prompt token p + 1: this chunk scores tokens start + 1 ..
    prompt = request.prompt_token_ids
    targets = prompt[chunk.start + 1:min(chunk.end, len(prompt) - 1) + 1]
    # A prefill restarted by preemption rescores from its start: the same positions, the same values.
    scored = (request.prompt_logprobs or [None])[:chunk.start + 1]
    try:
        request.prompt_logprobs = scored + score_prompt(model, hidden, targets, request.params.prompt_logprobs)
    except Exception as exc:
        return f"prompt scoring failed: {type(exc).__name__}: {exc}"
    return None
