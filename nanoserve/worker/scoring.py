"""Log-probabilities read off the model's outputs: a sampled token's (with its top
alternatives), and a prompt's (vLLM's ``prompt_logprobs``: how likely each prompt token was
given the ones before it, scored from a prefill chunk's hidden states by the worker)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 256  # positions scored at once: a long prompt never holds [len, vocab] logits whole


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the step's top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                    widths: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i's logprob of ``token_ids[i]`` under ``raw`` (log-softmaxed [n, vocab]) and its top
    ``widths[i]`` alternatives (at most the vocabulary); ``None`` where ``widths[i]`` is None."""
    vocab = raw.shape[-1]
    width = min(max(w or 0 for w in widths), vocab)
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = raw.topk(width, dim=-1) if width else (None, None)
    ids = token_ids.tolist()
    out: list[TokenLogprobs | None] = []
    for row, row_width in enumerate(widths):
        if row_width is None:
            out.append(None)
            continue
        top = []
        if row_width:
            top = list(zip(top_ids[row, :row_width].tolist(), top_values[row, :row_width].tolist()))
        out.append(TokenLogprobs(ids[row], chosen[row], top))
    return out


@torch.inference_mode()
def score_prompt(model, hidden: torch.Tensor, targets: tuple[int, ...] | list[int], top: int) -> list[TokenLogprobs]:
    """``hidden`` holds final states [>= len(targets), hidden] of consecutive prompt positions;
    position i's logits score ``targets[i]``, the prompt token after it."""
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    scored: list[TokenLogprobs] = []
    for start in range(0, len(targets), CHUNK):
        end = min(start + CHUNK, len(targets))
        raw = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
        scored.extend(gather_logprobs(raw, target_ids[start:end], [top] * (end - start)))
    return scored
