"""POST /v1/completions: a prompt (text or token ids) in, a completion out, whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request

from nanoserve.engine import RequestOutput
from nanoserve.serve import serving
from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import CompletionRequest, sampling_params
from nanoserve.serve.serving import ServeState
from nanoserve.serve.structured_fields import structure_for
from nanoserve.worker.scoring import TokenLogprobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(state: ServeState, body: CompletionRequest, request: Request):
    state.check_model(body.model)
    body.check_supported()
    prompts = body.prompts()
    requested = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    if requested == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 asks for no completion, which only makes sense with echo "
                            "(the prompt and, with logprobs, its own log-probabilities)",
                       param="max_tokens", code="invalid_value")
    # With echo, logprobs also scores the prompt's own tokens (evaluation harnesses' loglikelihood).
    params = sampling_params(body, max_tokens=requested, logprobs=body.logprobs,
                             prompt_logprobs=body.logprobs if body.echo else None)  # validate first
    params = replace(params, structured=await structure_for(state, body))
    if body.echo and not all(isinstance(prompt, str) for prompt in prompts):
        serving.need_tokenizer(state, "echo")  # token ids are echoed as their text
    prompt_ids = [await serving.encode(state, p, "prompt") if isinstance(p, str) else list(p) for p in prompts]
    for ids in prompt_ids:
        serving.resolve_max_tokens(state, len(ids), requested, "prompt")
    request_id, created = serving.new_id("cmpl")
    submitted: list[tuple[asyncio.Queue, str]] = []
    try:
        for index, ids in enumerate(prompt_ids):
            engine_id = request_id if len(prompt_ids) == 1 else f"{request_id}-{index}"
            submitted.append((await serving.submit(state, ids, params, engine_id, "prompt"), engine_id))
    except BaseException:  # a later prompt refused (or the client gone): none of them runs
        serving.abort_all(state, submitted)
        raise
    echoes = [None] * len(prompts)
    if body.echo:
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)]
    head = {"id": request_id, "object": "text_completion", "created": created, "model": state.model_name}
    if body.stream:  # one prompt (CompletionRequest.prompts)
        chunks = _chunks(state, head, submitted[0][0], prompt_ids[0], echoes[0], body.include_usage)
        return serving.sse_response(state, chunks, request_id)
    outputs = await serving.collect(state, request, submitted)
    choices = [_choice(state, index, output, ids, echo)
               for index, (output, ids, echo) in enumerate(zip(outputs, prompt_ids, echoes))]
    usage = serving.usage(sum(map(len, prompt_ids)), sum(len(output.token_ids) for output in outputs))
    return {**head, "choices": choices, "usage": usage}


def _choice(state: ServeState, index: int, output: RequestOutput, prompt_ids: list[int], echo: str | None) -> dict:
    text, ids, entries = output.text, output.token_ids, output.logprobs
    if echo is not None:
        text, ids = echo + text, prompt_ids + ids
        entries = None if entries is None else output.prompt_logprobs + entries
    logprobs = None if entries is None else legacy_logprobs(state, ids, entries, 0)[0]
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason}


async def _chunks(state: ServeState, head: dict, queue: asyncio.Queue, prompt_ids: list[int],
                  echo: str | None, include_usage: bool) -> AsyncIterator[dict]:
    offset, completion_tokens = 0, 0
    async for delta in serving.deltas(state, queue, head["id"]):
        completion_tokens = len(delta.output.token_ids)
        text, ids, entries = delta.text, delta.token_ids, delta.logprobs
        if echo is not None:  # the first chunk carries the prompt
            text, ids = echo + text, prompt_ids + ids
            entries = None if entries is None else delta.output.prompt_logprobs + entries
            echo = None
        logprobs = None
        if entries is not None:
            logprobs, offset = legacy_logprobs(state, ids, entries, offset)
        elif not text and not delta.output.finished:
            continue  # tokens whose text is still held back (a partial character, a possible stop)
        choice = {"index": 0, "text": text, "logprobs": logprobs,
                  "finish_reason": serving.finish_reason(delta.output)}
        yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    if include_usage:
        yield {**head, "choices": [], "usage": serving.usage(len(prompt_ids), completion_tokens)}


def legacy_logprobs(state: ServeState, token_ids: list[int], entries: list[TokenLogprobs | None],
                    offset: int) -> tuple[dict, int]:
    """The completions endpoint's (pre-chat) logprobs object over `token_ids`, and the text
    offset after it. An entry of None (an echoed prompt's first token) has null logprobs."""
    tokens = [state.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    body = {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else serving.logprob_value(lp.logprob) for lp in entries],
        "top_logprobs": [None if lp is None else {state.token_text(t): serving.logprob_value(v) for t, v in lp.top}
                         for lp in entries],
        "text_offset": offsets,
    }
    return body, offset
