"""Tool calling through the server with the official openai client on the default model (whose
template takes no tools: the generic form, a JSON envelope enforced by a grammar): "required"
and named choices always give parseable calls with schema-valid arguments, a call round trip
(call, tool result, answer) streamed and not, and a 400 for each bad tools/tool_choice."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import served  # noqa: E402

from nanoserve import build_engine  # noqa: E402

pytestmark = pytest.mark.model
MODEL = "smollm2"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = build_engine(str(smollm2_path), max_batch_size=8, max_model_len=1024, compile=False)
    with served(engine, MODEL, None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def check_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.type == "function" and call.id and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_required_and_named_choices_always_give_schema_valid_calls(client, sampling):
    required = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                              max_tokens=120, **sampling)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    named = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           **sampling)
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        check_call(call, names=("get_time",))


def test_a_call_round_trip_through_a_tool_result_to_an_answer(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
    calls = first.choices[0].message.tool_calls
    assert len(calls) == 1
    arguments = check_call(calls[0])
    result = {"city": arguments.get("city"), "temperature": 18, "sky": "clear"}
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps(result)}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=30)
    message = answer.choices[0].message
    assert not message.tool_calls and message.content
    auto = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=60)
    message = auto.choices[0].message
    if message.tool_calls:  # the model may call again; then the call must be a valid one
        assert auto.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            check_call(call)
    else:
        assert isinstance(message.content, str) and auto.choices[0].finish_reason in ("stop", "length")


def test_a_streamed_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=120, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    unstreamed = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                                temperature=0, max_tokens=120)
    assert finish == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in unstreamed.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(call["id"] for call in calls.values())


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_or_tool_choice_is_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body


# A ChatML template that takes tools and writes calls the Hermes/Qwen way (as Qwen2.5's does).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. <tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def hermes_client(smollm2_path):
    from nanoserve.model.formats.tokenizer import ChatTemplate

    engine = build_engine(str(smollm2_path), max_batch_size=8, max_model_len=1024, compile=False)
    engine.tokenizer.chat_template = ChatTemplate(HERMES_TEMPLATE)
    with served(engine, MODEL, None) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_a_template_that_takes_tools_renders_them_and_its_calls_are_parsed(hermes_client):
    first = hermes_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_call(calls[0])
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18}'}]
    stream = hermes_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                                   max_tokens=40, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    finish = next(c.finish_reason for c in reversed(chunks) if c.finish_reason)
    streamed_calls = [d for c in chunks for d in (c.delta.tool_calls or [])]
    if streamed_calls:
        assert finish == "tool_calls"
        for delta in streamed_calls:
            jsonschema.validate(json.loads(delta.function.arguments), SCHEMAS[delta.function.name])
    else:
        assert "".join(c.delta.content or "" for c in chunks) and finish in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tools_without_max_tokens_come_back_as_one_parsed_call(client, tool_choice):
    # parallel_tool_calls unset means one call (llama-server's default): the envelope's grammar
    # closes after it, instead of the model repeating calls to the token limit.
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    check_call(choice.message.tool_calls[0])
    assert reply.usage.completion_tokens <= 256


def test_a_reply_cut_by_max_tokens_never_returns_the_raw_envelope(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=True, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "tool_calls")
    assert not (choice.message.content or "").lstrip().startswith("{")
    for call in choice.message.tool_calls or []:
        check_call(call)


def test_a_strict_function_call_carries_only_the_keys_its_schema_names(client):
    # An open schema (no additionalProperties) made strict: the grammar closes every object.
    open_weather = {k: v for k, v in WEATHER.items() if k != "additionalProperties"}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                               "parameters": open_weather, "strict": True}}]
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice="required",
                                               temperature=1.0, seed=seed, max_tokens=120)
        (call,) = reply.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) <= set(WEATHER["properties"])
