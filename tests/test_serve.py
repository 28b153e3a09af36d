"""The server end to end through the official openai client: the same text as
Engine.generate, streaming, 32 clients sharing decode steps, and a client that walks away.

The engine is a random model in SmolLM2-135M's shape (2 layers, for speed) with SmolLM2's real
tokenizer and chat template, so text, templates and detokenization are the real ones."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import random_smollm2_shaped, served  # noqa: E402

from nanoserve.engine import SamplingParams, build_engine  # noqa: E402

API_KEY = "sk-nanoserve-test"
MODEL = "smollm2-test"
ENGINE_OPTIONS = dict(max_batch_size=32, max_model_len=512, kv_cache_bytes=24 << 20, block_size=16)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Write a haiku about paged attention."}]


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2_path):
    """SmolLM2's tokenizer (read from the GGUF's metadata only) and a random 2-layer model in its shape."""
    return random_smollm2_shaped(smollm2_path)


@pytest.fixture(scope="module")
def reference(model_and_tokenizer):
    """A second engine on the same weights, driven directly (never by the server)."""
    model, tokenizer = model_and_tokenizer
    return build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with served(build_engine(model, tokenizer=tokenizer, **ENGINE_OPTIONS), MODEL, API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_models_health_and_metrics_are_served(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with httpx.Client(base_url=server.url) as plain:
        assert plain.get("/health").json() == {"status": "ok"}
        text = plain.get("/metrics").text
    for name in ("nanoserve_requests_running", "nanoserve_requests_waiting", "nanoserve_kv_blocks_used",
                 "nanoserve_kv_blocks_free", "nanoserve_generation_tokens_total",
                 "nanoserve_time_to_first_token_seconds_bucket",
                 "nanoserve_inter_token_latency_seconds_bucket",
                 "nanoserve_recompiles_total", "nanoserve_decode_batch_size_bucket",
                 "nanoserve_prefix_cache_queries_total", "nanoserve_prefix_cache_hits_total",
                 "nanoserve_prefix_cache_blocks", "nanoserve_prefix_cache_evictions_total"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.M), f"{name} missing:\n{text}"


def test_metrics_count_the_prefix_cache_hits_of_a_repeated_chat(client, server):
    names = ("nanoserve_prefix_cache_queries_total", "nanoserve_prefix_cache_hits_total")
    with httpx.Client(base_url=server.url) as plain:
        before = [_metric(plain.get("/metrics").text, name) for name in names]
        for _ in range(2):
            response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
        prompt_tokens = response.usage.prompt_tokens
        deadline = time.monotonic() + 1.0  # the stats snapshot is replaced after the step
        while True:
            queries, hits = (_metric(plain.get("/metrics").text, n) - b for n, b in zip(names, before))
            if queries == 2 * prompt_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    block = ENGINE_OPTIONS["block_size"]
    adoptable = (prompt_tokens - 1) // block * block  # the second request finds all of it cached
    assert queries == 2 * prompt_tokens
    assert adoptable <= hits <= 2 * adoptable and adoptable > 0


def test_completion_text_equals_engine_generate(client, reference):
    expected = reference.generate([PROMPT], greedy(20), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_text_equals_engine_generate(client, reference):
    expected = reference.generate([PROMPT], greedy(24), use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_completion_text_equals_engine_chat(client, reference):
    expected = reference.chat(MESSAGES, greedy(20))
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_text_equals_engine_chat(client, reference):
    expected = reference.chat(MESSAGES, greedy(24))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stream_ends_with_done_over_raw_sse(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers) as plain:
        with plain.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_stop_string_cuts_the_text_like_the_engine(client, reference):
    full = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                           stop=(stop,)), use_tqdm=False)[0]
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks) == expected.text == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampled_text_equals_engine_generate_with_every_sampling_field(client, reference):
    """Greedy text from a random model is one token repeated; seeded sampling gives varied text
    (multi-byte characters, replacement characters), and pins the mapping of every sampling field."""
    fields = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, presence_penalty=0.5,
                  frequency_penalty=0.3, seed=1234, max_tokens=32, ignore_eos=True)
    expected = reference.generate([PROMPT], SamplingParams(**fields), use_tqdm=False)[0]
    assert len(set(expected.token_ids)) > 10
    api, extra = {k: fields[k] for k in fields if k not in ("top_k", "min_p", "ignore_eos")}, \
        {k: fields[k] for k in ("top_k", "min_p", "ignore_eos")}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **api)
    assert whole.choices[0].text == expected.text
    stream = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body=extra, **api)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text
    expected_chat = reference.chat(MESSAGES, SamplingParams(**fields))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, extra_body=extra,
                                            **api)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected_chat.text


def test_logprobs_for_chat_and_completions(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the top one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    legacy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 5
    assert all(len(top) <= 2 for top in legacy.top_logprobs)


def test_32_concurrent_streams_finish_and_share_decode_steps(server):
    async def one(client, index: int) -> tuple[int, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request {index}: count to ten", max_tokens=8 + index % 5, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return usage.completion_tokens, reasons[-1], 8 + index % 5

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = server.engine_loop.metrics.decode_batch.sum, server.engine_loop.metrics.decode_batch.count
    results = asyncio.run(run_all())
    assert [(tokens, reason) for tokens, reason, _ in results] == [(want, "length") for *_, want in results]
    with httpx.Client(base_url=server.url) as plain:
        metrics = plain.get("/metrics").text
    rows = server.engine_loop.metrics.decode_batch.sum - before[0]
    steps = server.engine_loop.metrics.decode_batch.count - before[1]
    assert rows / steps > 1, f"{rows} decode rows over {steps} steps: no continuous batching"
    assert _metric(metrics, "nanoserve_decode_rows_max") > 1
    mean_rows = _metric(metrics, "nanoserve_decode_batch_size_sum") / _metric(
        metrics, "nanoserve_decode_batch_size_count")
    assert mean_rows > 1


def test_client_closing_its_stream_aborts_the_request_and_frees_its_blocks(client, server):
    loop = server.engine_loop
    baseline, aborted = loop.stats.blocks_free, loop.metrics.finished["abort"]
    stream = client.completions.create(model=MODEL, prompt=PROMPT * 20, max_tokens=300, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert loop.stats.blocks_free < baseline  # it holds blocks while it runs
    closed_at = time.monotonic()
    stream.close()
    # An abort, not the 300 tokens' natural end (counted as "length"); the window is wide for a
    # loaded host, and the loop leaves as soon as both hold.
    while time.monotonic() - closed_at < 10.0 and (
            loop.stats.blocks_free != baseline or loop.metrics.finished["abort"] != aborted + 1):
        time.sleep(0.01)
    assert loop.metrics.finished["abort"] == aborted + 1, "the request was not aborted"
    assert loop.stats.blocks_free == baseline, "its blocks did not come back"
    assert loop.stats.running == loop.stats.waiting == 0
    with httpx.Client(base_url=server.url) as plain:
        assert _metric(plain.get("/metrics").text, "nanoserve_kv_blocks_free") == baseline


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_a_speculating_server_streams_the_engines_greedy_text_and_reports_its_counters(model_and_tokenizer, reference):
    """`serve --speculative-config`: the same greedy text as the plain engine, streamed and
    whole, and the spec counters on /metrics."""
    model, tokenizer = model_and_tokenizer
    engine = build_engine(model, tokenizer=tokenizer, speculative={"method": "ngram", "prompt_lookup_min": 1},
                          **ENGINE_OPTIONS)
    prompt = "one two three one two three one two three one two"
    want = reference.generate([prompt], greedy(24), use_tqdm=False)[0].text
    with served(engine, MODEL, API_KEY) as spec_server:
        with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
            whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
        with httpx.Client(base_url=spec_server.url) as plain:
            metrics = plain.get("/metrics").text
    assert whole.choices[0].text == streamed == want
    assert _metric(metrics, "nanoserve_spec_verify_steps_total") > 0
    assert "nanoserve_spec_acceptance_rate" in metrics and "nanoserve_spec_accepted_tokens_total" in metrics
