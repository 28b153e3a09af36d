"""Fuzzing every route while well-formed greedy requests run beside the fuzz: whatever the body
(any JSON, the documented fields with any values, any Unicode including lone surrogates, bytes
that are not JSON at all), the server never answers 5xx, every refusal has OpenAI's error
shape, the greedy requests' tokens never change, and the pool ends back at its baseline.

The `ci` hypothesis profile runs a short fuzz; NANOSERVE_HYPOTHESIS=long runs it long. With
`-s` the test prints how many requests it sent.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import served, tiny_text_engine  # noqa: E402

API_KEY = "sk-fuzz"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ENGINE = dict(max_batch_size=8, kv_cache_bytes=96 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4, max_model_len=96)
GREEDY = [
    {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    {"model": "tiny", "prompt": "well formed", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
]
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
GET_ROUTES = ["/v1/models", "/v1/models/tiny", "/v1/models/other", "/health", "/metrics", "/openapi.json",
              "/nope"]

# -- strategies -------------------------------------------------------------------------------
any_char = st.characters(exclude_categories=())  # every code point, lone surrogates included
any_text = st.text(any_char, max_size=40)
edge_ints = st.one_of(st.integers(-3, 130), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63,
                                                             -2**64, 10**30]))
edge_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-300, 2.0, 1e308]))
json_leaf = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, any_text)
any_json = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(any_text, inner, max_size=4), max_leaves=10)
token_ids = st.lists(st.integers(-2, 270), min_size=0, max_size=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | any_text},
    optional={"content": st.one_of(any_text, st.none(),
                                   st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                    "text": any_text}), max_size=2))})
plausible = {
    "model": st.sampled_from(["tiny", "other"]) | any_text,
    "prompt": st.one_of(any_text, token_ids, st.lists(any_text, max_size=2), st.lists(token_ids, max_size=2)),
    "messages": st.lists(message, max_size=3),
    "max_tokens": edge_ints, "max_completion_tokens": edge_ints,
    "temperature": edge_floats, "top_p": edge_floats, "min_p": edge_floats, "top_k": edge_ints,
    "repetition_penalty": edge_floats, "presence_penalty": edge_floats, "frequency_penalty": edge_floats,
    "seed": edge_ints, "stop": st.one_of(any_text, st.lists(any_text, max_size=3)),
    "stop_token_ids": st.lists(edge_ints, max_size=3), "ignore_eos": st.booleans(), "n": edge_ints,
    "logit_bias": st.dictionaries(any_text, edge_floats, max_size=2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logprobs": st.one_of(edge_ints, st.booleans()), "top_logprobs": edge_ints, "echo": st.booleans(),
    "suffix": any_text, "best_of": edge_ints, "tokens": token_ids, "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "return_token_strs": st.booleans(),
}
documented_body = st.fixed_dictionaries(
    {}, optional={name: values | any_json for name, values in plausible.items()})
SAMPLING = ["max_tokens", "temperature", "top_p", "min_p", "top_k", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options",
            "logprobs", "echo"]
# Bodies that get past the types more often, so that the engine sees the values.
well_typed_completion = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": st.one_of(any_text, token_ids)},
    optional={name: plausible[name] for name in SAMPLING})
well_typed_chat = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=3)},
    optional={name: plausible[name] for name in SAMPLING + ["max_completion_tokens", "top_logprobs"]
              if name != "echo"})
raw_body = st.one_of(
    st.binary(max_size=64),
    documented_body.map(lambda body: json.dumps(body, allow_nan=True)[:-1].encode()),  # truncated
)
fuzz_request = st.one_of(
    st.tuples(st.sampled_from(POST_ROUTES), st.one_of(documented_body, any_json).map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(POST_ROUTES), raw_body),
    st.tuples(st.just("/v1/completions"), well_typed_completion.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/chat/completions"), well_typed_chat.map(lambda b: json.dumps(b).encode())),
)


# -- the server, and the well-formed requests beside the fuzz ----------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = tiny_text_engine(tmp_path_factory.mktemp("fuzz"), **ENGINE)
    with served(engine, "tiny", API_KEY, max_request_bytes=1 << 20) as server:
        yield server


def greedy_answer(client, body: dict) -> list[str]:
    response = client.post("/v1/completions", json={**body, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


class Bystanders:
    """Well-formed greedy requests sent in a loop from their own thread until stopped; every
    answer must be the tokens the same request got alone."""

    def __init__(self, url: str, expected: list[list[str]]) -> None:
        self.url, self.expected = url, expected
        self.sent, self.mismatches = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Bystanders:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        deadline = time.monotonic() + 3600  # bounded, whatever the profile
        with httpx.Client(base_url=self.url, headers=HEADERS, timeout=60) as client:
            while not self._stop.is_set() and time.monotonic() < deadline and self.sent < 100_000:
                index = self.sent % len(GREEDY)
                try:
                    tokens = greedy_answer(client, GREEDY[index])
                except AssertionError as exc:
                    self.mismatches.append(str(exc))
                    continue
                finally:
                    self.sent += 1
                if tokens != self.expected[index]:
                    self.mismatches.append(f"{GREEDY[index]}: {tokens} != {self.expected[index]}")


def check_answer(response: httpx.Response, route: str) -> None:
    assert response.status_code < 500, (route, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text
        for event in events[:-1]:
            assert "error" not in json.loads(event), (route, event)  # an in-band error is a server error


def test_fuzzing_every_route_never_hurts_the_server_or_its_well_formed_requests(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as client:
        expected = [greedy_answer(client, body) for body in GREEDY]
        baseline = server.engine_loop.stats.blocks_free
        sent, statuses = 0, {}
        with Bystanders(server.url, expected) as bystanders:

            @given(fuzz_request, st.sampled_from(GET_ROUTES), any_text)
            def fuzz(request, get_route, suffix):
                nonlocal sent
                route, body = request
                response = client.post(route, content=body, headers={"content-type": "application/json"})
                check_answer(response, route)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                path = get_route if get_route != "/v1/models/other" else f"/v1/models/{suffix}"
                try:
                    response = client.get(path)
                except (httpx.InvalidURL, UnicodeEncodeError):
                    pass  # a path the client itself cannot send
                else:
                    check_answer(response, path)
                sent += 2

            fuzz()
        assert bystanders.sent > 0 and not bystanders.mismatches, bystanders.mismatches[:3]
        deadline = time.monotonic() + 10
        stats = server.engine_loop.stats
        while (stats.running or stats.waiting or stats.blocks_free != baseline) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = server.engine_loop.stats
        assert stats.running == stats.waiting == 0 and stats.blocks_free == baseline, stats
        assert server.engine_loop.alive and client.get("/health").status_code == 200
    print(f"\nfuzz: {sent} fuzzed requests (POST statuses {dict(sorted(statuses.items()))}), "
          f"{bystanders.sent} well-formed greedy requests beside them, 0 server errors")
