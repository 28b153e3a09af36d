"""The engine's side of speculation: after each step, what every decoding row proposes for
the next (a proposer's tokens, as many as the row's adaptive length allows), and the counts.

The scheduler takes a row's ``spec_tokens`` into the next plan (cutting them to what fits);
the worker writes K/V for all of them in one verify forward; the engine accepts a prefix
(nanoserve.engine.acceptance) and trims the row to it. Which rows speculate is decided here:
none in a step of ``disable_by_batch_size`` rows or more, none under a grammar (this engine
does not check proposals against a grammar: a constrained row decodes one token a step), none
with fewer than two tokens left to emit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from nanoserve.spec.adaptive import SpeculationLength
from nanoserve.spec.config import SpeculativeConfig
from nanoserve.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from nanoserve.engine.request import Request


# One more verified token's price in decode steps: a small-batch CPU step is bound by reading the
# weights, which a verify reads once for all its tokens.
VERIFY_COST = 0.1
DRAFT_COST = 0.25  # a draft step's price until one is measured (an int4 draft of an fp32 target)


class Proposer(Protocol):
    """Proposes up to ``ks[i]`` tokens for each request (fewer is fine), and for a proposer that
    samples, the distributions [k, vocab] it sampled them from (None: deterministic)."""

    def propose(self, requests: list[Request], ks: list[int]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]: ...

    def forget(self, request_ids: set[str]) -> None: ...

    def seconds_per_token(self) -> float | None:
        """What proposing one more token of a row costs, once measured (None: not yet, or free)."""

    def close(self) -> None: ...


class NgramProposals:
    """Prompt lookup over each row's own history (no model). Each request's tokens are kept in
    a growing array, appended to as the request grows: turning the whole history into an
    array every step would cost more than the lookup itself."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self._histories: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        return [self.lookup.propose(self._history(r), k) if k else [] for r, k in zip(requests, ks)], [None] * len(ks)

    def _history(self, request: Request) -> np.ndarray:
        buffer, held = self._histories.get(request.request_id, (None, 0))
        total = request.num_tokens
        if buffer is None or total > len(buffer):
            grown = np.empty(max(2 * total, 256), dtype=np.int64)
            grown[:held] = buffer[:held] if buffer is not None else []
            buffer = grown
        if held < total:  # a request only grows: prompt first, then outputs
            prompt = len(request.prompt_token_ids)
            if held < prompt:
                buffer[held:prompt] = request.prompt_token_ids[held:]
                held = prompt
            buffer[held:total] = request.output_token_ids[held - prompt:]
        self._histories[request.request_id] = (buffer, total)
        return buffer[:total]

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._histories.pop(request_id, None)

    def seconds_per_token(self) -> float | None:
        """A lookup is free beside a step."""
        return None

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class SpecStats:
    """vLLM's counters: tokens proposed and accepted, rows that verified (``verify_rows``: each
    emits its accepted tokens and one of the target's), and the time the proposer and the
    verify steps took."""

    verify_steps: int = 0
    verify_rows: int = 0
    drafted: int = 0  # tokens the proposer returned (some are cut before the verify)
    proposed: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying row emits per step: its accepted proposals and the target's own."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.stats = SpecStats()
        self._lengths: dict[str, SpeculationLength] = {}

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_tokens`` (and ``spec_probs``) of the rows that decode next, in row order."""
        for request in requests:
            request.spec_tokens, request.spec_probs = [], None
        if not requests or len(requests) >= self.config.disable_by_batch_size:
            return
        ks = [self._k(r) for r in requests]
        if not any(ks):
            for request in requests:
                self._idle(request)
            return
        start = time.perf_counter()
        proposals, probs = self.proposer.propose(requests, ks)
        self.stats.draft_seconds += time.perf_counter() - start
        self.stats.drafted += sum(min(len(tokens), k) for tokens, k in zip(proposals, ks))
        for request, k, tokens, q in zip(requests, ks, proposals, probs):
            request.spec_tokens = list(tokens[:k])
            request.spec_probs = None if q is None or not request.spec_tokens else q[:len(request.spec_tokens)]
            if not request.spec_tokens:
                self._idle(request)

    def _k(self, request: Request) -> int:
        left = request.params.max_tokens - len(request.output_token_ids)
        if request.grammar is not None or left < 2:
            return 0
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            k = self._length(request.request_id).next_k()
        return min(k, left - 1)

    def _length(self, request_id: str) -> SpeculationLength:
        """The request's adaptive length, made with the price of one more proposed token as
        measured so far (in verify steps): verifying it (VERIFY_COST) and, for a draft model,
        drafting it."""
        length = self._lengths.get(request_id)
        if length is None:
            s, per_token = self.stats, self.proposer.seconds_per_token()
            if self.config.method == "ngram":
                draft = 0.0
            elif per_token is not None and s.verify_steps:
                draft = per_token / (s.verify_seconds / s.verify_steps)
            else:
                draft = DRAFT_COST
            length = self._lengths[request_id] = SpeculationLength(self.config.num_speculative_tokens,
                                                                   VERIFY_COST + min(draft, 1.0))
        return length

    def _idle(self, request: Request) -> None:
        """The row's next step verifies nothing: the wait before its next probe counts it."""
        if request.request_id in self._lengths:
            self._lengths[request.request_id].record(0, 0)

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """A verify step's outcome for one row (its adaptive length learns from it)."""
        self.stats.verify_rows += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        if self.config.adaptive:
            self._length(request.request_id).record(proposed, accepted)

    def record_step(self, seconds: float) -> None:
        self.stats.verify_steps += 1
        self.stats.verify_seconds += seconds

    def forget(self, request_ids: set[str]) -> None:
        """The requests left: their adaptive lengths and the proposer's state for them go."""
        for request_id in request_ids:
            self._lengths.pop(request_id, None)
        self.proposer.forget(request_ids)

    def close(self) -> None:
        self.proposer.close()
