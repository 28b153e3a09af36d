"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

and a tool call is a commentary message addressed to the function, ended by ``<|call|>``:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may sit in the header before the channel too). The ``analysis`` channel is the
reasoning (OpenAI's ``reasoning_content``), ``final`` the answer, a commentary message without a
recipient a preamble shown as content. The reply's first message needs no ``<|start|>``: the
prompt ends with ``<|start|>assistant``. The markers are special tokens, so the reply is read from
text detokenized with them kept. Generation stops at ``<|return|>`` and ``<|call|>``
(``HARMONY_STOPS``).

``HarmonyStream`` reads the reply as it streams (deltas split anywhere, even inside a marker);
``parse_harmony`` reads it whole; ``HarmonyFormat`` is the tool-call parser ``harmony``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nanoserve.structured.reasoning import marker_prefix_length
from nanoserve.structured.tools import COMPACT, Function, ParsedReply, ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
BODY_ENDS = (END, RETURN, CALL)
HARMONY_STOPS = (RETURN, CALL)  # the tokens a harmony reply stops at
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
REASONING_EFFORTS = ("low", "medium", "high")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def template_is_harmony(source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return CHANNEL in source and MESSAGE in source and "<|start|>" in source


@dataclass
class Header:
    """A message's header: its channel and recipient (``functions.NAME`` for a tool call)."""

    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL_NAME.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    @property
    def kind(self) -> str:
        """"reasoning", "content" or "call"."""
        if self.recipient is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


@dataclass
class HarmonyStream:
    """Text deltas in, (reasoning delta, content delta) out; the tool calls once whole
    (``calls``). Holds back only a tail that could still grow into a marker."""

    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _header: Header | None = None  # None: reading a header
    _call_body: str = ""
    saw_reasoning: bool = False
    saw_content: bool = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, content = [], []
        while True:
            if self._header is None:
                head, marker, rest = self._held.partition(MESSAGE)
                if not marker:
                    return "".join(reasoning), "".join(content)
                self._header, self._held, self._call_body = Header.parse(head), rest, ""
            ends = [(i, m) for m in BODY_ENDS if (i := self._held.find(m)) >= 0]
            if ends:
                index, marker = min(ends)
                self._emit(self._held[:index], reasoning, content)
                self._close()
                self._held = self._held[index + len(marker):]
                continue
            keep = max(marker_prefix_length(self._held, m) for m in BODY_ENDS)
            self._emit(self._held[:len(self._held) - keep], reasoning, content)
            self._held = self._held[len(self._held) - keep:]
            return "".join(reasoning), "".join(content)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        kind = self._header.kind
        if kind == "call":
            self._call_body += text
        elif kind == "reasoning":
            self.saw_reasoning = True
            reasoning.append(text)
        else:
            self.saw_content = True
            content.append(text)

    def _close(self) -> None:
        if self._header is not None and self._header.kind == "call":
            name = self._header.recipient.removeprefix("functions.")
            self.calls.append(ToolCall(name, _arguments(self._call_body)))
        self._header = None

    def finish(self) -> tuple[str, str]:
        """The rest at the end of the reply (a body cut short counts as ended there)."""
        reasoning, content = [], []
        if self._header is not None:
            self._emit(self._held, reasoning, content)
            self._close()
        self._held = ""
        return "".join(reasoning), "".join(content)


def _arguments(body: str) -> str:
    """A call's arguments as compact JSON where they are JSON, else as written."""
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except json.JSONDecodeError:
        return body.strip()


def parse_harmony(text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a whole reply; None where it has no such part."""
    stream = HarmonyStream()
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if stream.saw_reasoning else None, content if stream.saw_content else None, stream.calls)


class HarmonyFormat:
    """gpt-oss: tool calls as commentary messages to ``functions.NAME`` (the template renders the
    tools); the reasoning and the answer are the other channels."""

    name, native = "harmony", True
    MARKERS = MARKERS  # the special tokens its call grammar names (plan_tools finds their ids)

    def content_prefix(self, text: str) -> int:
        return 0  # the raw reply is markers and channels: it is read whole

    def parse(self, text: str) -> ParsedReply:
        _, content, calls = parse_harmony(text)
        return ParsedReply(content.strip() if content and content.strip() else None, calls)

    def call_grammar(self, functions: Sequence[Function], parallel: bool = True,
                     marker_ids: Mapping[str, int | None] | None = None) -> str:
        """One call (a harmony reply stops at its ``<|call|>``, so ``parallel`` changes nothing):
        ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>``,
        the arguments by the function's schema. ``marker_ids``: the vocabulary's marker tokens,
        which the grammar then requires as those tokens (a special token is no text); a marker
        without one is written as text."""
        def marker(text: str) -> str:
            token = (marker_ids or {}).get(text)
            return f"<[{token}]>" if token is not None else json.dumps(text)

        rules = [f'start: {marker(CHANNEL)} "commentary to=" call',
                 "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            rules.append(f'call_{i}: {json.dumps(f"functions.{function.name} ")} {marker(CONSTRAIN)} "json" '
                         f"{marker(MESSAGE)} arguments_{i} {marker(CALL)}")
            rules.append(f"arguments_{i}: %json " + json.dumps({**function.parameters, "x-guidance": COMPACT},
                                                               ensure_ascii=False))
        return "\n".join(rules)
