"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
anthropic client: the same text as Engine.chat, the named SSE events of a stream, a tool round
trip (tool_use, tool_result, an answer), thinking kept apart, token counts, errors in Anthropic's
shape, and x-api-key auth.

The engine is a random 2-layer model in SmolLM2-135M's shape with SmolLM2's real tokenizer and
chat template (as tests/test_serve.py), so text, templates and tool grammars are the real ones.
The SDK takes no sampling fields any more; temperature goes in as extra_body, as clients send it."""

from __future__ import annotations

import copy
import json
import time

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from conftest import random_smollm2_shaped, served  # noqa: E402

from nanoserve.engine import SamplingParams, build_engine  # noqa: E402
from nanoserve.model.formats.tokenizer import ChatTemplate  # noqa: E402

API_KEY = "sk-nanoserve-test"
MODEL = "smollm2-test"
ENGINE_OPTIONS = dict(max_batch_size=4, max_model_len=512, kv_cache_bytes=24 << 20, block_size=16)
MESSAGES = [{"role": "user", "content": "Write a haiku about paged attention."}]
GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
           "additionalProperties": False}  # closed, so that a random model's call ends
TOOLS = [{"name": "get_weather", "description": "Current weather in Paris.", "input_schema": WEATHER},
         {"name": "get_time", "description": "Current time.", "input_schema": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# A ChatML template of a thinking model whose generation prompt opens the block (tests/test_reasoning.py's).
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
    with served(build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS), MODEL, API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def thinker(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = ChatTemplate(THINKING_TEMPLATE)
    with served(build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS), "thinker", None) as server, \
            anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def sse_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed request's raw events as (name, data), read off the wire."""
    events, name = [], None
    with httpx.Client(base_url=server.url, timeout=60) as plain, \
            plain.stream("POST", "/v1/messages", json={**body, "stream": True},
                         headers={"x-api-key": API_KEY, **(headers or {})}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_a_message_is_engine_chats_text(client, reference):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=20))
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=MESSAGES, extra_body=GREEDY)
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == expected.text
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert reply.stop_sequence is None
    assert reply.usage.input_tokens == len(expected.prompt_token_ids)
    assert reply.usage.output_tokens == len(expected.token_ids)


def test_a_system_prompt_and_text_blocks_render_as_chat_messages(client, reference):
    system, question = "You are terse.", "Name a colour."
    expected = reference.chat([{"role": "system", "content": system}, {"role": "user", "content": question}],
                              SamplingParams(temperature=0.0, max_tokens=8))
    reply = client.messages.create(model=MODEL, max_tokens=8, system=[{"type": "text", "text": system}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
                                   extra_body=GREEDY)
    assert reply.usage.input_tokens == len(expected.prompt_token_ids)
    assert "".join(b.text for b in reply.content) == expected.text


def test_a_stop_sequence_ends_the_reply_and_is_named(client, reference):
    text = reference.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=20)).text
    stop = text.strip()[:2] or text[:1]
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=MESSAGES, stop_sequences=[stop],
                                   extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert "".join(b.text for b in reply.content) == text[:text.index(stop)]


def test_a_stream_sends_anthropics_events_in_order(server, client):
    body = {"model": MODEL, "max_tokens": 12, "messages": MESSAGES, **GREEDY}
    events = sse_events(server, body)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == whole.stop_reason
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    # The SDK's own stream helper assembles the same message.
    with client.messages.stream(model=MODEL, max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
        assembled = stream.get_final_message()
    assert assembled.content[0].text == whole.content[0].text and assembled.stop_reason == whole.stop_reason


def test_a_tool_round_trip_tool_use_then_tool_result_then_text(client):
    first = client.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert calls[0].input["unit"] in ("celsius", "fahrenheit")
    history = QUESTION + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                      "content": [{"type": "text", "text": '{"sky": "clear", "temp": 18}'}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=10, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text
    # "any" with parallel use off: exactly one call, of either tool.
    anyone = client.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, tools=TOOLS, extra_body=GREEDY,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use"
    assert [b.name for b in anyone.content if b.type == "tool_use"] in (["get_weather"], ["get_time"])


def test_a_streamed_tool_call_arrives_as_input_json_deltas(server, client):
    body = {"model": MODEL, "max_tokens": 60, "messages": QUESTION, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    events = sse_events(server, body)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [block["type"] for block in starts] == ["tool_use"] and starts[0]["input"] == {}
    partial = "".join(data["delta"]["partial_json"] for name, data in events
                      if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta")
    whole = client.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert json.loads(partial) == whole.content[-1].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_thinking_is_kept_apart_streamed_and_not(thinker):
    ask = dict(model="thinker", max_tokens=12, messages=[{"role": "user", "content": "What is 2 + 2?"}],
               extra_body=GREEDY)
    reply = thinker.messages.create(**ask)
    # The prompt opened the block and 12 tokens never close it: all of the reply is thinking.
    assert [block.type for block in reply.content] == ["thinking"] and reply.stop_reason == "max_tokens"
    assert reply.content[0].thinking and reply.content[0].signature  # a random model thinks in newlines
    with thinker.messages.stream(**ask) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "thinking" in events and "signature" in events  # the SDK's thinking_delta and signature_delta
    assert streamed.content[0].thinking == reply.content[0].thinking
    assert streamed.content[0].signature == reply.content[0].signature
    hidden = thinker.messages.create(**ask, thinking={"type": "disabled"})
    assert hidden.content == [] and hidden.usage.output_tokens == reply.usage.output_tokens


def test_count_tokens_is_the_prompt_a_message_renders(client):
    request = dict(model=MODEL, messages=QUESTION, system="Be brief.", tools=TOOLS,
                   tool_choice={"type": "tool", "name": "get_weather"})
    counted = client.messages.count_tokens(**request)
    reply = client.messages.create(max_tokens=60, **request, extra_body=GREEDY)
    assert counted.input_tokens == reply.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens < counted.input_tokens


def anthropic_error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.parametrize("body, status, kind, says", [
    ({"model": MODEL, "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": MESSAGES}, 404, "not_found_error", "claude-sonnet"),
    ({"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "frequency_penalty": 1}, 400, "invalid_request_error",
     "frequency_penalty"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "image"),
    ({"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "send_email"}}, 400, "invalid_request_error", "send_email"),
    ({"model": MODEL, "max_tokens": 4, "messages": QUESTION,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "server tools"),
    ({"model": MODEL, "max_tokens": 0, "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": "8", "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": MESSAGES + [{"role": "assistant", "content": "Sure"}]},
     400, "invalid_request_error", "prefill"),
])
def test_bad_requests_get_anthropic_shaped_errors(server, body, status, kind, says):
    with httpx.Client(base_url=server.url, headers={"x-api-key": API_KEY}) as plain:
        assert says in anthropic_error(plain.post("/v1/messages", json=body), status, kind)


def test_bad_json_and_the_sdks_exceptions(server, client):
    with httpx.Client(base_url=server.url, headers={"x-api-key": API_KEY}) as plain:
        response = plain.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
        assert "JSON" in anthropic_error(response, 400, "invalid_request_error")
        # The fields Anthropic's clients send for their own service are accepted (and ignored).
        ignored = {"metadata": {"user_id": "u1"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"}}
        body = {"model": MODEL, "max_tokens": 2, "messages": MESSAGES, **ignored}
        assert plain.post("/v1/messages", json=body).status_code == 200
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=MESSAGES)


def test_the_key_goes_as_x_api_key_or_a_bearer_token(server):
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong, \
            pytest.raises(anthropic.AuthenticationError) as error:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
    assert error.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=API_KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0
    with httpx.Client(base_url=server.url) as plain:
        missing = plain.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": MESSAGES})
        assert "x-api-key" in anthropic_error(missing, 401, "authentication_error")
        # Every route takes either header; OpenAI's keep OpenAI's error shape.
        assert plain.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert plain.get("/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_an_unknown_route_is_a_404_at_once_without_key_or_body(server):
    metrics = server.engine_loop.metrics
    admitted = metrics.prompt_tokens
    with httpx.Client(base_url=server.url, timeout=5) as plain:
        started = time.monotonic()
        response = plain.post("/api/event_logging/batch", json={"events": [{"name": "x"}] * 1000})
        assert response.status_code == 404 and time.monotonic() - started < 1
        assert "/api/event_logging/batch" in response.json()["error"]["message"]
        assert plain.get("/v1/messages/nothing-here").json()["error"]["type"] == "not_found_error"
        assert plain.get("/v1/messages", headers={"x-api-key": API_KEY}).status_code == 405  # a route: not a 404
    assert metrics.prompt_tokens == admitted  # no engine work


def test_output_config_format_holds_the_reply_to_a_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    reply = client.messages.create(model=MODEL, max_tokens=30, messages=MESSAGES, extra_body=GREEDY,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(reply.content[0].text)["answer"] in ("yes", "no") and reply.stop_reason == "end_turn"
