"""A request's life: its tokens, its row, its sampling state, and what it has produced."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from nanoserve.cache.prefix_cache import BlockHashes
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.worker.scoring import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no row (new, or preempted: its K/V is recomputed)
    PREFILLING = "prefilling"  # holds a row; some of its tokens' K/V are not computed yet
    RUNNING = "running"  # holds a row and decodes one token per step
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # scored chunk by chunk, at the first prefill
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None  # while it holds one, the block manager counts its K/V (blocks.num_tokens(row))
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    generator: torch.Generator | None = None
    # Text bookkeeping: output_text is everything decoded, emitted_chars what the caller has seen.
    output_text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    detokenizer: object | None = None
    block_hashes: BlockHashes | None = None  # its full blocks' prefix hashes, grown as it grows
    grammar: object | None = None  # its RequestGrammar when its params ask for structured output
    # Speculation: tokens proposed for the next decode step (the scheduler takes them), or how
    # many the worker's draft model is to propose there; and the positions [0, draft_computed)
    # whose K/V the draft holds (the scheduler's count: the draft catches up from there).
    spec_tokens: list[int] = field(default_factory=list)
    spec_draft: int = 0
    draft_computed: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    # Pooling (params.pooling): the pooled vector once the prompt is done; for mean pooling the
    # running sum over the positions computed so far and their count.
    pooled: torch.Tensor | None = None
    pooled_count: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The token a decode step feeds: the last one, whose K/V is not in the cache yet."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What a caller sees of a request: everything so far, and what is new since last time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    new_text: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_string: str | None = None  # the stop string that ended it, when one did
    pooled: torch.Tensor | None = None  # params.pooling's vector (float32, host), once finished
