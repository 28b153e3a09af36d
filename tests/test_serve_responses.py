"""OpenAI's Responses API (POST /v1/responses, stateless) through the official openai client: the
same text as Engine.chat, the typed SSE events of a stream in order, a function tool round trip
(function_call, function_call_output, an answer), a text.format JSON schema reply, reasoning kept
apart, and 400s in OpenAI's error shape (store=true, previous_response_id, bad input).

The engine is a random 2-layer model in SmolLM2-135M's shape with SmolLM2's real tokenizer and
chat template (as tests/test_serve_messages.py), so text, templates and tool grammars are the real ones."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from conftest import random_smollm2_shaped, served  # noqa: E402

from nanoserve.engine import SamplingParams, build_engine  # noqa: E402
from nanoserve.model.formats.tokenizer import ChatTemplate  # noqa: E402

MODEL = "smollm2-test"
ENGINE_OPTIONS = dict(max_batch_size=4, max_model_len=512, kv_cache_bytes=24 << 20, block_size=16)
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in Paris.",
          "parameters": WEATHER, "strict": True},
         {"type": "web_search"}]  # a hosted tool (Codex sends them): skipped, not refused
QUESTION = "What is the weather in Paris?"
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
                     "{# replies end their reasoning with </think> #}")


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2_path):
    return random_smollm2_shaped(smollm2_path)


@pytest.fixture(scope="module")
def reference(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    return build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with served(build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS), MODEL, None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_a_response_is_engine_chats_text(client, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    expected = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))
    reply = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a colour.",
                                    max_output_tokens=12, temperature=0)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.output_text == expected.text
    assert [item.type for item in reply.output] == ["message"]
    message = reply.output[0]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    assert reply.usage.input_tokens == len(expected.prompt_token_ids)
    assert reply.usage.output_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    if expected.finish_reason == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed" and reply.incomplete_details is None
    # The same conversation as input items (developer is system; text parts join).
    items = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                        {"type": "input_text", "text": "colour."}]}])
    assert items.output_text == expected.text


def test_a_streamed_response_is_the_typed_event_sequence(client, server):
    whole = client.responses.create(model=MODEL, input="Write a haiku.", max_output_tokens=16, temperature=0)
    with client.responses.create(model=MODEL, input="Write a haiku.", max_output_tokens=16, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert events[0].response.status == "in_progress"
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    # On the wire: `event: TYPE` names each data line's type.
    with httpx.Client(base_url=server.url, timeout=60) as plain, plain.stream(
            "POST", "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                           "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [data["type"] for data in datas] and names[0] == "response.created"


def test_a_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = [{"role": "user", "content": QUESTION},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}]
    answer = client.responses.create(model=MODEL, input=history, tools=TOOLS, tool_choice="none", temperature=0,
                                     max_output_tokens=20)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # Streamed, a call is its item's events: added, the arguments' delta and done, item done.
    with client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required", temperature=0,
                                 max_output_tokens=60, stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    assert events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["function_call"]


def test_a_json_schema_text_format_reply_parses_and_validates(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    reply = client.responses.create(model=MODEL, input="A colour and a count, as JSON.", temperature=0,
                                    max_output_tokens=80,
                                    text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                     "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_reasoning_comes_back_as_a_reasoning_item(model_and_tokenizer, reference):
    model, tokenizer = model_and_tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = ChatTemplate(THINKING_TEMPLATE)
    with served(build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS), "thinker", None) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        reply = c.responses.create(model="thinker", input="Think.", max_output_tokens=12, temperature=0,
                                   reasoning={"effort": "low", "summary": "auto"})
        assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text
        assert reply.output[0].summary[0].text == reply.output[0].content[0].text
        with c.responses.create(model="thinker", input="Think.", max_output_tokens=12, temperature=0,
                                stream=True) as stream:
            events = list(stream)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reply.output[0].content[0].text


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_input_is_a_400_in_openais_shape(server, fields, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "function.parameters" not in error["message"] and "max_completion_tokens" not in error["message"]


def test_the_clients_own_refusals(client):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.create(model=MODEL, input="hi", store=True)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_abc")
