"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens: the chat route's
work (template, tools, reasoning, structured output) with the reply rendered in Anthropic's
shapes: content blocks (thinking, text, tool_use), a stop_reason, and named SSE events."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from starlette.requests import Request

from nanoserve.serve import serving
from nanoserve.serve.chat import ChatJob, chat_prompt, start_chat
from nanoserve.serve.chat_reply import template_source
from nanoserve.serve.errors import renamed_fields
from nanoserve.serve.messages_protocol import CountTokensRequest, MessagesRequest, to_chat
from nanoserve.serve.reply import Reply
from nanoserve.serve.serving import AnthropicSse, ServeState
from nanoserve.structured.tools import ToolCall

# Thinking blocks carry a signature, which clients keep and send back; this server neither signs
# nor checks them (earlier thinking is not carried into the prompt).
THINKING_SIGNATURE = "nanoserve-unsigned"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# The chat path names its fields as OpenAI's request does; name them as this request does.
_FIELD_NAMES = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema")]


async def create_message(state: ServeState, body: MessagesRequest, request: Request):
    state.check_model(body.model)
    with renamed_fields(_FIELD_NAMES):
        job = await start_chat(state, to_chat(body), id_prefix="msg", id_sep="_",
                               variables=body.template_variables(template_source(state)))
    if body.stream:
        events = _events(state, job, body.thinking_display)
        return serving.sse_response(state, events, job.request_id, wire=AnthropicSse)
    reply = await job.reply(state, request)
    return {"id": job.request_id, "type": "message", "role": "assistant", "model": state.model_name,
            "content": _blocks(reply, body.thinking_display), "stop_reason": stop_reason(reply.finish_reason,
                                                                                       reply.stop_sequence),
            "stop_sequence": reply.stop_sequence,
            "usage": {"input_tokens": reply.usage.prompt_tokens, "output_tokens": reply.usage.completion_tokens}}


async def count_message_tokens(state: ServeState, body: CountTokensRequest) -> dict:
    """The prompt's tokens as /v1/messages would render it (system, tools, the thinking switch)."""
    state.check_model(body.model)
    with renamed_fields(_FIELD_NAMES):
        chat = to_chat(body)
        chat.check_supported()
        _, prompt = await chat_prompt(state, chat, body.template_variables(template_source(state)))
    return {"input_tokens": len(await serving.encode(state, prompt, "messages"))}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str | None:
    if finish_reason == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return _STOP_REASONS.get(finish_reason, finish_reason)


def tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(call: ToolCall) -> dict:
    """A call's arguments as the object Anthropic's `input` is; arguments that are not a JSON
    object (a free-form reply's call gone wrong) are kept under "arguments"."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def _blocks(reply: Reply, thinking: str) -> list[dict]:
    blocks = []
    if reply.reasoning is not None and thinking != "hidden":
        blocks.append({"type": "thinking", "thinking": reply.reasoning if thinking == "shown" else "",
                       "signature": THINKING_SIGNATURE})
    if reply.text:
        blocks.append({"type": "text", "text": reply.text})
    for call in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": tool_id(call), "name": call.name, "input": tool_input(call)})
    return blocks


async def _events(state: ServeState, job: ChatJob, thinking: str) -> AsyncIterator[tuple[str, dict]]:
    """The reply's deltas as Anthropic's stream: message_start, a ping, then each content block
    (start, deltas, stop), message_delta (stop reason, output tokens) and message_stop."""
    message = {"id": job.request_id, "type": "message", "role": "assistant", "model": state.model_name,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": message}
    yield "ping", {"type": "ping"}
    blocks = _BlockStream()
    final = None
    async for delta in job.deltas(state):
        if delta.reasoning and thinking != "hidden":
            for event in blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                yield event
            if thinking == "shown":
                yield blocks.delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.text:
            for event in blocks.open("text", {"type": "text", "text": ""}):
                yield event
            yield blocks.delta({"type": "text_delta", "text": delta.text})
        if delta.tool_call is not None:
            call = delta.tool_call
            for event in blocks.open("tool_use", {"type": "tool_use", "id": tool_id(call), "name": call.name,
                                                  "input": {}}, always=True):
                yield event
            yield blocks.delta({"type": "input_json_delta",
                                "partial_json": json.dumps(tool_input(call), ensure_ascii=False)})
        if delta.final:
            final = delta
    for event in blocks.close():
        yield event
    finish, stop_sequence, tokens = (final.finish_reason, final.stop_sequence, final.completion_tokens) \
        if final is not None else (None, None, 0)
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(finish, stop_sequence), "stop_sequence": stop_sequence},
                            "usage": {"output_tokens": tokens}}
    yield "message_stop", {"type": "message_stop"}


class _BlockStream:
    """The content block open in a stream, and the events that open and close blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def open(self, kind: str, block: dict, always: bool = False) -> list[tuple[str, dict]]:
        """Events that make a block of `kind` the open one (a new one when `always`)."""
        if self.kind == kind and not always:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*events, ("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return events
