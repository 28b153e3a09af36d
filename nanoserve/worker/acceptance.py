"""Exact acceptance of speculative proposals, on the worker: the target's logits at each row's
1 + k positions decide how many of the row's k proposals stand, and give one more token.

Contract: every emitted token has the law non-speculative decoding would give it (greedy rows:
the same tokens). Proposal x ~ q is kept with probability min(1, p(x)/q(x)), giving y the mass
min(p(y), q(y)); a rejection (mass sum max(0, p - q)) redraws from max(0, p - q), adding the rest
of p(y) (Leviathan et al. 2023; Chen et al. 2023). A deterministic proposer is q one-hot on x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoserve.structured.masks import TokenMasks
from nanoserve.worker.sampler import Sampler, inverse_cdf_draw
from nanoserve.worker.scoring import TokenLogprobs, gather_logprobs

if TYPE_CHECKING:
    from nanoserve.engine.sampling_params import SamplingParams  # plain data: the type alone

__all__ = ["RowVerdict", "verify"]

History = tuple[list[int], list[int]]  # (prompt ids, output ids)


@dataclass
class RowVerdict:
    token_ids: list[int]  # the accepted proposals, then one token of the target's (len = accepted + 1)
    logprobs: list[TokenLogprobs | None]  # one per token, the model's raw logprobs as without speculation
    accepted: int  # proposals accepted


def verify(sampler: Sampler, logits: torch.Tensor, proposals: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None], histories: list[History] | None = None,
           masks: TokenMasks | None = None, draft_probs: list[torch.Tensor | None] | None = None
           ) -> tuple[list[RowVerdict | None], dict[int, str]]:
    """Each row's verdict, and the rows that failed (row -> message; their verdict is None).

    ``logits`` [sum(1 + k_r), vocab]: row r's positions in order from offset sum_{s<r}(1 + k_s);
    position j scores the token proposal j claims, position k_r the token after them all.
    ``histories[r]`` (read only if a row uses penalties) is row r's (prompt, output) before its
    proposals; position j sees output + proposals[r][:j]. ``masks`` are over rows; a masked row
    may have no proposals. ``draft_probs[r]`` [k_r, vocab] is the law proposal j was drawn from
    (None, or no list: a deterministic proposer). A seeded row draws only from its generator.

    Raises ValueError for a call that breaks the contract as a whole (lengths, a masked row
    with proposals). As ``sample_isolated``: if the batch raises, each row is redone alone (its
    generator rewound first), so only a row that fails on its own fails.
    """
    n = len(params)
    proposals = [list(row) for row in proposals]  # tuples welcome; sliced and joined below
    if not (len(proposals) == len(generators) == n) or (histories is not None and len(histories) != n) \
            or (draft_probs is not None and len(draft_probs) != n):
        raise ValueError("proposals, params, generators (and histories, draft_probs) need one entry per row")
    counts = [1 + len(row) for row in proposals]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits hold {logits.shape[0]} positions; the proposals need {sum(counts)}")
    if masks is not None and any(proposals[r] for r in masks.rows):
        raise ValueError("a row under a token mask cannot have proposals")
    if n == 0:
        return [], {}
    states = [None if g is None else g.get_state() for g in generators]
    try:
        return _verify_rows(sampler, logits, proposals, params, generators, histories, masks, draft_probs), {}
    except Exception:  # find the rows at fault below
        pass
    verdicts: list[RowVerdict | None] = [None] * n
    failed: dict[int, str] = {}
    start = 0
    for row, (generator, state) in enumerate(zip(generators, states)):
        end = start + counts[row]
        if generator is not None:
            generator.set_state(state)
        try:
            verdicts[row] = _verify_rows(
                sampler, logits[start:end], [proposals[row]], [params[row]], [generator],
                None if histories is None else [histories[row]], None if masks is None else masks.select(row),
                None if draft_probs is None else [draft_probs[row]])[0]
        except Exception as exc:
            failed[row] = f"verification failed: {type(exc).__name__}: {exc}"
        start = end
    return verdicts, failed


def _verify_rows(sampler: Sampler, logits: torch.Tensor, proposals: list[list[int]], params: list[SamplingParams],
                 generators: list[torch.Generator | None], histories: list[History] | None,
                 masks: TokenMasks | None, draft_probs: list[torch.Tensor | None] | None) -> list[RowVerdict]:
    """The whole batch at once: every position processed in one sampler pass, every proposal
    tested in one [rows, max k] comparison, every final token drawn in one race."""
    device, vocab = logits.device, logits.shape[-1]
    ks = [len(row) for row in proposals]
    offsets = [0]
    for k in ks:
        offsets.append(offsets[-1] + 1 + k)
    for r, row in enumerate(proposals):
        if any(not 0 <= t < vocab for t in row):
            raise ValueError(f"row {r}: a proposal lies outside the vocabulary of {vocab}")
    # Position j of row r is processed as the plain sampler would, had proposals[r][:j] been sampled.
    pos_params = [p for p, k in zip(params, ks) for _ in range(k + 1)]
    pos_histories = None
    if histories is not None and any(p.uses_penalties for p in params):
        pos_histories = [(prompt, list(output) + row[:j])
                         for (prompt, output), row in zip(histories, proposals) for j in range(len(row) + 1)]
    pos_masks = None if masks is None else TokenMasks([offsets[r] for r in masks.rows], masks.bitmask)
    logits = logits.float()
    sampling = [r for r, p in enumerate(params) if not p.greedy]
    if sampling:
        processed, probs = sampler.distribution(logits, pos_params, pos_histories, pos_masks)
    else:
        processed, probs = sampler.process(logits, pos_params, pos_histories, pos_masks), None
    # [positions]; a batch with no greedy row needs none (sampling rows overwrite theirs below).
    greedy_ids = processed.argmax(dim=-1) if len(sampling) < len(params) \
        else torch.zeros(processed.shape[0], dtype=torch.long, device=device)

    accepted = _count_accepted(proposals, params, generators, draft_probs, offsets, greedy_ids, probs)
    final_pos = torch.tensor([offsets[r] + a for r, a in enumerate(accepted)], device=device)
    final = greedy_ids[final_pos]
    if sampling:
        rows = torch.tensor(sampling, device=device)
        law = _final_law(probs[final_pos[rows]], [proposals[r] for r in sampling], [accepted[r] for r in sampling],
                         None if draft_probs is None else [draft_probs[r] for r in sampling])
        final[rows] = inverse_cdf_draw(law, [generators[r] for r in sampling])
    final_ids = final.tolist()

    tokens = [row[:a] + [t] for row, a, t in zip(proposals, accepted, final_ids)]
    logprobs: list[list[TokenLogprobs | None]] = [[None] * len(t) for t in tokens]
    if any(p.logprobs is not None for p in params):
        # The model's own logprobs (before masks and penalties), as the plain sampler gives them:
        # one gather over every emitted token, token i of row r scored at position offsets[r] + i.
        at = torch.tensor([offsets[r] + i for r, t in enumerate(tokens) for i in range(len(t))], device=device)
        flat = torch.tensor([x for t in tokens for x in t], device=device)
        raw = torch.log_softmax(logits[at], dim=-1)
        gathered = iter(gather_logprobs(raw, flat, [p.logprobs for p, t in zip(params, tokens) for _ in t]))
        logprobs = [[next(gathered) for _ in t] for t in tokens]
    return [RowVerdict(t, lp, a) for t, lp, a in zip(tokens, logprobs, accepted)]


def _count_accepted(proposals: list[list[int]], params: list[SamplingParams],
                    generators: list[torch.Generator | None], draft_probs: list[torch.Tensor | None] | None,
                    offsets: list[int], greedy_ids: torch.Tensor, probs: torch.Tensor | None) -> list[int]:
    """Each row's count of leading proposals that stand: greedy rows keep a proposal equal to
    the argmax; sampling rows keep x when u * q(x) < p(x), u ~ U[0, 1) (min(1, p/q), q(x) = 1
    for a deterministic proposer). A sampling row draws its k uniforms whether or not it needs
    them all, so its generator advances the same however its proposals fare."""
    n, width = len(proposals), max((len(row) for row in proposals), default=0)
    if width == 0:
        return [0] * n
    device = greedy_ids.device
    ks = torch.tensor([len(row) for row in proposals], device=device)
    valid = torch.arange(width, device=device).unsqueeze(0) < ks.unsqueeze(1)  # [n, width]
    claimed = torch.tensor([row + [0] * (width - len(row)) for row in proposals], device=device)
    # Proposal j of row r is scored at offsets[r] + j; padding points at the row's first position.
    at = torch.tensor(offsets[:-1], device=device).unsqueeze(1) + torch.arange(width, device=device) * valid
    keep = greedy_ids[at] == claimed
    sampling = [r for r, p in enumerate(params) if not p.greedy and proposals[r]]
    if sampling:
        target = probs[at, claimed]  # p(x) [n, width]
        draft = torch.ones(n, width, device=device)
        uniform = torch.zeros(n, width, device=device)
        if any(generators[r] is None for r in sampling):
            uniform = torch.rand(n, width, device=device)
        for r in sampling:
            k = len(proposals[r])
            if generators[r] is not None:
                uniform[r, :k] = torch.rand(k, generator=generators[r], device=device)
            if draft_probs is not None and draft_probs[r] is not None:
                q = _draft_rows(draft_probs[r], k, probs.shape[-1], device)
                draft[r, :k] = q.gather(1, claimed[r, :k].unsqueeze(1)).squeeze(1)
        is_sampling = torch.zeros(n, dtype=torch.bool, device=device)
        is_sampling[sampling] = True
        keep = torch.where(is_sampling.unsqueeze(1), uniform * draft < target, keep)
    # A proposal stands only if every one before it stood.
    return (keep & valid).long().cumprod(dim=1).sum(dim=1).tolist()


def _final_law(target: torch.Tensor, proposals: list[list[int]], accepted: list[int],
               draft_probs: list[torch.Tensor | None] | None) -> torch.Tensor:
    """The law of each sampling row's last token [rows, vocab]: p at the first rejected
    position with the rejected proposal's q taken out (max(0, p - q), normalised; p itself where
    that is all zero), or p at position k after every proposal stood."""
    n, vocab = target.shape
    device = target.device
    draft = torch.zeros_like(target)
    rejected = torch.zeros(n, dtype=torch.bool, device=device)
    one_hot_rows, one_hot_ids = [], []
    for i, (row, a) in enumerate(zip(proposals, accepted)):
        if a == len(row):
            continue
        rejected[i] = True
        q = None if draft_probs is None else draft_probs[i]
        if q is None:
            one_hot_rows.append(i)
            one_hot_ids.append(row[a])
        else:
            draft[i] = _draft_rows(q, len(row), vocab, device)[a]
    if one_hot_rows:
        draft[one_hot_rows, one_hot_ids] = 1.0
    residual = (target - draft).clamp_(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    use = rejected.unsqueeze(1) & (mass > 0)
    return torch.where(use, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target)


def _draft_rows(q: torch.Tensor, k: int, vocab: int, device: torch.device) -> torch.Tensor:
    if tuple(q.shape) != (k, vocab):
        raise ValueError(f"draft probs are {tuple(q.shape)}; the row's proposals need ({k}, {vocab})")
    return q.to(device=device, dtype=torch.float32)
