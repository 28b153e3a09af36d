"""POST /tokenize and /detokenize, as vLLM serves them: the served model's tokenizer over HTTP
(clients count tokens, or map ids back to text, without a tokenizer of their own)."""

from __future__ import annotations

from nanoserve.serve import serving
from nanoserve.serve.chat import render_chat
from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import DetokenizeRequest, TokenizeRequest
from nanoserve.serve.serving import ServeState


async def tokenize(state: ServeState, body: TokenizeRequest) -> dict:
    if body.model is not None:
        state.check_model(body.model)
    body.check_supported()
    if body.messages is not None:
        text = await render_chat(state, body.messages, body.add_generation_prompt)
        special = bool(body.add_special_tokens)  # the template already wrote its special tokens
    else:
        text = body.prompt
        special = body.add_special_tokens is not False
    param = "prompt" if body.prompt is not None else "messages"
    tokens = await serving.encode(state, text, param, add_special_tokens=special)
    strs = [state.token_text(t) for t in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": strs}


async def detokenize(state: ServeState, body: DetokenizeRequest) -> dict:
    if body.model is not None:
        state.check_model(body.model)
    tokenizer = serving.need_tokenizer(state, "tokens")
    vocab = state.engine_loop.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens: ids out of the vocabulary [0, {vocab}): {bad[:8]}", param="tokens",
                       code="invalid_value")
    return {"prompt": tokenizer.decode(body.tokens)}
