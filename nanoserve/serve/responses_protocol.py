"""OpenAI's Responses request body (POST /v1/responses, stateless) and its conversion to the chat
request every chat route runs (protocol.ChatCompletionRequest).

The server's policy on fields holds here too: a top-level field not declared is a 400 naming it.
Nothing is stored: ``store: true`` and ``previous_response_id`` (which need responses kept on
the server) are refused with a 400 that says so; ``store`` absent or false is fine (the openai
client sends nothing unless asked). Declared and ignored by design: ``metadata``, ``user``,
``include``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``stream_options``
(bookkeeping of OpenAI's service). ``truncation`` is accepted as "disabled" or "auto"; nothing is
ever truncated (an input too long for the context is a 400 either way). Tools other than
``function`` (web_search, local_shell, custom, ... : OpenAI's hosted tools, which Codex sends)
are skipped, not refused. Items take fields beyond their own (``id``, ``status``): clients send
an earlier reply's output items back as they came.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from nanoserve.serve.errors import ApiError, quoted
from nanoserve.serve.protocol import ChatCompletionRequest, StrictModel, Text

_REASONING_EFFORT = re.compile(r"\breasoning_effort\b")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ContentPart(StrictModel):
    type: Text
    text: Text | None = None


class InputItem(StrictModel):
    """One input item; which fields it needs depends on its type (checked on conversion). A
    message may come without a type (OpenAI's "easy" input message)."""

    type: Text | None = None
    role: Text | None = None  # message
    content: Text | list[ContentPart] | None = None
    call_id: Text | None = None  # function_call, function_call_output
    name: Text | None = None
    arguments: Text | None = None
    output: Text | list[ContentPart] | None = None


class FunctionTool(StrictModel):
    """A tool in the Responses' flat shape; only type "function" is served (the rest skipped)."""

    type: Text
    name: Text | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: Text


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Text | None = None  # accepted; the model's length is its own


class ReasoningConfig(StrictModel):
    effort: Text | None = None  # passed to a template that reads reasoning_effort
    summary: Text | None = None  # accepted: the reasoning comes back whole, as its content and summary
    generate_summary: Text | None = None


class ResponsesRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    truncation: Literal["disabled", "auto"] | None = None
    store: bool | None = None  # true is refused: nothing is stored
    previous_response_id: Text | None = None  # refused: nothing is stored
    background: bool | None = None  # true is refused
    # Accepted and ignored by design (bookkeeping of OpenAI's service).
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    include: list[Text] | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    stream_options: dict[str, Any] | None = None

    def check_stateless(self) -> None:
        if self.previous_response_id is not None:
            raise ApiError(400, "previous_response_id: this server keeps no responses (stateless); send the whole "
                                "conversation as `input`", param="previous_response_id", code="invalid_value")
        if self.store:
            raise ApiError(400, "store: this server keeps no responses (stateless); send store=false or leave it "
                                "out", param="store", code="invalid_value")
        if self.background:
            raise ApiError(400, "background: background responses are not supported", param="background",
                           code="invalid_value")

    def template_variables(self, template_source: str) -> dict[str, Any]:
        """The reasoning effort, for a template that reads one (gpt-oss's `reasoning_effort`)."""
        if self.reasoning is None or self.reasoning.effort is None or not _REASONING_EFFORT.search(template_source):
            return {}
        return {"reasoning_effort": self.reasoning.effort}


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The request as the chat route's request: instructions as the first system message, input
    messages as chat turns (developer as system), function_call items as an assistant turn's
    tool_calls, function_call_output items as tool turns; reasoning items are dropped."""
    body.check_stateless()
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        _input_messages(body.input, messages)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream),
                            "temperature": body.temperature, "top_p": body.top_p}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    tools = [(index, tool) for index, tool in enumerate(body.tools or []) if tool.type == "function"]
    for index, tool in tools:
        if tool.name is None:
            raise ApiError(400, f"tools[{index}].name: missing", param="tools", code="missing_required_parameter")
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description or "", "parameters": tool.parameters,
            "strict": tool.strict}} for _, tool in tools]
    choice = body.tool_choice
    if choice is not None and (tools or choice != "auto"):
        chat["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    if body.parallel_tool_calls is not None and tools:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(400, "text.format.schema: a json_schema format needs its schema", param="text",
                           code="missing_required_parameter")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error.get("loc", ()))
        raise ApiError(400, f"the request cannot be served: {where}: {error.get('msg')}",
                       param="tools" if where.startswith("tools") else None, code="invalid_value") from exc


def _input_messages(items: list[InputItem], messages: list[dict[str, Any]]) -> None:
    names: dict[str, str] = {}  # call_id -> function name, for the results' turns
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.type if item.type is not None else "message"
        if kind == "message":
            role = _need(item.role, where, "role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: invalid value {quoted(role)}; supported values are 'user', "
                                    "'assistant', 'system', 'developer'", param="input", code="invalid_value")
            content = "" if item.content is None else _text(item.content, f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id, name = _need(item.call_id, where, "call_id"), _need(item.name, where, "name")
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one reply join its turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _need(item.call_id, where, "call_id")
            output = "" if item.output is None else _text(item.output, f"{where}.output")
            turn = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                turn["name"] = names[call_id]
            messages.append(turn)
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not carried into the prompt
        elif kind == "item_reference":
            raise ApiError(400, f"{where}: item references need stored responses, and this server keeps none; "
                                "send the items themselves", param="input", code="invalid_value")
        else:
            raise ApiError(400, f"{where}.type: {quoted(kind)} items are not supported (supported: message, "
                                "function_call, function_call_output, reasoning)", param="input",
                           code="invalid_value")
    if not messages:
        raise ApiError(400, "input: at least one message is needed", param="input", code="invalid_value")


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            why = " (this server serves text models)" if part.type in ("input_image", "input_file", "input_audio") \
                else ""
            raise ApiError(400, f"{param}[{index}].type: {quoted(part.type)} parts are not supported{why}; only "
                                "text parts are", param="input", code="invalid_value")
        parts.append(_need(part.text, f"{param}[{index}]", "text"))
    return "".join(parts)


def _need(value, where: str, field: str):
    if value is None:
        raise ApiError(400, f"{where}.{field}: missing", param="input", code="missing_required_parameter")
    return value

