"""What both generation endpoints share: checking a prompt against the context, submitting it
to the engine loop, and reading its outputs back as one final result or as merged deltas."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from nanoserve.engine import RequestError, RequestOutput, SamplingParams
from nanoserve.serve.engine_loop import EngineLoop, EngineStopped, Overloaded
from nanoserve.serve.errors import ApiError, quoted
from nanoserve.serve.limits import RETRY_AFTER_SECONDS
from nanoserve.worker.scoring import TokenLogprobs

logger = logging.getLogger("nanoserve.serve")
MIN_LOGPROB = -9999.0  # JSON has no -inf; a token the filters removed gets this
COMPILE_TIMEOUT = 10.0  # seconds a request's grammar may take to compile before it is refused


@dataclass
class ServeState:
    """What the handlers need; one per app."""

    engine_loop: EngineLoop
    model_name: str
    compile_timeout: float = COMPILE_TIMEOUT
    tool_call_parser: str | None = None  # a tool-call format by name; None: chosen from the chat template
    pooling: str | None = None  # what /v1/embeddings and /v1/rerank pool with (None: they are refused)

    @property
    def tokenizer(self):
        return self.engine_loop.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine_loop.engine.resolved.max_model_len

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"The model {quoted(model)} does not exist; this server serves "
                                f"`{self.model_name}` (see GET /v1/models)", param="model",
                           code="model_not_found")

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs; ids stand in when there is no tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def new_id(prefix: str, sep: str = "-") -> tuple[str, int]:
    return f"{prefix}{sep}{uuid.uuid4().hex}", int(time.time())


def need_tokenizer(state: ServeState, param: str):
    if state.tokenizer is None:
        raise ApiError(400, f"{param}: this server's model has no tokenizer, so text cannot be served; "
                            "send a prompt of token ids to /v1/completions", param=param,
                       code="invalid_value")
    return state.tokenizer


async def encode(state: ServeState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, computed in a worker thread: a multi-megabyte prompt must not stall
    the event loop (and with it every other client)."""
    tokenizer = need_tokenizer(state, param)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


def resolve_max_tokens(state: ServeState, prompt_len: int, requested: int | None, prompt_param: str) -> int:
    """The reply's token budget (all the room left when not given); a 400 with OpenAI's
    `context_length_exceeded` code if the prompt, or prompt plus reply, cannot fit."""
    limit = state.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, and the prompt has "
                            f"{prompt_len}: shorten it to at most {limit - 1} tokens "
                            "(one slot for the reply)",
                       param=prompt_param, code="context_length_exceeded")
    room = limit - prompt_len
    if requested is not None and requested > room:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                            f"{prompt_len}, so max_tokens can be at most {room}, got {requested}",
                       param="max_tokens", code="context_length_exceeded")
    return room if requested is None else requested


async def submit(state: ServeState, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 prompt_param: str) -> asyncio.Queue:
    try:
        return await state.engine_loop.add(prompt_ids, params, request_id)
    except RequestError as exc:  # empty prompt, ids outside the vocabulary
        message = str(exc) if str(exc).startswith(prompt_param) else f"{prompt_param}: {exc}"
        raise ApiError(400, message, param=prompt_param, code="invalid_value") from exc
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="engine_unavailable") from exc
    except Overloaded as exc:
        raise ApiError(503, str(exc), code="server_overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from exc


def check_output(output: RequestOutput | BaseException) -> RequestOutput:
    if isinstance(output, EngineStopped):  # shutting down, or the engine faulted: try elsewhere
        raise ApiError(503, str(output), code="engine_unavailable")
    if isinstance(output, BaseException):
        raise ApiError(500, f"generation failed: {output}", code="engine_error")
    if output.finish_reason == "error":
        raise ApiError(500, f"generation failed: {output.error}", code="engine_error")
    return output


async def collect(state: ServeState, request: Request,
                  submitted: list[tuple[asyncio.Queue, str]]) -> list[RequestOutput]:
    """Wait for each submitted request's (queue, id) finished output; abort them all if the
    client hangs up first (a 499 nobody reads, counted as a disconnect)."""
    # One task over every queue, not gather(): a cancelled gather holds a CancelledError that
    # nobody retrieves, and asyncio logs it as an error.
    results = asyncio.ensure_future(_last_outputs([queue for queue, _ in submitted]))
    hangup = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({results, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not results.done():
            results.cancel()
            abort_all(state, submitted)
    if not results.done():  # the hang-up came first
        if (error := hangup.exception()) is not None:  # a broken receive channel is no hang-up: loud
            raise error
        state.engine_loop.metrics.record_disconnect()
        logger.debug("client hung up: aborted %s", ", ".join(request_id for _, request_id in submitted))
        raise ApiError(499, "client closed the request")
    return [check_output(output) for output in results.result()]


def abort_all(state: ServeState, submitted: list[tuple[asyncio.Queue, str]]) -> None:
    for _, request_id in submitted:
        state.engine_loop.abort(request_id)


async def _last_outputs(queues: list[asyncio.Queue]) -> list[RequestOutput | BaseException]:
    return [await _last_output(queue) for queue in queues]


async def _last_output(queue: asyncio.Queue) -> RequestOutput | BaseException:
    while True:
        output = await queue.get()
        if isinstance(output, BaseException) or output.finished:
            return output


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Delta:
    """What a stream chunk carries: new text, ids and logprobs merged over the outputs waiting,
    plus the latest output (finish state, cumulative token count)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    output: RequestOutput


async def deltas(state: ServeState, queue: asyncio.Queue, request_id: str) -> AsyncIterator[Delta]:
    """The request's outputs as deltas. Outputs that queued up while the client was slow are
    merged into one delta, so a slow reader costs fewer chunks, not more. Leaving early
    (a closed stream cancels us) aborts the request."""
    finished = False
    try:
        while not finished:
            outputs = [await queue.get()]
            while not queue.empty():
                outputs.append(queue.get_nowait())
            last = check_output(outputs[-1])
            for output in outputs[:-1]:
                check_output(output)
            token_ids = [t for output in outputs for t in output.new_token_ids]
            logprobs = None
            if last.logprobs is not None:
                logprobs = last.logprobs[len(last.token_ids) - len(token_ids):len(last.token_ids)]
            finished = last.finished
            yield Delta("".join(o.new_text for o in outputs), token_ids, logprobs, last)
    finally:
        if not finished:
            state.engine_loop.abort(request_id)


class OpenAISse:
    """OpenAI's server-sent events: one `data:` line per dict, ending `data: [DONE]`; an error
    once the stream has begun goes in-band as a `data:` line of its error body."""

    @staticmethod
    def event(event: dict) -> str:
        return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"

    @staticmethod
    def error(exc: ApiError) -> str:
        return f"data: {json.dumps(exc.body())}\n\n"

    done = "data: [DONE]\n\n"


def named_event(event: tuple[str, dict]) -> str:
    """One server-sent event with a name: `event: NAME` then `data: JSON`."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicSse:
    """Anthropic's server-sent events: `event: NAME` then `data: JSON` for each (NAME, dict),
    an `error` event once the stream has begun, and no terminator (message_stop ends it)."""

    event = staticmethod(named_event)

    @staticmethod
    def error(exc: ApiError) -> str:
        return f"event: error\ndata: {json.dumps(exc.anthropic_body())}\n\n"

    done = ""


def sse_response(state: ServeState, events: AsyncIterator, request_id: str, wire=OpenAISse) -> StreamingResponse:
    """Server-sent events in `wire`'s format (OpenAI's by default). A client that leaves before
    the end is counted as a disconnect. The background abort covers a client that leaves before
    the first event (deltas aborts the others; a no-op once finished)."""
    stream = _SseStream(events, wire)

    async def after() -> None:
        if not stream.complete:
            state.engine_loop.metrics.record_disconnect()
            logger.debug("client hung up: aborted %s", request_id)
        state.engine_loop.abort(request_id)

    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(after))


class _SseStream:
    """The events as SSE text; `complete` once the end is produced."""

    def __init__(self, events: AsyncIterator, wire) -> None:
        self.events = events
        self.wire = wire
        self.complete = False

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for event in self.events:
                yield self.wire.event(event)
        except ApiError as exc:  # headers are gone already: report in-band, as OpenAI and Anthropic do
            yield self.wire.error(exc)
        self.complete = True
        if self.wire.done:
            yield self.wire.done


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None


def logprob_value(value: float) -> float:
    return max(float(value), MIN_LOGPROB)

