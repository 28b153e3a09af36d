"""Structured output through the server with the official openai client on the default model:
response_format (a pydantic model, json_schema, json_object), vLLM's guided_* fields, and a 400
naming the field for each input that cannot be enforced."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from conftest import served  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from structured_schemas import json_schemas  # noqa: E402

from nanoserve import build_engine  # noqa: E402

pytestmark = pytest.mark.model
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = build_engine(str(smollm2_path), max_batch_size=8, max_model_len=1024, compile=False)
    with served(engine, MODEL, None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_parse_with_a_pydantic_model_returns_an_instance(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ask("Describe Paris as JSON."),
                                               response_format=City, temperature=0, max_tokens=100)
    message = completion.choices[0].message
    assert isinstance(message.parsed, City)
    assert completion.choices[0].finish_reason == "stop"


@settings(max_examples=max(3, settings().max_examples // 10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas())
def test_generated_schemas_through_the_client_always_validate_greedy_and_sampled(client, schema):
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        reply = client.chat.completions.create(model=MODEL, messages=ask("Reply in JSON: " + json.dumps(schema)),
                                               response_format=response_format, max_tokens=200, **sampling)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_schema_and_json_object_replies_parse_on_both_endpoints(client):
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                           "minItems": 1, "maxItems": 3}},
              "required": ["colours"], "additionalProperties": False}
    strict = {"type": "json_schema", "json_schema": {"name": "colours", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=ask("Name colours."), response_format=strict,
                                          temperature=0.7, seed=4, max_tokens=60)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    completion = client.completions.create(model=MODEL, prompt="Colours as JSON:", max_tokens=60, temperature=0,
                                           extra_body={"response_format": strict})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    anything = client.chat.completions.create(model=MODEL, messages=ask("A JSON object, please."),
                                              response_format={"type": "json_object"}, temperature=0,
                                              max_tokens=80)
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # ran out of tokens inside the object: the reply is cut, as OpenAI's is
        assert anything.choices[0].finish_reason == "length"


def test_guided_fields_are_enforced_streamed_and_not(client):
    regex = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    reply = client.chat.completions.create(model=MODEL, messages=ask("A city and a year."), temperature=0,
                                           max_tokens=20, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, reply.choices[0].message.content)
    choices = ["positive", "negative"]
    stream = client.chat.completions.create(model=MODEL, messages=ask("I love it! Sentiment?"), max_tokens=10,
                                            stream=True, extra_body={"guided_choice": choices})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text in choices
    completion = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=0,
                                           extra_body={"guided_grammar": 'root ::= "A" | "B" | "C"'})
    assert completion.choices[0].text in ("A", "B", "C")
    completion = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert completion.choices[0].text in ("up", "down")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    completion = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=20, temperature=0,
                                           extra_body={"guided_json": json.dumps(schema)})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
])
def test_a_structure_that_cannot_be_enforced_is_a_400_naming_its_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=5, extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body=fields)


def test_a_grammar_slower_than_the_time_limit_is_a_400_and_the_server_keeps_serving(client, server):
    state = server.server.app.state.serve
    state.compile_timeout, before = 0.0, state.compile_timeout
    try:
        with pytest.raises(openai.BadRequestError, match="did not compile within"):
            client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=5,
                                           extra_body={"guided_regex": "[a-z]{1,7}-[0-9]{3}"})
    finally:
        state.compile_timeout = before
    reply = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_metrics_count_constrained_requests_and_mask_time(client, server):
    client.chat.completions.create(model=MODEL, messages=ask("Yes?"), max_tokens=5,
                                   extra_body={"guided_choice": ["yes", "no"]})
    text = httpx.get(f"{server.url}/metrics").text
    values = {name: float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M).group(1))
              for name in ("nanoserve_structured_requests_total", "nanoserve_mask_steps_total",
                           "nanoserve_mask_seconds_total")}
    assert values["nanoserve_structured_requests_total"] >= 1
    assert values["nanoserve_mask_steps_total"] >= 1 and values["nanoserve_mask_seconds_total"] > 0
