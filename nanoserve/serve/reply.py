"""A chat reply as one protocol-free record, between the engine and the wire.

The engine gives text; the request's ReplyShape (chat_reply.py) reads it back into reasoning,
an answer and tool calls. ``Reply`` is that whole reply and ``ReplyDelta`` one step of it while
it streams. A route renders them in its own protocol: OpenAI chat (chat.py) and Anthropic
Messages (messages.py); neither reads the engine's outputs itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nanoserve.engine import RequestOutput
from nanoserve.serve import serving
from nanoserve.serve.chat_reply import ReplyShape
from nanoserve.serve.serving import ServeState
from nanoserve.serve.tool_calling import ToolReplyStream
from nanoserve.structured.harmony import HarmonyStream
from nanoserve.structured.reasoning import ReasoningStream
from nanoserve.structured.tools import ToolCall
from nanoserve.worker.scoring import TokenLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Reply:
    """A whole reply. ``finish_reason``: "stop" (the model ended, or ``stop_sequence`` did),
    "length" (its budget), or "tool_calls" (it called tools and ended)."""

    text: str | None  # the answer; None when the reply ended inside its reasoning
    reasoning: str | None  # None: the reply had no reasoning
    tool_calls: list[ToolCall]
    finish_reason: str | None
    stop_sequence: str | None
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class ReplyDelta:
    """One step of a streamed reply; a renderer turns each into its protocol's event(s). It
    carries reasoning, or text (and the logprobs of the tokens it came from), or one whole tool
    call (``tool_index``: its place among the reply's calls); the last delta (``final``) carries
    the finish reason (and may carry text and logprobs too). ``completion_tokens`` counts the
    reply's tokens so far."""

    completion_tokens: int
    reasoning: str = ""
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    tool_call: ToolCall | None = None
    tool_index: int = 0
    final: bool = False
    finish_reason: str | None = None
    stop_sequence: str | None = None


def whole_reply(shape: ReplyShape, output: RequestOutput, prompt_tokens: int) -> Reply:
    reasoning, text, calls, finish_reason = shape.read(output.text, output.finish_reason)
    return Reply(text, reasoning, calls, finish_reason, _stop_sequence(output, finish_reason),
                 Usage(prompt_tokens, len(output.token_ids)), output.logprobs)


def _stop_sequence(output: RequestOutput, finish_reason: str | None) -> str | None:
    return output.stop_string if finish_reason == "stop" else None


async def reply_deltas(state: ServeState, queue: asyncio.Queue, request_id: str,
                       shape: ReplyShape) -> AsyncIterator[ReplyDelta]:
    """The request's outputs read back as reply deltas: reasoning as it comes (only a tail that
    could be the start of its end marker held back), the answer as it surely is content (under a
    tool plan, the head that cannot start a call), the rest and the calls once the reply ends."""
    thinking = ReasoningStream(shape.reasoning == "opened") if shape.reasoning is not None else None
    tools = ToolReplyStream(shape.plan) if shape.plan is not None and not shape.harmony else None
    harmony = HarmonyStream() if shape.harmony else None
    async for delta in serving.deltas(state, queue, request_id):
        output = delta.output
        count = len(output.token_ids)
        text = delta.text
        if harmony is not None:
            for step in _harmony_deltas(harmony, shape, delta, count):
                yield step
            continue
        if thinking is not None:
            thought, text = thinking.feed(text)
            if output.finished:
                more_thought, more_text = thinking.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                yield ReplyDelta(count, reasoning=thought)
        if tools is None:
            if not text and not output.finished and not delta.logprobs:
                continue  # tokens whose text is still held back (a partial character, a possible stop)
            yield _ending(ReplyDelta(count, text=text, logprobs=delta.logprobs), output, output.finish_reason)
            continue
        content = tools.feed(text)
        if not output.finished:
            if content or delta.logprobs:
                yield ReplyDelta(count, text=content, logprobs=delta.logprobs)
            continue
        rest, calls, finish_reason = tools.end(output.finish_reason)
        if content + rest:
            yield ReplyDelta(count, text=content + rest)
        for index, call in enumerate(calls):
            yield ReplyDelta(count, tool_call=call, tool_index=index)
        yield _ending(ReplyDelta(count, logprobs=delta.logprobs), output, finish_reason)


def _harmony_deltas(stream: HarmonyStream, shape: ReplyShape, delta: serving.Delta, count: int) -> list[ReplyDelta]:
    """A harmony reply's deltas: its analysis channel as reasoning and its final channel as text
    as they stream, its calls (commentary to functions.NAME) once it ends."""
    output = delta.output
    thought, text = stream.feed(delta.text)
    if output.finished:
        more_thought, more_text = stream.finish()
        thought, text = thought + more_thought, text + more_text
    steps = [ReplyDelta(count, reasoning=thought)] if thought else []
    if not output.finished:
        if text or delta.logprobs:
            steps.append(ReplyDelta(count, text=text, logprobs=delta.logprobs))
        return steps
    if text:
        steps.append(ReplyDelta(count, text=text))
    calls = shape.allowed_calls(stream.calls)
    steps += [ReplyDelta(count, tool_call=call, tool_index=index) for index, call in enumerate(calls)]
    finish_reason = "tool_calls" if calls and output.finish_reason == "stop" else output.finish_reason
    steps.append(_ending(ReplyDelta(count, logprobs=delta.logprobs), output, finish_reason))
    return steps


def _ending(delta: ReplyDelta, output: RequestOutput, finish_reason: str | None) -> ReplyDelta:
    if output.finished:
        delta.final, delta.finish_reason = True, finish_reason
        delta.stop_sequence = _stop_sequence(output, finish_reason)
    return delta

