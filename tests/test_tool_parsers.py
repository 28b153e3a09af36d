"""Each family's tool-call format: replies read back into calls, the format chosen from a chat
template, and its call grammar (tool_choice "required"/named) enforced on the default model so
that what the grammar lets out always parses into schema-valid calls."""

from __future__ import annotations

import json

import pytest

from nanoserve.structured.tool_parsers import FORMATS, format_for_template
from nanoserve.structured.tools import Function, parse_envelope

jsonschema = pytest.importorskip("jsonschema")
WEATHER = Function("get_weather", "Weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer",
                                                                                           "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False})
CLOCK = Function("get_time", "The time.", {"type": "object", "properties": {}, "additionalProperties": False})


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in reply.tool_calls]


def test_hermes_calls_are_read_with_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    reply = FORMATS["hermes"].parse(text)
    assert calls_of(reply) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    assert reply.content == "Let me check."
    assert FORMATS["hermes"].parse("no calls here").content == "no calls here"


def test_llama3_json_calls_take_parameters_and_split_on_semicolons():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b", "days": 1}}; {"name": "get_time", "parameters": {}}'
    assert calls_of(FORMATS["llama3_json"].parse(text)) == [("get_weather", {"city": "a;b", "days": 1}),
                                                             ("get_time", {})]
    assert FORMATS["llama3_json"].parse("Hello {there}").tool_calls == []


def test_mistral_calls_follow_the_marker_or_stand_alone():
    body = '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]'
    for text in ("[TOOL_CALLS]" + body, body):
        assert calls_of(FORMATS["mistral"].parse(text)) == [("get_weather", {"city": "Rome", "days": 3})]
    assert FORMATS["mistral"].parse("[1, 2]").tool_calls == []


def test_gemma_tool_code_calls_are_read_as_python_calls():
    text = 'Sure.\n```tool_code\n[get_weather(city="Lima", days=4), get_time()]\n```'
    reply = FORMATS["gemma"].parse(text)
    assert calls_of(reply) == [("get_weather", {"city": "Lima", "days": 4}), ("get_time", {})]
    assert reply.content == "Sure."
    assert FORMATS["gemma"].parse("```tool_code\nimport os\n```").tool_calls == []


def test_the_generic_envelope_reads_calls_or_an_answer():
    calls = parse_envelope('{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert calls_of(calls) == [("get_time", {})] and calls.content is None
    answer = parse_envelope('{"content": "It is sunny."}')
    assert answer.content == "It is sunny." and answer.tool_calls == []


@pytest.mark.parametrize("source, name", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", "hermes"),
    ("{{ tools }}<|python_tag|>", "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
    ("<start_of_turn>user\n{{ messages }}", "gemma"),
    ("<|im_start|>{{ message['content'] }}", "generic"),
])
def test_the_format_is_chosen_from_the_chat_template(source, name):
    assert format_for_template(source).name == name


@pytest.mark.model
def test_each_formats_call_grammar_only_lets_out_valid_calls(smollm2_path):
    from nanoserve import SamplingParams, build_engine
    from nanoserve.structured import StructuredOutputs

    engine = build_engine(str(smollm2_path), max_batch_size=8, max_model_len=512)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Oslo for 3 days?"}])
    names = ["hermes", "llama3_json", "mistral", "gemma"]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=80,
                             structured=StructuredOutputs(grammar=FORMATS[n].call_grammar([WEATHER, CLOCK], False)))
              for i, n in enumerate(names)]
    # Mistral's marker as a token of its own: SmolLM2 has none by that name, so <|im_start|> stands in.
    marker = engine.tokenizer.backend.token_to_id("<|im_start|>")
    names.append("mistral")
    params.append(SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutputs(
        grammar=FORMATS["mistral"].call_grammar([WEATHER, CLOCK], False, marker_id=marker))))
    outputs = engine.generate([prompt] * len(names), params, use_tqdm=False)
    assert outputs[-1].token_ids[0] == marker
    for name, output in zip(names, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        reply = FORMATS[name].parse(output.text)  # a marker token is skipped in the text: a bare array
        assert len(reply.tool_calls) == 1, (name, output.text)
        call = reply.tool_calls[0]
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.name].parameters
        jsonschema.validate(json.loads(call.arguments), schema)


REPLIES = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    "gemma": 'Sure.\n```tool_code\n[get_weather(city="Oslo", days=2)]\n```',
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]}',
}
PLAIN = "Oslo is usually mild in spring, with rain < 3 days a week."


@pytest.mark.parametrize("name", sorted(REPLIES))
@pytest.mark.parametrize("calls", [True, False])
def test_a_streamed_auto_reply_gives_what_the_whole_reply_gives_wherever_it_is_cut(name, calls):
    pytest.importorskip("fastapi")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from nanoserve.serve.tool_calling import ToolPlan, ToolReplyStream, reply_message

    plan = ToolPlan(FORMATS[name], [WEATHER, CLOCK], [WEATHER, CLOCK], "auto", parallel=True)
    text = REPLIES[name] if calls else (json.dumps({"content": PLAIN}) if name == "generic" else PLAIN)
    whole, whole_reason = reply_message(plan, text, "stop")

    @settings(max_examples=20, deadline=None)
    @given(cuts=st.lists(st.integers(0, len(text)), max_size=6))
    def check(cuts):
        stream, content = ToolReplyStream(plan), ""
        bounds = [0, *sorted(cuts), len(text)]
        for start, end in zip(bounds, bounds[1:]):
            content += stream.feed(text[start:end])
        rest, streamed_calls, reason = stream.finish("stop")
        content += rest
        assert reason == whole_reason == ("tool_calls" if calls else "stop")
        assert content.strip() == (whole["content"] or "").strip()
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in whole.get("tool_calls", [])]

    check()
    if not calls and name != "generic":  # plain text streams before the reply ends
        stream = ToolReplyStream(plan)
        assert stream.feed(PLAIN[:20]) == PLAIN[:20]


def test_an_envelope_cut_by_max_tokens_keeps_its_completed_calls_and_never_shows_raw():
    from nanoserve.structured.tools import parse_envelope

    whole = '{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "two"}}]}'
    for cut, names in ((len(whole) - 2, ["a", "b"]), (whole.index('{"name": "b"') + 5, ["a"]), (20, [])):
        reply = parse_envelope(whole[:cut])
        assert reply.content is None and [c.name for c in reply.tool_calls] == names, cut
    assert parse_envelope('{"content": "half a sen').content == "half a sen"
    assert parse_envelope('{"content": "tab\\').content == "tab"  # cut inside an escape
    assert parse_envelope("plain text").content == "plain text"


def test_a_strict_function_takes_only_the_keys_its_schema_names():
    from nanoserve.structured.tools import strict_parameters

    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                                               "tags": {"type": "array", "items": {"type": "object"}}},
              "required": ["city"]}
    strict = strict_parameters(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["where"]["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert strict["properties"]["city"] == {"type": "string"} and "additionalProperties" not in schema
    assert strict_parameters({"type": "object", "additionalProperties": True}) == {"type": "object",
                                                                                 "additionalProperties": True}
