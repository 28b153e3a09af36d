"""tools + tool_choice on /v1/chat/completions: what the prompt says about the tools, what the
reply is constrained to, and how the reply is read back into tool_calls.

A model whose chat template takes ``tools`` gets them rendered there and replies in its family's
format (parsed back by that family's parser; "required" and named choices are enforced by a
grammar of that format). Any other model gets them in a system message and replies in a JSON
envelope that a grammar enforces, so every model can call tools.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.serve.errors import ApiError, quoted
from nanoserve.serve.protocol import ChatCompletionRequest, NamedToolChoice
from nanoserve.structured import StructuredOutputs
from nanoserve.structured.tool_parsers import FORMATS, GenericFormat, ToolFormat, format_for_template
from nanoserve.structured.tools import Function, ParsedReply, ToolCall, distinct_calls, strict_parameters

_TAKES_TOOLS = re.compile(r"\btools\b")  # a template that reads the `tools` variable


@dataclass
class ToolPlan:
    """How one request's tools are offered and read back."""

    format: ToolFormat
    functions: list[Function]  # every declared function (what the prompt lists)
    allowed: list[Function]  # what the reply may call (one, for a named choice)
    choice: str  # "none" (tools declared, no call: only the history is rendered), "auto", "required", "named"
    parallel: bool  # more than one call per reply
    marker_id: int | None = None  # the vocabulary's own call marker token, where the format has one (Mistral)
    marker_ids: dict[str, int | None] | None = None  # the format's marker tokens' ids, where it has several (harmony)

    @property
    def native(self) -> bool:
        return self.format.native

    @property
    def calls_required(self) -> bool:
        return self.choice != "auto"

    def structure(self) -> StructuredOutputs | None:
        """The reply's constraint: the envelope (generic form), the family's call grammar
        (required or named), or none (a native model choosing freely under auto)."""
        if self.choice == "none":
            return None
        if isinstance(self.format, GenericFormat):
            # Several calls allowed: a call repeating an earlier one closes the list (the repeat guard).
            return StructuredOutputs(json=self.format.reply_schema(self.allowed, self.calls_required, self.parallel),
                                     distinct_calls=self.parallel)
        if not self.calls_required:
            return None
        marker = {"marker_id": self.marker_id} if self.marker_id is not None else {}
        if self.marker_ids is not None:
            marker = {"marker_ids": self.marker_ids}
        return StructuredOutputs(grammar=self.format.call_grammar(self.allowed, self.parallel, **marker))

    def template_tools(self) -> list[dict] | None:
        return [f.as_tool() for f in self.functions] if self.native and self.choice != "none" else None

    def parse(self, text: str) -> ParsedReply:
        if self.choice == "none":
            return ParsedReply(text, [])
        reply = self.format.parse(text)
        # One call unless several are allowed; never the same call twice (a repeat does nothing more).
        reply.tool_calls = distinct_calls(reply.tool_calls)[:None if self.parallel else 1]
        return reply


def plan_tools(body: ChatCompletionRequest, template_source: str, parser: str | None,
               token_id: Callable[[str], int | None] = lambda token: None) -> ToolPlan | None:
    """The request's tool plan (None: no tools declared); `token_id` finds a marker token in the
    vocabulary. 400s name `tools` or `tool_choice`."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if not body.tools:
        if choice != "none":
            raise ApiError(400, f"tool_choice: {_choice_name(choice)} needs tools, and none were given",
                           param="tool_choice", code="invalid_value")
        return None
    functions = [Function(t.function.name, t.function.description or "", _parameters(t.function)) for t in body.tools]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", param="tools", code="invalid_value")
    allowed = functions
    if isinstance(choice, NamedToolChoice):
        allowed = [f for f in functions if f.name == choice.function.name]
        if not allowed:
            raise ApiError(400, f"tool_choice: names the function {quoted(choice.function.name)}, which is not "
                                f"among the tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
    fmt = FORMATS[parser] if parser else format_for_template(template_source)
    if fmt.native and not _TAKES_TOOLS.search(template_source):
        fmt = FORMATS["generic"]  # its template cannot show the tools: the generic form instead
    named = isinstance(choice, NamedToolChoice)  # one call of that function, as OpenAI's named choice
    marker = getattr(fmt, "MARKER", None)
    return ToolPlan(fmt, functions, allowed, "named" if named else choice,
                    # one call a reply unless the request allows more (llama-server's default)
                    parallel=not named and body.parallel_tool_calls is True,
                    marker_id=token_id(marker) if marker else None,
                    marker_ids={m: token_id(m) for m in fmt.MARKERS} if hasattr(fmt, "MARKERS") else None)


def _parameters(function) -> dict:
    """A function's parameters schema, closed to unnamed keys where it asks to be ``strict``."""
    parameters = function.parameters or {"type": "object", "properties": {}}
    return strict_parameters(parameters) if function.strict else parameters


def _choice_name(choice) -> str:
    return f"the function {quoted(choice.function.name)}" if isinstance(choice, NamedToolChoice) else quoted(choice)


def prompt_messages(plan: ToolPlan | None, messages: list[dict]) -> list[dict]:
    """The messages as the template gets them. A native template reads tool calls and results
    itself; otherwise the tools are described in a system message, earlier calls are written in
    the reply format and tool results become user turns (a template without a "tool" role)."""
    if plan is None or plan.native:
        return messages
    out = []
    for message in messages:
        if message.get("tool_calls"):
            out.append({"role": "assistant", "content": _written_calls(plan, message["tool_calls"])})
        elif message["role"] == "tool":
            who = message.get("name") or message.get("tool_call_id") or "the tool"
            out.append({"role": "user", "content": f"Result of {who}: {message['content']}"})
        else:
            out.append(message)
    if plan.choice == "none":
        return out
    instructions = plan.format.prompt(plan.functions, plan.calls_required)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}, *out[1:]]
    return [{"role": "system", "content": instructions}, *out]


def _written_calls(plan: ToolPlan, calls: list[dict]) -> str:
    if isinstance(plan.format, GenericFormat):
        return json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                          for c in calls]}, ensure_ascii=False)
    body = ", ".join(f"{c['function']['name']}(" + ", ".join(
        f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in _as_dict(c["function"]["arguments"]).items()) + ")"
        for c in calls)
    return f"```tool_code\n[{body}]\n```"


def _as_dict(arguments) -> dict:
    return arguments if isinstance(arguments, dict) else {}


def read_reply(plan: ToolPlan | None, text: str, finish_reason: str | None
               ) -> tuple[str | None, list[ToolCall], str | None]:
    """The reply's content, its tool calls, and its finish reason: "tool_calls" when the reply
    called tools and ended by itself."""
    if plan is None:
        return text, [], finish_reason
    reply = plan.parse(text)
    if not reply.tool_calls:
        return reply.content, [], finish_reason
    return reply.content, reply.tool_calls, "tool_calls" if finish_reason == "stop" else finish_reason


def reply_message(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message in OpenAI's shape (content and any tool_calls) and its finish reason."""
    content, calls, finish_reason = read_reply(plan, text, finish_reason)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
    return message, finish_reason


class ToolReplyStream:
    """A streamed reply under a tool plan: its head streams as content while it surely is
    content (under "auto", before anything that could start a call); the rest is read whole
    at the end into content and tool calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.answer = ""
        self.sent = 0  # characters of the answer already streamed as content

    def feed(self, text: str) -> str:
        """Content that can go out now."""
        self.answer += text
        if self.plan.choice == "none":
            safe = len(self.answer)
        elif self.plan.choice == "auto":
            safe = self.plan.format.content_prefix(self.answer)
        else:
            safe = 0
        delta, self.sent = self.answer[self.sent:safe], max(self.sent, safe)
        return delta

    def end(self, finish_reason: str | None) -> tuple[str, list[ToolCall], str | None]:
        """(the rest of the content, the calls, the finish reason) once the reply has ended."""
        content, calls, finish_reason = read_reply(self.plan, self.answer, finish_reason)
        content = content or ""
        if self.sent == 0:
            return content, calls, finish_reason
        if not calls:
            return self.answer[self.sent:], calls, finish_reason
        streamed = self.answer[:self.sent].strip()
        return (content[len(streamed):] if content.startswith(streamed) else ""), calls, finish_reason

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """As `end`, the calls in OpenAI's shape."""
        rest, calls, finish_reason = self.end(finish_reason)
        return rest, [call.as_openai() for call in calls], finish_reason
