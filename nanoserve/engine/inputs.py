"""Input processing: a prompt (text or token ids) and its sampling parameters become a Request,
or a RequestError saying why it cannot be served."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.engine.request import Request
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.formats.tokenizer import IncrementalDetokenizer

Prompt = str | Sequence[int]


class RequestError(ValueError):
    """A request that cannot be served (too long, empty, bad ids). It fails alone."""


def unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone UTF-16 surrogate can be neither tokenized nor
    sent back as UTF-8), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode text ({exc.reason} at character {exc.start})"
    return None


class InputProcessor:
    """Tokenizes and validates prompts against the model's vocabulary and ``max_model_len``."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, device: str) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len, self.device = tokenizer, vocab_size, max_model_len, device

    def request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """A new Request (its seeded generator and detokenizer set up). Raises RequestError."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids)
        request = Request(request_id, token_ids, params, prompt=text)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        return request

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer; pass token ids instead")
            if (problem := unicode_problem(prompt)) is not None:
                raise RequestError(f"prompt: {problem}")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        limit = self.max_model_len
        if len(token_ids) >= limit:
            raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {limit}, "
                               f"so a prompt may have at most {limit - 1} (one slot for the reply)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:8]}")


def as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (text, or token ids) or a list of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # one prompt given as token ids
        return [prompts]
    return prompts
