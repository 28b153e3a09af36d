"""POST /v1/responses (OpenAI's Responses API, stateless): the chat route's work (template, tools,
reasoning, structured output) with the reply rendered as a response object: output items
(reasoning, message, function_call), a status ("incomplete" when max_output_tokens cut it), and
typed SSE events (``event: <type>`` lines, each event numbered by ``sequence_number``)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from nanoserve.serve import serving
from nanoserve.serve.chat import ChatJob, start_chat
from nanoserve.serve.chat_reply import template_source
from nanoserve.serve.errors import ApiError, renamed_fields
from nanoserve.serve.reply import Reply
from nanoserve.serve.responses_protocol import ResponsesRequest, to_chat
from nanoserve.serve.serving import ServeState
from nanoserve.structured.tools import ToolCall

# The chat path names its fields as the chat request does; name them as this request does.
_FIELD_NAMES = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].parameters"),
                (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
                (re.compile(r"\bresponse_format\b"), "text.format"),
                (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
                (re.compile(r"\bmessages\b"), "input")]


class ResponsesSse:
    """The Responses API's server-sent events: `event: TYPE` then `data: JSON` for each
    (TYPE, dict); an `error` event once the stream has begun; no terminator."""

    event = staticmethod(serving.named_event)

    @staticmethod
    def error(exc: ApiError) -> str:
        body = {"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param}
        return f"event: error\ndata: {json.dumps(body)}\n\n"

    done = ""


async def create_response(state: ServeState, body: ResponsesRequest, request: Request):
    state.check_model(body.model)
    with renamed_fields(_FIELD_NAMES):
        job = await start_chat(state, to_chat(body), id_prefix="resp", id_sep="_",
                               variables=body.template_variables(template_source(state)))
    if body.stream:
        return serving.sse_response(state, _events(state, body, job), job.request_id, wire=ResponsesSse)
    reply = await job.reply(state, request)
    return _response(state, body, job, _items(reply, body), _status(reply.finish_reason),
                     reply.usage.completion_tokens)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _response(state: ServeState, body: ResponsesRequest, job: ChatJob, output: list[dict], status: str,
              output_tokens: int) -> dict:
    """The response object (`status` "in_progress" while it streams, with no usage yet)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) \
        if body.text is not None and body.text.format is not None else {"type": "text"}
    tool_choice = body.tool_choice if isinstance(body.tool_choice, str | None) else body.tool_choice.model_dump()
    response = {
        "id": job.request_id, "object": "response", "created_at": job.created, "status": status,
        "model": state.model_name, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": bool(body.parallel_tool_calls), "temperature": body.temperature,
        "top_p": body.top_p, "tool_choice": tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or () if tool.type == "function"],
        "text": {"format": fmt}, "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "store": False, "metadata": body.metadata or {}, "truncation": body.truncation or "disabled",
        "previous_response_id": None, "user": body.user, "usage": None}
    if status != "in_progress":
        text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
        response["output_text"] = text
        response["usage"] = {"input_tokens": job.prompt_tokens, "output_tokens": output_tokens,
                             "total_tokens": job.prompt_tokens + output_tokens}
    return response


def _reasoning_item(item_id: str, text: str, body: ResponsesRequest, status: str) -> dict:
    summary = [{"type": "summary_text", "text": text}] \
        if text and body.reasoning is not None and body.reasoning.summary else []
    return {"type": "reasoning", "id": item_id, "summary": summary,
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _items(reply: Reply, body: ResponsesRequest) -> list[dict]:
    status = _status(reply.finish_reason)
    items = []
    if reply.reasoning is not None:
        items.append(_reasoning_item(_item_id("rs"), reply.reasoning, body, "completed"))
    if reply.text:
        items.append(_message_item(_item_id("msg"), reply.text, status))
    for call in reply.tool_calls:
        items.append(_call_item(_item_id("fc"), call, "completed"))
    return items


async def _events(state: ServeState, body: ResponsesRequest, job: ChatJob) -> AsyncIterator[tuple[str, dict]]:
    """The reply's deltas as the Responses stream: response.created and .in_progress, each output
    item (added, its content part and deltas, done), then response.completed (or .incomplete)."""
    stream = _ItemStream(body)
    yield stream.event("response.created", response=_response(state, body, job, [], "in_progress", 0))
    yield stream.event("response.in_progress", response=_response(state, body, job, [], "in_progress", 0))
    final = None
    async for delta in job.deltas(state):
        if delta.reasoning:
            for event in stream.open("reasoning"):
                yield event
            stream.text += delta.reasoning
            yield stream.event("response.reasoning_text.delta", **stream.where(), delta=delta.reasoning)
        if delta.text:
            for event in stream.open("message"):
                yield event
            stream.text += delta.text
            yield stream.event("response.output_text.delta", **stream.where(), delta=delta.text, logprobs=[])
        if delta.tool_call is not None:
            for event in stream.call(delta.tool_call):
                yield event
        if delta.final:
            final = delta
    finish, tokens = (final.finish_reason, final.completion_tokens) if final is not None else (None, 0)
    status = _status(finish)
    for event in stream.close(status):
        yield event
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    yield stream.event(kind, response=_response(state, body, job, stream.items, status, tokens))


class _ItemStream:
    """The output item open in a stream (reasoning or message), the items done, and the events'
    sequence numbers."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.sequence = 0
        self.items: list[dict] = []
        self.kind: str | None = None
        self.item_id = ""
        self.text = ""

    def event(self, kind: str, **fields) -> tuple[str, dict]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, event

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def open(self, kind: str) -> list[tuple[str, dict]]:
        if self.kind == kind:
            return []
        events = self.close("completed")
        self.kind, self.item_id, self.text = kind, _item_id("rs" if kind == "reasoning" else "msg"), ""
        if kind == "reasoning":
            item = {**_reasoning_item(self.item_id, "", self.body, "in_progress"), "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item, part = _message_item(self.item_id, None, "in_progress"), _text_part("")
        return [*events, self.event("response.output_item.added", output_index=len(self.items), item=item),
                self.event("response.content_part.added", **self.where(), part=part)]

    def close(self, status: str) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        where, text = self.where(), self.text
        if self.kind == "reasoning":
            item = _reasoning_item(self.item_id, text, self.body, "completed")
            events = [self.event("response.reasoning_text.done", **where, text=text),
                      self.event("response.content_part.done", **where, part=item["content"][0])]
        else:
            item = _message_item(self.item_id, text, status)
            events = [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                      self.event("response.content_part.done", **where, part=item["content"][0])]
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        self.kind = None
        return events

    def call(self, call: ToolCall) -> list[tuple[str, dict]]:
        """A whole call's events: its item added, its arguments (one delta), done."""
        events = self.close("completed")
        item_id, index = _item_id("fc"), len(self.items)
        item = _call_item(item_id, call, "completed")
        events += [self.event("response.output_item.added", output_index=index,
                              item=_call_item(item_id, call, "in_progress", arguments="")),
                   self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                              delta=call.arguments),
                   self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                              name=call.name, arguments=call.arguments),
                   self.event("response.output_item.done", output_index=index, item=item)]
        self.items.append(item)
        return events
