"""The engine's side of speculation: after each step, what every decoding row proposes for
the next (a host proposer's tokens, or how many the worker's draft model is to draft, as many
as the row's adaptive length allows), and the counts.

The scheduler takes a row's ``spec_tokens`` (or ``spec_draft``) into the next plan (cutting
them to what fits); the worker drafts where a draft model proposes (speculative/draft.py),
writes K/V for all of them in one verify forward and accepts a prefix
(nanoserve.worker.acceptance); the scheduler trims the row to it. Which rows speculate is decided here:
none in a step of ``disable_by_batch_size`` rows or more, none under a grammar (this engine
does not check proposals against a grammar: a constrained row decodes one token a step), none
with fewer than two tokens left to emit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from nanoserve.speculative.adaptive import SpeculationLength
from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from nanoserve.engine.request import Request
    from nanoserve.worker.plan import StepPlan
    from nanoserve.worker.worker import StepOutput


# One more verified token's price in decode steps until one is measured (StepTimes): a step
# bound by reading the weights reads them once for all its tokens; a small model whose weights
# sit in the cache is compute-bound, and there a verified token costs a good part of a step.
VERIFY_COST = 0.1
DRAFT_COST = 0.25  # a draft step's price until one is measured (an int4 draft of an fp32 target)


class Proposer(Protocol):
    """A host-side proposer: up to ``ks[i]`` tokens for each request (fewer is fine), chosen
    deterministically (acceptance takes its law as one-hot)."""

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]: ...

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

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [self.lookup.propose(self._history(r), k) if k else [] for r, k in zip(requests, ks)]

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


class StepTimes:
    """Recent decode-only step times (no prefill chunk beside them), plain and verifying, and the
    queries a verifying row sent: what one more verified token costs here, in plain steps."""

    WEIGHT = 0.1  # of the newest step in the running means: the context grows as a reply does

    def __init__(self) -> None:
        self.plain = self.verify = self.extra = None

    def add(self, seconds: float, queries: int) -> None:
        def mean(old: float | None, new: float) -> float:
            return new if old is None else old + self.WEIGHT * (new - old)

        if queries == 1:
            self.plain = mean(self.plain, seconds)
        else:
            self.verify, self.extra = mean(self.verify, seconds), mean(self.extra, queries - 1)

    def token_cost(self) -> float | None:
        """A verified token's price in plain steps (None until both kinds of step were seen)."""
        if self.plain is None or self.verify is None:
            return None
        return min(max((self.verify / self.plain - 1.0) / self.extra, 0.02), 1.0)


class Speculator:
    """``proposer`` proposes on the host (the n-gram lookup); None: the worker's draft model
    does, in the verify step itself (speculative/draft.py), and this only sets how many."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config, self.proposer = config, proposer
        self.stats = SpecStats()
        self.times = StepTimes()
        self._lengths: dict[str, SpeculationLength] = {}
        self._draft_step_seconds, self._draft_steps = 0.0, 0  # the worker's draft's compiled-shape steps

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_tokens`` (or, for the worker's draft, ``spec_draft``) of the rows that
        decode next, in row order."""
        for request in requests:
            request.spec_tokens, request.spec_draft = [], 0
        if not requests or len(requests) >= self.config.disable_by_batch_size:
            return
        ks = [self._k(r) for r in requests]
        if not any(ks) or self.proposer is None:
            for request, k in zip(requests, ks):
                request.spec_draft = k
                if not k:
                    self._idle(request)
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(requests, ks)
        self.stats.draft_seconds += time.perf_counter() - start
        for request, k, tokens in zip(requests, ks, proposals):
            request.spec_tokens = list(tokens[:k])
            if not request.spec_tokens:
                self._idle(request)

    def seconds_per_token(self) -> float | None:
        """What proposing one more token of a row costs, once measured (None: not yet, or free)."""
        if self.proposer is not None:
            return self.proposer.seconds_per_token()
        return self._draft_step_seconds / self._draft_steps if self._draft_steps else None

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
            per_token, plain = self.seconds_per_token(), self.times.plain
            if self.config.method == "ngram":
                draft = 0.0
            elif per_token is not None and plain is not None:
                draft = per_token / plain
            else:
                draft = DRAFT_COST
            verify = self.times.token_cost()
            length = self._lengths[request_id] = SpeculationLength(
                self.config.num_speculative_tokens, (VERIFY_COST if verify is None else verify) + min(draft, 1.0))
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

    def update(self, plan: StepPlan, output: StepOutput, requests: list[Request]) -> None:
        """A step's outcome (``requests``: the plan's sampled ones): a decode step's price, then
        each verifying row's count of proposals that stood."""
        decode = plan.decode
        if decode is None:
            return
        if output.draft is not None:
            self.stats.draft_seconds += output.draft.seconds
            self._draft_step_seconds += output.draft.step_seconds
            self._draft_steps += output.draft.steps
        # A step beside prefill chunks, or one that built a graph or ran eagerly for want of one,
        # says nothing of a step's price.
        typical = not plan.prefill and not output.graphs_built and not output.eager_steps
        self.record_step(output.seconds, decode.queries, typical)
        if decode.queries > 1:
            for request, proposed, row in zip(requests, decode.num_proposed, output.rows):
                if proposed and row.error is None:
                    self.record(request, proposed, row.accepted)

    def record_step(self, seconds: float, queries: int, typical: bool) -> None:
        """A decode step's forward time, ``queries`` a row (1: no verify); only a ``typical``
        one (no prefill chunk beside it, no graph built in it) prices a verified token."""
        if queries > 1:
            self.stats.verify_steps += 1
            self.stats.verify_seconds += seconds
        if typical:
            self.times.add(seconds, queries)

    def forget(self, request_ids: set[str]) -> None:
        """The requests left: their adaptive lengths and the proposer's state for them go."""
        for request_id in request_ids:
            self._lengths.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_ids)

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()
