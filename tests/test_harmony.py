"""The harmony format (gpt-oss) read back: the analysis channel as reasoning, final as the
answer, a commentary message to functions.NAME as a tool call; whole and streamed in pieces
split anywhere, even inside a marker."""

from __future__ import annotations

import json
import random

import pytest

from nanoserve.structured.harmony import HarmonyStream, parse_harmony, template_is_harmony
from nanoserve.structured.tool_parsers import FORMATS, format_for_template

REASONING_AND_FINAL = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
# The recipient in the header before the channel, a preamble on commentary, two calls.
TWO_CALLS = ("<|channel|>commentary<|message|>Checking both.<|end|>"
             '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone":"UTC"}<|call|>'
             '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>')


def test_reasoning_and_final():
    assert parse_harmony(REASONING_AND_FINAL) == ("The user greets; answer briefly.", "Hello! How can I help?", [])


def test_a_tool_call():
    reasoning, content, calls = parse_harmony(TOOL_CALL)
    assert reasoning == "Need the weather: call the tool." and content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    reply = FORMATS["harmony"].parse(TOOL_CALL)
    assert reply.content is None and reply.tool_calls[0].name == "get_weather"


def test_two_calls_with_a_preamble_and_the_recipient_before_the_channel():
    reasoning, content, calls = parse_harmony(TWO_CALLS)
    assert reasoning is None and content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"}),
                                                                 ("get_weather", {"city": "Oslo"})]


def test_a_reply_cut_short_and_one_without_markers():
    assert parse_harmony("<|channel|>analysis<|message|>Still think") == ("Still think", None, [])
    assert parse_harmony("<|channel|>final<|message|>Hi") == (None, "Hi", [])
    assert parse_harmony("") == (None, None, [])


@pytest.mark.parametrize("text", [REASONING_AND_FINAL, TOOL_CALL, TWO_CALLS])
@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_pieces_split_anywhere_is_the_whole_reply(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(1, 40))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = HarmonyStream()
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        assert "<|" not in r + c and "|>" not in r + c  # no marker leaks, not even a piece of one
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    reasoning, content = reasoning + r, content + c
    want_reasoning, want_content, want_calls = parse_harmony(text)
    assert (reasoning, content) == (want_reasoning or "", want_content or "")
    assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in want_calls]


def test_the_template_picks_the_harmony_parser():
    source = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    assert template_is_harmony(source) and format_for_template(source).name == "harmony"
    assert format_for_template("{{ '<tool_call>' }}").name == "hermes"


def test_a_harmony_reply_becomes_openais_message():
    from nanoserve.serve.chat import openai_message
    from nanoserve.serve.chat_reply import ReplyShape
    from nanoserve.serve.reply import Reply, Usage

    def message(shape: ReplyShape, text: str) -> tuple[dict, str]:
        thought, answer, calls, finish = shape.read(text, "stop")
        return openai_message(Reply(answer, thought, calls, finish, None, Usage(0, 0))), finish

    message_, finish = message(ReplyShape(None, None, harmony=True), REASONING_AND_FINAL)
    assert message_ == {"role": "assistant", "content": "Hello! How can I help?",
                        "reasoning_content": "The user greets; answer briefly."} and finish == "stop"

    class Plan:
        choice, parallel = "auto", True

    message_, finish = message(ReplyShape(Plan(), None, harmony=True), TOOL_CALL)
    assert finish == "tool_calls" and message_["content"] is None
    assert message_["reasoning_content"] == "Need the weather: call the tool."
    call, = message_["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] == "Paris"


def test_the_call_grammar_names_the_marker_tokens_it_has():
    from nanoserve.structured.tools import Function

    functions = [Function("get_weather", "", {"type": "object"}), Function("get_time", "", {"type": "object"})]
    ids = {"<|channel|>": 7, "<|constrain|>": 8, "<|message|>": 9, "<|call|>": None}
    grammar = FORMATS["harmony"].call_grammar(functions, marker_ids=ids)
    assert grammar.startswith('start: <[7]> "commentary to=" call\ncall: call_0 | call_1\n')
    assert 'call_1: "functions.get_time " <[8]> "json" <[9]> arguments_1 "<|call|>"' in grammar
    assert "<[" not in FORMATS["harmony"].call_grammar(functions)  # no such tokens: the markers as text
