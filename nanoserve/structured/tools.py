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
# Calls one reply may make where several are allowed (parallel_tool_calls). OpenAI's API has no
# count field, so the bound is ours: every grammar that writes several calls closes after this many,
# so a model that keeps calling (the same call, over and over) ends its reply instead of running
# to the token limit. Eight covers an agent's usual fan-out (one call per city, per file); a
# request declaring more tools than that may call each of them once.
MAX_PARALLEL_CALLS = 8


def call_limit(functions: Sequence[Function]) -> int:
    """The most calls one reply may make where several are allowed (see MAX_PARALLEL_CALLS)."""
    return max(MAX_PARALLEL_CALLS, len(functions))


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
    """The generic form's reply: {"tool_calls": [call, ...]} (one call unless `parallel`, then at
    most `call_limit`), or (unless calls are required) {"content": "..."}, a plain answer."""
    array = {"type": "array", "items": call_schema(functions), "minItems": 1,
             "maxItems": call_limit(functions) if parallel else 1}
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


def distinct_calls(calls: Sequence[ToolCall]) -> list[ToolCall]:
    """`calls` without the ones repeating an earlier call (the same name and the same arguments,
    however their keys are ordered or spaced): a repeated call does nothing the first did not."""
    seen, out = set(), []
    for call in calls:
        if (key := call_key(call.name, call.arguments)) not in seen:
            seen.add(key)
            out.append(call)
    return out


def call_key(name: str, arguments: Any) -> tuple[str, str]:
    """A call's identity: its name and its arguments as canonical JSON (text that is not JSON
    stands for itself)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return name, arguments
    return name, json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class RepeatGuard:
    """The repeat guard of the generic envelope ``{"tool_calls": [call, ...]}`` where several calls
    are allowed. JSON schema cannot say "no call twice" in a form llguidance enforces (it has no
    ``uniqueItems``, and the arguments are any JSON), so the host watches the reply's bytes as the
    grammar accepts them: once a call completes that repeats an earlier one (``call_key``),
    ``closing`` is set and the step's mask is narrowed to the tokens that close the list (``]``,
    ``]}``) wherever the grammar allows one, so the envelope closes at the first point it can.
    The repeat itself is already written; the reply is read back without it (``distinct_calls``).
    The list's bound (``call_limit``, in the grammar) still holds if a repeat cannot be caught."""

    CLOSERS = ("]", "]}")  # the texts of the tokens that may close the list

    def __init__(self) -> None:
        self.closing = False
        self.calls = 0  # completed calls
        self._stack: list[int] = []  # open brackets ({ or [) outside strings
        self._in_string = self._escaped = False
        self._call = bytearray()  # the call being written (from its opening brace)
        self._seen: set[tuple[str, str]] = set()

    def feed(self, data: bytes) -> None:
        """The bytes of an accepted token."""
        for byte in data:
            inside_call = len(self._stack) >= 3  # {"tool_calls": [ {the call ...
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == 0x5C:  # backslash
                    self._escaped = True
                elif byte == 0x22:
                    self._in_string = False
            elif byte == 0x22:
                self._in_string = True
            elif byte in (0x7B, 0x5B):  # { [
                self._stack.append(byte)
                if self._stack == [0x7B, 0x5B, 0x7B]:
                    inside_call, self._call = True, bytearray()
            elif byte in (0x7D, 0x5D) and self._stack:  # } ]
                self._stack.pop()
                if self._stack == [0x7B, 0x5B]:
                    self._call.append(byte)
                    self._completed(bytes(self._call))
                    continue
            if inside_call:
                self._call.append(byte)

    def _completed(self, text: bytes) -> None:
        self.calls += 1
        try:
            call = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return
        key = call_key(call["name"], call.get("arguments", {}))
        if key in self._seen:
            self.closing = True
        self._seen.add(key)
