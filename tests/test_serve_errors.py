"""Bad input over HTTP: every refusal has the right status and OpenAI's error shape, and the
server keeps serving. A tiny token-id engine (no tokenizer) is enough: all of this happens
before or beside generation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import served  # noqa: E402

from nanoserve.engine import build_engine  # noqa: E402
from nanoserve.model.network.synthetic import random_model, tiny_config  # noqa: E402
from nanoserve.serve.engine_loop import EngineLoop  # noqa: E402
from nanoserve.serve.protocol import IGNORED_FIELDS  # noqa: E402
from nanoserve.worker.sampler import Sampler  # noqa: E402

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server():
    engine = build_engine(random_model(tiny_config(), seed=0), max_batch_size=4, kv_cache_bytes=1 << 20,
                          block_size=4, max_model_len=MAX_MODEL_LEN)
    with served(engine, "tiny", API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def assert_openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def completion(client, **fields):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], **fields})


def assert_still_serving(client) -> None:
    response = completion(client, max_tokens=3, temperature=0, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_malformed_json_is_a_400(client):
    for raw in ('{"model": "tiny", "prompt": [1,', "not json", ""):
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(response, 400)
    response = client.post("/v1/chat/completions", content="[1, 2]",
                           headers={"content-type": "application/json"})
    assert_openai_error(response, 400)
    assert_still_serving(client)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1]}, "model"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]}, "messages"),
])
def test_missing_fields_are_400s_naming_the_field(client, path, body, param):
    error = assert_openai_error(client.post(path, json=body), 400, param, "missing_required_parameter")
    assert param in error["message"]


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"n": 2}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"echo": True}, "echo"),  # token ids are echoed as text, and this engine has no tokenizer
    ({"prompt": [[1]] * 65}, "prompt"),  # a batch over MAX_PROMPTS
    ({"prompt": [[1], [2]], "stream": True}, "prompt"),  # a streamed batch
])
def test_out_of_range_or_unsupported_parameters_are_400s(client, fields, param):
    error = assert_openai_error(completion(client, **fields), 400, param)
    assert param in error["message"]


def test_chat_parameters_are_checked_too(client):
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "n": 3}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "n")
    body = {"model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 99}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    # This engine has no tokenizer, so chat cannot be served: said clearly, not a 500.
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
    error = assert_openai_error(response, 400, "messages")
    assert "chat template" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_field_is_a_400_naming_it(client, path):
    body = {"model": "tiny", "prompt": [1], "messages": [{"role": "user", "content": "hi"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    error = assert_openai_error(client.post(path, json={**body, "foo": 1}), 400, "foo", "unknown_parameter")
    assert error["message"] == "unknown parameter: 'foo'"
    error = assert_openai_error(client.post(path, json={**body, "foo": 1, "chat_template_kwargs": {}}), 400, "foo")
    assert "'foo'" in error["message"] and "'chat_template_kwargs'" in error["message"]


def test_a_misspelt_field_is_named_before_the_field_it_meant_is_missed(client):
    response = client.post("/v1/completions", json={"model": "tiny", "promt": [1]})
    assert "'promt'" in assert_openai_error(response, 400, "promt", "unknown_parameter")["message"]


IGNORED_BY_DESIGN = {"user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
                     "prompt_cache_key": "k", "safety_identifier": "s"}


def test_the_fields_ignored_by_design_are_accepted(client):
    assert tuple(IGNORED_BY_DESIGN) == IGNORED_FIELDS
    response = completion(client, max_tokens=2, temperature=0, ignore_eos=True, **IGNORED_BY_DESIGN)
    assert response.status_code == 200, response.text
    # Chat gets past them to the refusal this tokenizer-less engine gives every chat request.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **IGNORED_BY_DESIGN}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "messages")
    assert "chat template" in error["message"]


def test_the_readme_lists_the_fields_ignored_by_design():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("ignored by design"):][:400]
    assert all(f"`{name}`" in section for name in IGNORED_FIELDS), section


def test_a_field_ignored_by_design_is_still_type_checked(client):
    assert_openai_error(completion(client, store="yes"), 400, "store", "invalid_value")


def test_prompt_longer_than_max_model_len_is_a_400(client):
    error = assert_openai_error(completion(client, prompt=list(range(MAX_MODEL_LEN + 5))), 400, "prompt",
                                "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    assert_openai_error(completion(client, prompt=list(range(MAX_MODEL_LEN))), 400, "prompt")
    # A prompt that fits, with a reply that cannot:
    assert_openai_error(completion(client, prompt=[1] * 60, max_tokens=10), 400, "max_tokens",
                        "context_length_exceeded")
    assert_still_serving(client)


def test_bad_prompts_the_engine_refuses_are_400s(client):
    assert "vocabulary" in assert_openai_error(completion(client, prompt=[5, 999]), 400, "prompt")["message"]
    assert "empty" in assert_openai_error(completion(client, prompt=[]), 400, "prompt")["message"]
    assert "tokenizer" in assert_openai_error(completion(client, prompt="text"), 400, "prompt")["message"]
    assert_still_serving(client)


def test_unknown_model_is_a_404(client):
    error = assert_openai_error(completion(client, model="gpt-4"), 404, "model", "model_not_found")
    assert "tiny" in error["message"]
    assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_openai_error(client.get("/v1/no-such-route"), 404)


def test_missing_or_wrong_api_key_is_a_401_and_probes_stay_open(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            assert_openai_error(anonymous.get("/v1/models", headers=headers), 401, code="invalid_api_key")
            # The key is checked before the body is read: a bad key wins over a bad body.
            response = anonymous.post("/v1/completions", content="{oops", headers=headers)
            assert_openai_error(response, 401, code="invalid_api_key")
        assert anonymous.get("/health").json() == {"status": "ok"}
        assert anonymous.get("/metrics").status_code == 200


def test_server_keeps_serving_after_a_burst_of_bad_requests(client, server):
    for _ in range(3):
        completion(client, temperature=-1)
        client.post("/v1/completions", content="{", headers={"content-type": "application/json"})
        completion(client, prompt=list(range(500)))
    assert_still_serving(client)
    assert server.engine_loop.alive
    stats = server.engine_loop.stats
    assert stats.running == stats.waiting == 0


def test_non_streaming_client_that_hangs_up_aborts_its_request(client, server):
    baseline = server.engine_loop.stats.blocks_free
    aborted = server.engine_loop.metrics.finished["abort"]
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True}
    # Slow the engine (60 steps take over a second) so the request is still running when the
    # client gives up.
    with _slow_steps(server.engine_loop, 0.02):
        with httpx.Client(base_url=server.url, headers=client.headers, timeout=0.1) as impatient:
            with pytest.raises(httpx.TimeoutException):
                impatient.post("/v1/completions", json=body)
        assert _eventually(lambda: server.engine_loop.metrics.finished["abort"] == aborted + 1)
        assert _eventually(lambda: server.engine_loop.stats.blocks_free == baseline)


def test_streamed_request_failure_is_reported_in_band(client, server):
    """A request the engine fails mid-stream (its own sampling raised) ends with an OpenAI
    error event, then [DONE]; the server keeps serving."""
    engine = server.engine_loop.engine
    original = engine.worker.sampler
    engine.worker.sampler = _FailingForSeed()
    try:
        body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4, "stream": True, "seed": 666}
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        engine.worker.sampler = original
    assert events[-1] == "[DONE]"
    assert "planted" in json.loads(events[-2])["error"]["message"]
    assert_still_serving(client)


class _FailingForSeed(Sampler):
    """Raises for any batch holding the planted seed: one request's own fault."""

    def __call__(self, logits, params, generators, histories=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("planted sampling failure")
        return super().__call__(logits, params, generators, histories)


class _slow_steps:
    """Make each engine step take at least `seconds` (the engine runs fast on a tiny model)."""

    def __init__(self, loop: EngineLoop, seconds: float) -> None:
        self.engine, self.seconds = loop.engine, seconds

    def __enter__(self):
        original = self.original = self.engine.step

        def slow_step():
            time.sleep(self.seconds)
            return original()

        self.engine.step = slow_step

    def __exit__(self, *exc):
        self.engine.step = self.original


def _eventually(predicate, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
