"""POST /v1/completions: a prompt (text or token ids) in, a completion out, whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from nanoserve.engine.sampler import TokenLogprobs
from nanoserve.serve import serving
from nanoserve.serve.protocol import CompletionRequest, sampling_params
from nanoserve.serve.serving import ServeState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(state: ServeState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    body.check_supported()
    prompt = body.single_prompt()
    requested = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = sampling_params(body, max_tokens=requested, logprobs=body.logprobs)  # validate first
    prompt_ids = serving.encode(state, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
    serving.resolve_max_tokens(state, len(prompt_ids), requested, "prompt")
    request_id, created = serving.new_id("cmpl")
    queue = await serving.submit(state, prompt_ids, params, request_id, "prompt")
    head = {"id": request_id, "object": "text_completion", "created": created, "model": state.model_name}
    if body.stream:
        chunks = _chunks(state, head, queue, len(prompt_ids), body.include_usage)
        return serving.sse_response(state, chunks, request_id)
    output = await serving.collect(state, queue, request_id, request)
    logprobs = None if output.logprobs is None else legacy_logprobs(state, output.logprobs, 0)[0]
    choice = {"index": 0, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
    return {**head, "choices": [choice], "usage": serving.usage(len(prompt_ids), len(output.token_ids))}


async def _chunks(state: ServeState, head: dict, queue: asyncio.Queue, prompt_len: int,
                  include_usage: bool) -> AsyncIterator[dict]:
    offset, completion_tokens = 0, 0
    async for delta in serving.deltas(state, queue, head["id"]):
        completion_tokens = len(delta.output.token_ids)
        logprobs = None
        if delta.logprobs is not None:
            logprobs, offset = legacy_logprobs(state, delta.logprobs, offset)
        elif not delta.text and not delta.output.finished:
            continue  # tokens whose text is still held back (a partial character, a possible stop)
        choice = {"index": 0, "text": delta.text, "logprobs": logprobs,
                  "finish_reason": serving.finish_reason(delta.output)}
        yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    if include_usage:
        yield {**head, "choices": [], "usage": serving.usage(prompt_len, completion_tokens)}


def legacy_logprobs(state: ServeState, logprobs: list[TokenLogprobs], offset: int) -> tuple[dict, int]:
    """The completions endpoint's (pre-chat) logprobs object, and the text offset after it."""
    tokens = [state.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    body = {
        "tokens": tokens,
        "token_logprobs": [serving.logprob_value(lp.logprob) for lp in logprobs],
        "top_logprobs": [{state.token_text(t): serving.logprob_value(v) for t, v in lp.top}
                         for lp in logprobs],
        "text_offset": offsets,
    }
    return body, offset
