"""Choosing a step's tokens on the worker, from the logits its forward left (they never leave it):
one token per sampled row (within its grammar's mask), or for a verifying row a prefix of its
proposals and one token of the target's (nanoserve.worker.acceptance).

The host hands over what sampling each row needs (``RowSampling``) and the step's masks, still
being filled beside the forward; the answer is one ``SampledRow`` per row of ``plan.sampled``.
A row whose sampling fails alone fails (its ``error``), the other rows keep their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve.structured.masks import PendingMasks, TokenMasks, split_masks
from nanoserve.worker.acceptance import verify
from nanoserve.worker.plan import StepPlan
from nanoserve.worker.sampler import Sampler, sample_isolated
from nanoserve.worker.scoring import TokenLogprobs

if TYPE_CHECKING:
    from nanoserve.engine.sampling_params import SamplingParams  # plain data: the type alone

History = tuple[list[int], list[int]]  # (prompt ids, output ids)


@dataclass
class RowSampling:
    """One sampled row's sampling: its params, its generator (a seeded request's), its history
    (read only when a row of its part of the step uses penalties) and, for a proposer that
    samples, the law [k, vocab] its proposals were drawn from (None: deterministic)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    history: History | None = None
    draft_probs: torch.Tensor | None = None


@dataclass
class StepSampling:
    """A step's sampling: one ``RowSampling`` per ``plan.sampled`` row, in its order, and the masks
    of the rows a grammar constrains (None: no row is constrained)."""

    rows: list[RowSampling]
    masks: PendingMasks | None = None


@dataclass
class SampledRow:
    """A sampled row's tokens: one, or a verifying row's accepted proposals and the target's
    token after them; the model's raw logprobs of each (None where not asked). ``error``: the
    row's sampling failed (no tokens). ``ranked``: a reranking row's logits, float32 on the host."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    accepted: int = 0
    error: str | None = None
    ranked: torch.Tensor | None = None


def sample_step(sampler: Sampler, plan: StepPlan, logits: torch.Tensor, sampling: StepSampling,
                masks: TokenMasks | None) -> list[SampledRow]:
    """Every sampled row's tokens. ``logits`` are in the plan's ``sampled`` order (a verifying
    row's 1 + k in a run); in a verify step the decode rows verify, then the other rows sample."""
    rows = sampling.rows
    verifying = plan.decode.num_rows if plan.decode is not None and plan.decode.queries > 1 else 0
    sampled: list[SampledRow] = []
    if verifying:
        split = plan.decode.num_tokens
        head, masks = split_masks(masks, verifying)
        sampled += _verify(sampler, logits[:split], plan.decode.proposals, rows[:verifying], head)
        logits = logits[split:]
    if rows[verifying:]:
        sampled += _sample(sampler, logits, rows[verifying:], masks)
    return sampled


def _histories(rows: list[RowSampling]) -> list[History] | None:
    return [r.history for r in rows] if any(r.params.uses_penalties for r in rows) else None


def _sample(sampler: Sampler, logits: torch.Tensor, rows: list[RowSampling], masks: TokenMasks | None
            ) -> list[SampledRow]:
    params = [r.params for r in rows]
    # A reranking row's logits are its output: copied before sampling (which may filter in place).
    ranked = {i: logits[i].float().cpu().clone() for i, p in enumerate(params) if p.pooling == "rank"}
    token_ids, logprobs, bad = sample_isolated(sampler, logits, params, [r.generator for r in rows],
                                               _histories(rows), masks)
    return [SampledRow([] if i in bad else [token_id], [] if i in bad else [logprob], error=bad.get(i),
                       ranked=ranked.get(i))
            for i, (token_id, logprob) in enumerate(zip(token_ids.tolist(), logprobs))]


def _verify(sampler: Sampler, logits: torch.Tensor, proposals: tuple[tuple[int, ...], ...],
            rows: list[RowSampling], masks: TokenMasks | None) -> list[SampledRow]:
    proposals = [list(p) for p in proposals]
    draft = [r.draft_probs[:len(p)] if p and r.draft_probs is not None else None for r, p in zip(rows, proposals)]
    verdicts, bad = verify(sampler, logits, proposals, [r.params for r in rows], [r.generator for r in rows],
                           _histories(rows), masks, draft if any(q is not None for q in draft) else None)
    return [SampledRow([], error=bad.get(i, "verification failed")) if verdict is None
            else SampledRow(verdict.token_ids, verdict.logprobs, verdict.accepted)
            for i, verdict in enumerate(verdicts)]
