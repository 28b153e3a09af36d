"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanoserve.structured.params import StructuredOutputs

INT64_MAX = 2**63 - 1  # every integer field must fit the int64 tensors the sampler builds
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes a uint64
# A reply's length when none is asked for: the command line's default too, so that a library
# call and `nanoserve generate` stop at the same place.
DEFAULT_MAX_TOKENS = 128
# What a prompt-only request returns instead of tokens (``pooling``): the final hidden state
# (after the final norm) at the last prompt token, their mean over the prompt, or at its first
# token; "rank": the logits at the last prompt token (a reranker's yes/no score is read there).
POOLING = ("last", "mean", "cls", "rank")

@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop logic.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` and ``min_p=0`` disable
    those filters. Penalties follow vLLM: repetition over prompt and output (divides
    positive logits, multiplies negative ones), presence and frequency over the output.
    ``logprobs=None`` returns none; ``logprobs=k`` returns the sampled token's logprob
    and the top ``k`` alternatives at each step. ``prompt_logprobs=k`` (as vLLM) returns each
    prompt token's logprob given the tokens before it (``None`` for the first) and the top
    ``k`` alternatives there. ``max_tokens=0`` only prefills: the request finishes after its
    prompt (with ``prompt_logprobs``, that scores the prompt; with ``pooling``, one of POOLING,
    its output carries the pooled vector: embeddings, rerank scores). ``structured`` constrains the
    reply to a JSON schema, regex, choice or grammar, token by token (the logprobs stay the
    model's own, before the constraint).

    Raises ``ValueError`` naming the field and its allowed range.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutputs | None = None
    pooling: str | None = None
    # The reply's text without the vocabulary's special tokens (a harmony reply keeps them: its
    # channels are special tokens).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists and a lone string for convenience; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, low=0)
        _check_range("temperature", self.temperature, 0.0, None, "a finite float >= 0 (0 is greedy)")
        _check_int("top_k", self.top_k, low=0, what="an int in [0, 2**63) (0 disables)")
        _check_range("top_p", self.top_p, 0.0, 1.0, "a float in (0, 1]", open_low=True)
        _check_range("min_p", self.min_p, 0.0, 1.0, "a float in [0, 1]")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None, "a finite float > 0",
                     open_low=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "a float in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a float in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=SEED_MAX, what="an int in [0, 2**64) or None")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, what="an int in [0, 2**63) or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, what="a list of ints in [0, 2**63)")
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise ValueError(f"pooling: must be one of {', '.join(POOLING)} or None, got {self.pooling!r}")
            if self.max_tokens != 0:
                raise ValueError(f"pooling: a pooled request only prefills (max_tokens=0), got {self.max_tokens}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError(f"structured: must be a StructuredOutputs or None, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_int(name: str, value: object, low: int, high: int = INT64_MAX, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be {what or f'an int in [{low}, 2**63)'}, got {value!r}")


def _check_range(name: str, value: object, low: float, high: float | None, what: str,
                 open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and (high is None or value <= high)
    if not ok:
        raise ValueError(f"{name}: must be {what}, got {value!r}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond any float
        return False
