"""Tool-call formats per model family: how a reply's calls are read back, and the grammar that
makes a reply one or more calls (for tool_choice "required" or a named function).

Chosen from the chat template (``format_for_template``), or by name (``--tool-call-parser``).
``native`` formats have the template render the tools; the others describe them in a system
message (Gemma's templates, and the generic JSON envelope for any model).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Protocol

from nanoserve.structured.harmony import HarmonyFormat, template_is_harmony
from nanoserve.structured.reasoning import marker_prefix_length
from nanoserve.structured.tools import (
    COMPACT,
    Function,
    ParsedReply,
    ToolCall,
    as_call,
    call_limit,
    call_schema,
    envelope_schema,
    generic_tool_prompt,
    parse_envelope,
)


class ToolFormat(Protocol):
    """What every format offers. Native formats also build ``call_grammar(functions, parallel)``;
    the others write ``prompt(functions, calls_required)``, the system message describing the tools."""

    name: str
    native: bool  # the chat template renders the tools

    def parse(self, text: str) -> ParsedReply: ...

    def content_prefix(self, text: str) -> int: ...


def _before_marker(text: str, marker: str) -> int:
    """How much of `text` is surely plain content: up to `marker`, or up to a tail that could
    still grow into it."""
    index = text.find(marker)
    return index if index >= 0 else len(text) - marker_prefix_length(text, marker)


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def _more_calls(functions: Sequence[Function], separator: str, parallel: bool) -> str:
    """A grammar's tail for the calls after the first: none, or up to ``call_limit`` in all."""
    return f" ({json.dumps(separator)} call){{0,{call_limit(functions) - 1}}}" if parallel else ""


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesFormat:
    """Hermes / Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call."""

    name, native = "hermes", True
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def content_prefix(self, text: str) -> int:
        """The length of the reply's head that is surely content (streamed before a call)."""
        return _before_marker(text, "<tool_call>")

    def parse(self, text: str) -> ParsedReply:
        calls = [as_call(_loads(body)) for body in self._CALL.findall(text)]
        if not calls or not all(calls):
            return ParsedReply(text, [])
        return ParsedReply(_content(self._CALL.sub("", text)), calls)

    def call_grammar(self, functions: Sequence[Function], parallel: bool = True) -> str:
        more = _more_calls(functions, "\n", parallel)
        return (f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: {_json_rule(call_schema(functions))}")


class Llama3JsonFormat:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>``
    on some models), several separated by ``;``."""

    name, native = "llama3_json", True

    def content_prefix(self, text: str) -> int:
        head = text.lstrip()
        maybe_call = not head or head.startswith("{") or "<|python_tag|>".startswith(head[:14]) \
            or head.startswith("<|python_tag|>")
        return 0 if maybe_call else len(text)

    def parse(self, text: str) -> ParsedReply:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedReply(text, [])
        calls = [as_call(_loads(part)) for part in _split_top_level(body, ";")]
        return ParsedReply(None, calls) if calls and all(calls) else ParsedReply(text, [])

    def call_grammar(self, functions: Sequence[Function], parallel: bool = True) -> str:
        more = _more_calls(functions, ";", parallel)
        return f'start: call{more}\ncall: {_json_rule(call_schema(functions, "parameters"))}'


class MistralFormat:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker may be a
    special token a detokenizer drops, so a bare array of calls is read the same way)."""

    name, native = "mistral", True
    MARKER = "[TOOL_CALLS]"

    def content_prefix(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("["):  # the marker, or a bare array of calls
            return 0
        return _before_marker(text, self.MARKER)

    def parse(self, text: str) -> ParsedReply:
        head, marker, tail = text.partition(self.MARKER)
        body = tail if marker else text
        calls = _loads(body.strip())
        if isinstance(calls, list) and calls and all(map(as_call, calls)):
            return ParsedReply(_content(head) if marker else None, [as_call(c) for c in calls])
        return ParsedReply(text, [])

    def call_grammar(self, functions: Sequence[Function], parallel: bool = True, marker_id: int | None = None) -> str:
        """``marker_id``: the vocabulary's [TOOL_CALLS] token, which the grammar then requires as
        that token (a special token is no text); without it, the marker is written as text."""
        calls = {"type": "array", "items": call_schema(functions), "minItems": 1,
                 "maxItems": call_limit(functions) if parallel else 1}
        marker = f"<[{marker_id}]>" if marker_id is not None else f'"{self.MARKER}"'
        return f"start: {marker} calls\ncalls: {_json_rule(calls)}"


class GemmaFormat:
    """Gemma: Python calls in a code block, ``\\`\\`\\`tool_code\\n[name(key=value, ...)]\\n\\`\\`\\```;
    Gemma's templates take no tools, so they are described in a system message."""

    name, native = "gemma", False
    _BLOCK = re.compile(r"```tool_code\s*(.*?)\s*```", re.S)

    def content_prefix(self, text: str) -> int:
        return _before_marker(text, "```tool_code")
    _LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

    def parse(self, text: str) -> ParsedReply:
        match = self._BLOCK.search(text)
        calls = self._calls(match.group(1)) if match else None
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content(text[:match.start()] + text[match.end():]), calls)

    def _calls(self, source: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return None
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {kw.arg: self._value(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def _value(self, node: ast.AST):
        if isinstance(node, ast.Name) and node.id in self._LITERALS:
            return self._LITERALS[node.id]
        if isinstance(node, ast.List):
            return [self._value(item) for item in node.elts]
        if isinstance(node, ast.Dict):
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    def call_grammar(self, functions: Sequence[Function], parallel: bool = True) -> str:
        more = _more_calls(functions, ", ", parallel)
        rules = [f'start: "```tool_code\\n[" call{more} "]\\n```"', "call: " + " | ".join(
            f"call_{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            properties = function.parameters.get("properties", {})
            required = [name for name in function.parameters.get("required", []) if name in properties]
            arguments = ' ", " '.join(f'"{name}=" arg_{i}_{j}' for j, name in enumerate(required))
            rules.append(f'call_{i}: "{function.name}(" {arguments} ")"')
            rules += [f"arg_{i}_{j}: {_json_rule(properties[name])}" for j, name in enumerate(required)]
        return "\n".join(rules)

    def prompt(self, functions: Sequence[Function], calls_required: bool) -> str:
        listing = json.dumps([f.as_tool()["function"] for f in functions], ensure_ascii=False)
        answer = "" if calls_required else " Otherwise answer in plain text."
        return (f"You have access to these functions: {listing}\nTo call functions, reply with a Python list of "
                "calls with keyword arguments in a block: ```tool_code\n[name(key=value)]\n```." + answer)


class GenericFormat:
    """Any model: tools in a system message, the reply a JSON envelope enforced by a grammar."""

    name, native = "generic", False

    def content_prefix(self, text: str) -> int:
        return 0  # the whole reply is one JSON envelope

    def parse(self, text: str) -> ParsedReply:
        return parse_envelope(text)

    def reply_schema(self, functions: Sequence[Function], calls_required: bool, parallel: bool = True) -> dict:
        return envelope_schema(functions, calls_required, parallel)

    def prompt(self, functions: Sequence[Function], calls_required: bool) -> str:
        return generic_tool_prompt(functions, calls_required)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), GemmaFormat(),
                                                      HarmonyFormat(), GenericFormat())}


def format_for_template(source: str) -> ToolFormat:
    """The tool-call format a chat template's model was trained on; the generic form where the
    template says nothing about tools."""
    if template_is_harmony(source):
        return FORMATS["harmony"]
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral"]
    if "<|python_tag|>" in source or "ipython" in source:
        return FORMATS["llama3_json"]
    if "<start_of_turn>" in source:
        return FORMATS["gemma"]
    return FORMATS["generic"]


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` cut at `separator` where it is outside any JSON string, object or array."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]
