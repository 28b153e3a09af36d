"""The door holds against hostile input (strict JSON types, 64-bit ranges, finite floats, valid
Unicode, a body limit), one request's failure never reaches its neighbours, an engine fault
stops the server from taking work, and tokenizing happens off the event loop."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import served, tiny_text_engine  # noqa: E402

API_KEY = "sk-hardening"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
ENGINE = dict(max_batch_size=8, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128)
GREEDY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = tiny_text_engine(tmp_path_factory.mktemp("hardening"), **ENGINE)
    with served(engine, "tiny", API_KEY, max_request_bytes=64 << 10) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_tokens(client) -> str:
    response = client.post("/v1/completions", json={**GREEDY, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def post_raw(client, path: str, raw: str):
    return client.post(path, content=raw.encode("utf-8"))


@pytest.mark.parametrize("field, raw_value", [
    ("max_tokens", '"8"'), ("max_tokens", "true"), ("max_tokens", "8.0"), ("stream", '"yes"'),
    ("stream", "1"), ("temperature", '"0.5"'), ("temperature", "Infinity"), ("temperature", "-Infinity"),
    ("temperature", "NaN"), ("top_p", "Infinity"), ("seed", '"1"'), ("seed", "true"), ("ignore_eos", '"no"'),
    ("stop", "5"), ("logprobs", "true"), ("echo", '"yes"'),
])
def test_loose_json_types_and_non_finite_numbers_are_400s(client, field, raw_value):
    raw = f'{{"model": "tiny", "prompt": "hi", "{field}": {raw_value}}}'
    error = assert_error(post_raw(client, "/v1/completions", raw), 400, field)
    assert field in error["message"]


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 2**70), ("seed", 2**64), ("seed", -(2**70)), ("max_tokens", 2**64),
    ("stop_token_ids", [2**64]), ("n", 2**64), ("logprobs", 2**64), ("temperature", 10**400),
    ("prompt", [2**64]), ("prompt", [-1]), ("best_of", 2**80),
])
def test_integers_beyond_64_bits_are_400s_naming_the_field(client, field, value):
    raw = json.dumps({**GREEDY, field: value})
    error = assert_error(post_raw(client, "/v1/completions", raw), 400)
    assert error["param"] == field or field in error["message"], error


def test_the_widest_values_that_fit_are_served(client):
    body = {**GREEDY, "top_k": 2**63 - 1, "seed": 2**64 - 1, "temperature": 1.0, "stop_token_ids": [2**63 - 1]}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", '{"model": "tiny", "prompt": "ab\\ud800cd"}'),
    ("/v1/completions", '{"model": "tiny", "prompt": ["\\udfff"]}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud800"}]}'),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("/v1/completions", '{"model": "ti\\ud800ny", "prompt": "hi"}'),
    ("/tokenize", '{"prompt": "\\ud800"}'),
])
def test_lone_surrogates_are_400s_not_500s(client, path, raw):
    error = assert_error(post_raw(client, path, raw), 400)
    assert "Unicode" in error["message"]


def test_an_unknown_model_with_any_text_is_a_404_that_quotes_it(client):
    for name in ("模型 🚀", "x" * 10_000, "a\u0000b"):
        error = assert_error(client.post("/v1/completions", json={**GREEDY, "model": name}), 404, "model")
        assert len(error["message"]) < 1000


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(client):
    big = json.dumps({**GREEDY, "prompt": "a" * (70 << 10)})
    assert_error(client.post("/v1/completions", content=big), 413)

    def chunks():
        for _ in range(70):
            yield b"a" * 1024

    response = client.post("/v1/completions", content=chunks())  # chunked: no Content-Length
    assert_error(response, 413)
    assert client.post("/v1/completions", json=GREEDY).status_code == 200


def test_a_huge_top_k_does_not_fail_the_greedy_requests_sharing_its_steps(client, greedy_tokens):
    hostile = {**GREEDY, "top_k": 2**63 - 1, "temperature": 0.7, "logprobs": 20, "seed": 3}
    bodies = [hostile] + [{**GREEDY, "logprobs": 0}] * 4
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    for response in responses[1:]:
        assert response.json()["choices"][0]["logprobs"]["tokens"] == greedy_tokens


@pytest.mark.parametrize("prompts", [[[5, 6, 7], [9, 8], [4]], ["well", "formed"]])
def test_a_batch_of_prompts_gets_one_choice_each_equal_to_each_alone(client, server, prompts):
    alone = [client.post("/v1/completions", json={**GREEDY, "prompt": p, "echo": True, "logprobs": 1}).json()
             for p in prompts]
    batch = client.post("/v1/completions", json={**GREEDY, "prompt": prompts, "echo": True, "logprobs": 1})
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(prompts)))
    for choice, single in zip(choices, alone):
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
    assert batch.json()["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    # One prompt the engine refuses fails the batch, and none of it is left running.
    assert_error(client.post("/v1/completions", json={**GREEDY, "prompt": [[1, 2], [999]]}), 400, "prompt")
    deadline = time.monotonic() + 5  # the abort reaches the engine thread between steps
    while server.engine_loop.stats.running + server.engine_loop.stats.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine_loop.stats.running == server.engine_loop.stats.waiting == 0


def test_docs_and_openapi_need_the_key_and_probes_do_not(server):
    with httpx.Client(base_url=server.url, timeout=10) as anonymous:
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert_error(anonymous.get(path), 401)
        assert anonymous.get("/health").status_code == 200
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=10) as keyed:
        assert "/v1/completions" in keyed.get("/openapi.json").json()["paths"]


def test_tokenizing_and_chat_templating_run_off_the_event_loop(server, client):
    tokenizer = server.engine_loop.engine.tokenizer
    threads = set()
    original_encode, original_template = tokenizer.encode, tokenizer.apply_chat_template

    def encode(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return original_encode(*args, **kwargs)

    def template(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return original_template(*args, **kwargs)

    tokenizer.encode, tokenizer.apply_chat_template = encode, template
    try:
        assert client.post("/v1/completions", json={**GREEDY, "prompt": "hello " * 2000,
                                                    "max_tokens": 1}).status_code == 400  # too long
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200
    finally:
        tokenizer.encode, tokenizer.apply_chat_template = original_encode, original_template
    assert threads and "nanoserve-http" not in threads and threading.main_thread().name not in threads


def test_tokenize_and_detokenize_as_vllm_serves_them(client):
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "héllo", "return_token_strs": True})
    assert tokens.status_code == 200, tokens.text
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == ENGINE["max_model_len"]
    assert len(body["token_strs"]) == body["count"]
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "héllo"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert client.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        "<|user|>hi\n<|assistant|>"
    assert_error(client.post("/detokenize", json={"tokens": [1, 9999]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={"prompt": "a", "messages": []}), 400)
    assert_error(client.post("/tokenize", json={"model": "other", "prompt": "a"}), 404, "model")


def test_an_engine_fault_fails_work_in_flight_and_the_server_refuses_more(tmp_path):
    engine = tiny_text_engine(tmp_path, **ENGINE)
    with served(engine, "tiny", None) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/completions", json=GREEDY).status_code == 200

        def broken_advance(rows):
            raise AssertionError("planted: the slot table disagrees with the pool")

        engine.scheduler.blocks.advance = broken_advance
        error = assert_error(client.post("/v1/completions", json=GREEDY), 503)
        assert "planted" in error["message"]
        assert_error(client.get("/health"), 503)
        assert "planted" in assert_error(client.post("/v1/completions", json=GREEDY), 503)["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_an_unknown_chat_role_is_a_400_naming_the_message(client, path):
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    error = assert_error(client.post(path, json={"model": "tiny", "messages": messages, "max_tokens": 2}),
                         400, "messages[1].role")
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert "'wizard'" in error["message"] and "'user'" in error["message"]
    # This template names no "tool" role, so a tool message is refused too; developer is system.
    tool = [{"role": "tool", "content": "42"}]
    assert_error(client.post(path, json={"model": "tiny", "messages": tool, "max_tokens": 2}), 400,
                 "messages[0].role")
    for role in ("system", "developer", "user", "assistant"):
        body = {"model": "tiny", "messages": [{"role": role, "content": "hi"}], "max_tokens": 2}
        assert client.post(path, json=body).status_code == 200, role


def test_tool_is_a_role_only_where_the_template_names_it():
    from nanoserve.serve.chat import CHAT_ROLES, chat_roles

    assert chat_roles("{{ '<|' + m.role + '|>' }}") == CHAT_ROLES
    assert chat_roles("{% if message.role == \"tool\" %}<tool>{% endif %}") == (*CHAT_ROLES, "tool")
    assert chat_roles("{% if message['role'] == 'tool' %}{% endif %}")[-1] == "tool"


def test_a_stalled_body_gets_a_408_on_its_own_and_its_connection_closes(tmp_path):
    import socket

    engine = tiny_text_engine(tmp_path, **ENGINE)
    with served(engine, "tiny", None, body_timeout=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as stalled:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n" + b"{" + b" " * 499)  # half the body, then nothing
            started, answer = time.monotonic(), b""
            while chunk := stalled.recv(65536):  # to the server's close (the socket times out at 10 s)
                answer += chunk
            elapsed = time.monotonic() - started
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.4 < elapsed < 5.0, elapsed
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert "nanoserve_http_requests_in_flight 0" in client.get("/metrics").text.splitlines()
            assert client.post("/v1/completions", json=GREEDY).status_code == 200  # whole bodies still served
