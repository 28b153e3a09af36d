"""Tool definitions and choices as constraints: the schema of one call, the generic JSON envelope
a model without tool support in its template replies in, and that form's system message."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COMPACT = {"whitespace_flexible": False}  # llguidance's per-schema options (x-guidance)


@dataclass(frozen=True)
class Function:
    """One declared function: its name, description and parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ParsedReply:
    """A reply split into its text and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def strict_parameters(schema: Any) -> Any:
    """OpenAI's ``strict`` function: every object in the parameters' schema takes only the keys
    it names (``additionalProperties`` false where the schema leaves it open)."""
    if isinstance(schema, list):
        return [strict_parameters(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_parameters(value) if key in _SUBSCHEMAS else value for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict_parameters(sub) for name, sub in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems")


def call_schema(functions: Sequence[Function], arguments_key: str = "arguments") -> dict[str, Any]:
    """One call of any of `functions`: {"name": <its name>, arguments_key: <its parameters>}."""
    variants = [{"type": "object", "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
                 "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def envelope_schema(functions: Sequence[Function], calls_required: bool, parallel: bool = True) -> dict[str, Any]:
    """The generic form's reply: {"tool_calls": [call, ...]} (one call unless `parallel`), or
    (unless calls are required) {"content": "..."}, a plain answer."""
    array = {"type": "array", "items": call_schema(functions), "minItems": 1, **({} if parallel else {"maxItems": 1})}
    calls = {"type": "object", "properties": {"tool_calls": array},
             "required": ["tool_calls"], "additionalProperties": False}
    if calls_required:
        return {**calls, "x-guidance": COMPACT}
    answer = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
              "additionalProperties": False}
    return {"anyOf": [calls, answer], "x-guidance": COMPACT}


def generic_tool_prompt(functions: Sequence[Function], calls_required: bool) -> str:
    """The system message that tells a model without tool support in its template how to call."""
    listing = json.dumps([f.as_tool()["function"] for f in functions], ensure_ascii=False)
    answer = "" if calls_required else ' To answer without a tool, reply {"content": "<your answer>"}.'
    return (f"You can call these functions: {listing}\nTo call one or more, reply with JSON only: "
            '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}.' + answer)


def parse_envelope(text: str) -> ParsedReply:
    """The generic form's reply read back (text that is not the envelope is plain content)."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return _cut_envelope(text)
    if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
        calls = [as_call(c) for c in reply["tool_calls"]]
        if all(calls):
            return ParsedReply(None, calls)
    if isinstance(reply, dict) and isinstance(reply.get("content"), str) and len(reply) == 1:
        return ParsedReply(reply["content"], [])
    return ParsedReply(text, [])


_CALLS_HEAD = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
_CONTENT_HEAD = re.compile(r'\s*\{\s*"content"\s*:\s*"')


def _cut_envelope(text: str) -> ParsedReply:
    """A reply cut short inside the envelope (max_tokens): the calls completed before the cut, or
    the content written so far; never the envelope's raw text. Text that is no envelope is content."""
    if head := _CALLS_HEAD.match(text):
        decoder, at, calls = json.JSONDecoder(), head.end(), []
        while True:
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            try:
                value, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                break
            if (call := as_call(value)) is None:
                break
            calls.append(call)
        return ParsedReply(None, calls)
    if _CONTENT_HEAD.match(text):
        for cut in range(len(text), max(len(text) - 8, 0), -1):  # a cut inside an escape loses it
            try:
                return ParsedReply(json.loads(text[:cut] + '"}')["content"], [])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ParsedReply(text, [])


def as_call(call: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A {"name", "arguments"} object as a ToolCall (None if it is not one)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[k] for k in arguments_keys if k in call), {})
    if isinstance(arguments, str):
        return ToolCall(call["name"], arguments)
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))
