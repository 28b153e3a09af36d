"""Prompt log-probabilities over HTTP on the default model: `/v1/completions` with `echo`,
`logprobs` and `max_tokens: 0` (OpenAI's legacy shape) equal transformers' on the same weights
(fp32) within 1e-3, and lm-eval's `local-completions` loglikelihood request is answered in the
shape its parser reads."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import served  # noqa: E402

from nanoserve.engine import build_engine  # noqa: E402

pytestmark = pytest.mark.model
PROMPT = "The quick brown fox jumps over the lazy dog because"
CONTEXT, CONTINUATION = "Question: What is the capital of France?\nAnswer:", " Paris"
LM_EVAL_SEED = 1234


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = build_engine(model, tokenizer=tokenizer, max_batch_size=4, max_model_len=256)
    with served(engine, "smollm2", None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: transformers' log-probability of each token after the first."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    scores = torch.log_softmax(logits, dim=-1)
    return scores[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1), scores


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(client, smollm2, hf_smollm2):
    tokenizer = smollm2[1]
    ids = tokenizer.encode(PROMPT)
    body = {"model": "smollm2", "prompt": PROMPT, "echo": True, "logprobs": 5, "max_tokens": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected, scores = reference_logprobs(hf_smollm2, ids)
    assert torch.tensor(logprobs["token_logprobs"][1:]) == pytest.approx(expected, abs=1e-3)
    for position, top in enumerate(logprobs["top_logprobs"][1:]):
        assert len(top) <= 5  # (two ids that print alike share a key)
        best = scores[position].topk(1)
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-3)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert response.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                        "total_tokens": len(ids)}


def test_lm_eval_local_completions_loglikelihood_request(client, smollm2, hf_smollm2):
    """The body lm-eval's LocalCompletionsAPI sends for a loglikelihood request (token ids,
    batch of one), scored the way its parse_logprobs reads the answer."""
    tokenizer = smollm2[1]
    context = tokenizer.encode(CONTEXT)
    whole = context + tokenizer.encode(CONTINUATION, add_special_tokens=False)
    recorded = json.loads(json.dumps({
        "model": "smollm2", "prompt": [whole], "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": LM_EVAL_SEED, "echo": True}))
    response = client.post("/v1/completions", json=recorded)
    assert response.status_code == 200, response.text
    choice = sorted(response.json()["choices"], key=lambda c: c["index"])[0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(whole) + 1  # the prompt, then the one generated token
    ctxlen = len(context)
    loglikelihood = sum(token_logprobs[ctxlen:-1])
    is_greedy = all(lp == max(top.values()) for lp, top in
                    zip(token_logprobs[ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1]))
    expected, scores = reference_logprobs(hf_smollm2, whole)
    assert loglikelihood == pytest.approx(float(expected[ctxlen - 1:].sum()), abs=1e-3)
    greedy = all(int(scores[i - 1].argmax()) == whole[i] for i in range(ctxlen, len(whole)))
    assert is_greedy == greedy


def test_streamed_echo_carries_the_prompt_first_and_equals_the_whole_answer(client):
    body = {"model": "smollm2", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 5,
            "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def test_max_tokens_0_without_echo_is_a_400(client):
    response = client.post("/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
