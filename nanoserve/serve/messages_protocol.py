"""Anthropic's Messages request bodies (POST /v1/messages, /v1/messages/count_tokens) and their
conversion to the chat request every chat route runs (protocol.ChatCompletionRequest).

The server's policy on fields holds here too: a top-level field not declared is a 400 naming
it. Declared and ignored by design (IGNORED_MESSAGES_FIELDS): bookkeeping of Anthropic's own
service. ``container`` and ``mcp_servers`` (Anthropic's hosted tools) are refused when given.
Content blocks and tools take fields beyond their own (``cache_control``, ``citations``): clients
send earlier replies back as they came.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from nanoserve.serve.errors import ApiError, quoted
from nanoserve.serve.protocol import ChatCompletionRequest, StrictModel, Text

# A tool's name as Anthropic's API takes it (the chat route's pattern takes these too).
_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
_ENABLE_THINKING = re.compile(r"\benable_thinking\b")
IGNORED_MESSAGES_FIELDS = ("metadata", "service_tier", "inference_geo", "speed", "cache_control", "diagnostics",
                           "user_profile_id", "workspace_id")


class ContentBlock(StrictModel):
    """One content block; which fields it needs depends on its type (checked on conversion)."""

    type: Text
    text: Text | None = None  # text
    id: Text | None = None  # tool_use
    name: Text | None = None
    input: dict[str, Any] | None = None
    tool_use_id: Text | None = None  # tool_result
    content: Text | list[ContentBlock] | None = None
    is_error: bool | None = None
    thinking: Text | None = None  # thinking
    signature: Text | None = None
    data: Text | None = None  # redacted_thinking


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class Tool(StrictModel):
    name: Annotated[Text, Field(pattern=_TOOL_NAME)]
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    type: Text | None = None  # "custom" (or absent); Anthropic's server tools are refused


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # accepted; the reasoning is not held to a budget
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Text | None = None  # accepted and ignored: the model's reasoning is its own
    format: OutputFormat | None = None  # the reply held to a JSON schema (response_format's json_schema)


class _MessagesFields(StrictModel):
    """What a message and a token count share: the conversation and its tools."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    messages: list[InputMessage]
    system: Text | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    mcp_servers: list[Any] | None = None  # refused when not empty

    @property
    def thinking_display(self) -> str:
        """"hidden" when the request turned thinking off (no thinking blocks come back),
        "omitted" when it asked for them empty, else "shown"."""
        if self.thinking is not None and self.thinking.type == "disabled":
            return "hidden"
        return "omitted" if self.thinking is not None and self.thinking.display == "omitted" else "shown"

    def template_variables(self, template_source: str) -> dict[str, Any]:
        """The thinking switch, for a template that reads one (Qwen3's `enable_thinking`)."""
        if self.thinking is None or not _ENABLE_THINKING.search(template_source):
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}


class MessagesRequest(_MessagesFields):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    output_config: OutputConfig | None = None
    # Ignored by design (README): bookkeeping of Anthropic's own service (an end user's id, a
    # billing tier, a region, a speed tier, prompt-cache hints and diagnostics, workspaces).
    metadata: dict[str, Any] | None = None
    service_tier: Text | None = None
    inference_geo: Text | None = None
    speed: Text | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None
    container: Any = None  # refused when given


class CountTokensRequest(_MessagesFields):
    pass


def to_chat(body: _MessagesFields) -> ChatCompletionRequest:
    """The request as the chat route's request: system first, tool_use blocks as an assistant
    turn's tool_calls, tool_result blocks as tool turns; thinking blocks of earlier replies are
    dropped (templates strip past reasoning). A 400 names what cannot be served."""
    _refuse_hosted_tools(body)
    messages = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    tool_names: dict[str, str] = {}  # tool_use id -> name, for the results' turns
    for index, message in enumerate(body.messages):
        param = f"messages[{index}].content"
        if message.role == "assistant":
            messages.append(_assistant_turn(message.content, param, tool_names))
        else:
            messages.extend(_user_turns(message.content, param, tool_names))
    if body.messages and body.messages[-1].role == "assistant":
        raise ApiError(400, f"messages[{len(body.messages) - 1}]: a final assistant message (a prefill to "
                            "continue) is not supported; end with a user message", param="messages")
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description or "",
            "parameters": tool.input_schema if tool.input_schema is not None else {"type": "object", "properties": {}}}}
            for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice.name: a choice of type 'tool' names the tool", param="tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    if body.tools:  # Anthropic's default: several calls a reply, unless the choice turns it off
        chat["parallel_tool_calls"] = not (choice is not None and choice.disable_parallel_tool_use)
    if isinstance(body, MessagesRequest):
        if body.container is not None:
            raise ApiError(400, "container: code execution containers are not supported", param="container")
        chat.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences, stream=bool(body.stream))
        if body.output_config is not None and body.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # nothing above should make one; a 400 rather than a 500 all the same
        raise ApiError(400, f"the request cannot be served: {exc.errors()[0].get('msg')}") from exc


def _refuse_hosted_tools(body: _MessagesFields) -> None:
    if body.mcp_servers:
        raise ApiError(400, "mcp_servers: MCP servers are not supported; give their tools as `tools`",
                       param="mcp_servers")
    for index, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise ApiError(400, f"tools[{index}].type: {quoted(tool.type)} is one of Anthropic's server tools, "
                                "which this server does not run; only custom tools (with input_schema) are "
                                "supported", param=f"tools[{index}]")
        if tool.input_schema is None:
            raise ApiError(400, f"tools[{index}].input_schema: a custom tool needs its input_schema",
                           param=f"tools[{index}]")


def _text(content: str | list[ContentBlock], param: str) -> str:
    """Text content: a string, or text blocks joined (the only kind a text-only place takes)."""
    if isinstance(content, str):
        return content
    parts = []
    for index, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise ApiError(400, f"{param}[{index}]: only text blocks are supported here, got a "
                                f"{quoted(block.type)} block", param=param)
        parts.append(block.text)
    return "\n\n".join(parts) if param == "system" else "".join(parts)


def _assistant_turn(content: str | list[ContentBlock], param: str, tool_names: dict[str, str]) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, calls = [], []
    for index, block in enumerate(content):
        where = f"{param}[{index}]"
        if block.type == "text":
            text.append(_need(block.text, where, "text"))
        elif block.type == "tool_use":
            call_id, name = _need(block.id, where, "id"), _need(block.name, where, "name")
            tool_names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # the model's earlier reasoning: not carried into the prompt
        else:
            _unsupported(block, where, "an assistant message")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(content: str | list[ContentBlock], param: str, tool_names: dict[str, str]) -> list[dict]:
    """A user message: its text as user turns, each tool_result block a tool turn, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    turns, text = [], []
    for index, block in enumerate(content):
        where = f"{param}[{index}]"
        if block.type == "text":
            text.append(_need(block.text, where, "text"))
        elif block.type == "tool_result":
            if text:
                turns.append({"role": "user", "content": "".join(text)})
                text = []
            call_id = _need(block.tool_use_id, where, "tool_use_id")
            result = "" if block.content is None else _text(block.content, f"{where}.content")
            if block.is_error:
                result = f"Error: {result}"
            turn = {"role": "tool", "tool_call_id": call_id, "content": result}
            if call_id in tool_names:
                turn["name"] = tool_names[call_id]
            turns.append(turn)
        else:
            _unsupported(block, where, "a user message")
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


def _need(value, where: str, field: str):
    if value is None:
        raise ApiError(400, f"{where}.{field}: missing", param=where.split("[", 1)[0])
    return value


def _unsupported(block: ContentBlock, where: str, place: str) -> None:
    kind = block.type
    why = "this server serves text models" if kind in ("image", "document") else "not supported"
    raise ApiError(400, f"{where}: {quoted(kind)} blocks in {place} are not supported ({why})",
                   param=where.split("[", 1)[0])
