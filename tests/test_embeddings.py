"""POST /v1/embeddings and /v1/rerank through the official openai client (and httpx for rerank):
vectors equal the dense oracle's final hidden state (after the final norm) pooled and
L2-normalised, for last-token pooling (the model's own, from its GGUF pooling_type) and mean and
cls pooling (the server's --pooling); Matryoshka `dimensions`; base64; token-id inputs; requests
batched beside a generation (the same tokens and vectors as alone); rerank scores equal
softmax([logit(no), logit(yes)])[1] at the last token of the Qwen3-Reranker prompt, sorted and cut
by top_n; a generation model without pooling answers 400; bad input is a 400, never a 500.

The model is a tiny random `qwen3` (q/k norms) written as a GGUF with a byte-level vocabulary."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import served, tiny_text_engine, write_gguf  # noqa: E402

from nanoserve.engine import build_engine  # noqa: E402
from nanoserve.model.formats.loader import load_model  # noqa: E402
from nanoserve.model.network.llama import dense_forward, dense_hidden, unfuse_hf_weights  # noqa: E402
from nanoserve.model.network.synthetic import random_model, tiny_config  # noqa: E402
from nanoserve.serve.embeddings import answer_token, rerank_prompt  # noqa: E402

MODEL = "qwen3-embed"
ENGINE_OPTIONS = dict(max_batch_size=4, max_model_len=512, kv_cache_bytes=8 << 20, block_size=16, dtype="float32",
                      max_num_batched_tokens=64)  # small chunks: prompts span several
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention", "x",
         "A rather longer sentence, so that its prompt is prefilled in more than one chunk of the "
         "engine's budget, which is sixty-four tokens a step."]
ATOL = 2e-5


def qwen3_gguf(path, pooling_type: int):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True, qk_norm=True, architecture="qwen3")
    return str(write_gguf(path, config, unfuse_hf_weights(random_model(config, seed=0)), arch="qwen3",
                          uint32s={"{arch}.pooling_type": pooling_type}))


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory):
    return qwen3_gguf(tmp_path_factory.mktemp("embed") / "qwen3-embed.gguf", 3)  # 3: last-token pooling


@pytest.fixture(scope="module")
def oracle(embedder_path):
    model, tokenizer = load_model(embedder_path)
    return model, tokenizer


def expected(oracle, text, pooling="last", dimensions=None) -> np.ndarray:
    model, tokenizer = oracle
    ids = tokenizer.encode(text) if isinstance(text, str) else list(text)
    with torch.no_grad():
        hidden = dense_hidden(model, torch.tensor([ids]))[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0).numpy()


@pytest.fixture(scope="module")
def server(embedder_path):
    with served(build_engine(embedder_path, **ENGINE_OPTIONS), MODEL, None) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def vectors(reply) -> list[np.ndarray]:
    assert [item.index for item in reply.data] == list(range(len(reply.data)))
    return [np.asarray(item.embedding, dtype=np.float32) for item in reply.data]


def test_last_token_embeddings_equal_the_dense_oracle(client, oracle):
    reply = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert reply.model == MODEL and reply.object == "list"
    got = vectors(reply)
    for text, vector in zip(TEXTS, got):
        np.testing.assert_allclose(vector, expected(oracle, text), atol=ATOL)
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
    tokens = sum(len(oracle[1].encode(text)) for text in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    # The same again: a prompt now in the prefix cache gives the same vector.
    again = vectors(client.embeddings.create(model=MODEL, input=TEXTS[3]))[0]
    np.testing.assert_allclose(again, got[3], atol=ATOL)


def test_floats_base64_dimensions_and_token_ids(client, server, oracle):
    body = {"model": MODEL, "input": TEXTS[0], "encoding_format": "float"}
    floats = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    np.testing.assert_allclose(floats, expected(oracle, TEXTS[0]), atol=ATOL)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60)
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, atol=0)
    short = vectors(client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16))[0]
    assert short.shape == (16,)
    np.testing.assert_allclose(short, expected(oracle, TEXTS[0], dimensions=16), atol=ATOL)
    ids = oracle[1].encode(TEXTS[1])
    one = vectors(client.embeddings.create(model=MODEL, input=ids))[0]
    several = vectors(client.embeddings.create(model=MODEL, input=[ids, [7, 8, 9]]))
    np.testing.assert_allclose(one, expected(oracle, TEXTS[1]), atol=ATOL)
    np.testing.assert_allclose(several[0], one, atol=ATOL)
    np.testing.assert_allclose(several[1], expected(oracle, [7, 8, 9]), atol=ATOL)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_the_servers_pooling_option(embedder_path, oracle, pooling):
    with served(build_engine(embedder_path, **ENGINE_OPTIONS), MODEL, None, pooling=pooling) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        first = vectors(c.embeddings.create(model=MODEL, input=TEXTS))
        # Again, with every prompt's blocks in the prefix cache: mean and cls bypass it.
        second = vectors(c.embeddings.create(model=MODEL, input=TEXTS))
        engine = server.engine_loop.engine  # every pooled request gave its row back
        assert not engine.scheduler.running and not engine.requests
    for text, a, b in zip(TEXTS, first, second):
        np.testing.assert_allclose(a, expected(oracle, text, pooling), atol=ATOL)
        np.testing.assert_allclose(b, a, atol=ATOL)


def test_embeddings_batched_beside_a_generation_change_neither(client, oracle):
    def generate(stream: bool):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True}, stream=stream)

    alone_tokens = generate(False).choices[0].text
    alone_vectors = vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    stream = generate(True)
    chunks = [next(iter(stream))]  # the generation is running
    together: list = []
    worker = threading.Thread(target=lambda: together.append(client.embeddings.create(model=MODEL, input=TEXTS)))
    worker.start()
    chunks += list(stream)
    worker.join(60)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == alone_tokens
    for a, b in zip(vectors(together[0]), alone_vectors):
        np.testing.assert_allclose(a, b, atol=ATOL)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = qwen3_gguf(tmp_path_factory.mktemp("rerank") / "qwen3-rerank.gguf", 4)  # 4: rank
    with served(build_engine(path, **ENGINE_OPTIONS), "reranker", None) as server:
        yield server, load_model(path)


def test_rerank_scores_equal_the_dense_oracle_sorted_and_cut(reranker):
    server, (model, tokenizer) = reranker
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris.",
                 "Seven"]
    query = "What is the capital of France?"
    yes, no = answer_token(tokenizer, "yes"), answer_token(tokenizer, "no")
    want = []
    for document in documents:
        ids = tokenizer.encode(rerank_prompt(query, document), add_special_tokens=False)
        with torch.no_grad():
            logits = dense_forward(model, torch.tensor([ids]))[0, -1]
        want.append(float(torch.softmax(torch.stack([logits[no], logits[yes]]).double(), 0)[1]))
    for route in ("/v1/rerank", "/rerank"):
        body = {"model": "reranker", "query": query, "documents": [documents[0], {"text": documents[1]},
                                                                    *documents[2:]]}
        reply = httpx.post(server.url + route, json=body, timeout=60).json()
        results = reply["results"]
        assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        for result in results:
            assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
            assert result["document"] == {"text": documents[result["index"]]}
        assert reply["usage"]["prompt_tokens"] > 0
    top = httpx.post(server.url + "/v1/rerank", json={**body, "top_n": 2, "return_documents": False},
                     timeout=60).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]] and "document" not in top[0]
    # A reranker does not embed.
    refused = httpx.post(server.url + "/v1/embeddings", json={"model": "reranker", "input": "x"}, timeout=60)
    assert refused.status_code == 400 and "/v1/rerank" in refused.json()["error"]["message"]


def test_a_generation_model_without_pooling_refuses_with_a_400(tmp_path):
    with served(tiny_text_engine(tmp_path, max_batch_size=2, max_model_len=256, kv_cache_bytes=4 << 20),
                "chat", None) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.BadRequestError, match="--pooling"):
            c.embeddings.create(model="chat", input="hello")
        refused = httpx.post(f"{server.url}/v1/rerank", json={"model": "chat", "query": "q", "documents": ["d"]},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], "mixed"]}, "input"),
    ("/v1/embeddings", {"input": [999999]}, "input"),
    ("/v1/embeddings", {"input": "x" * 600}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
])
def test_bad_embedding_input_is_a_400(server, route, fields, param):
    response = httpx.post(server.url + route, json={"model": MODEL, **fields}, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error


@pytest.mark.parametrize("fields, param", [
    ({"documents": []}, "documents"),
    ({"documents": ["a"], "top_n": 0}, "top_n"),
    ({"documents": [{"txt": "a"}]}, "documents"),
    ({"documents": ["a"], "query": 3}, "query"),
    ({"documents": ["a"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
])
def test_bad_rerank_input_is_a_400(reranker, fields, param):
    server, _ = reranker
    response = httpx.post(server.url + "/v1/rerank", json={"model": "reranker", "query": "q", **fields}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_models_own_pooling_from_its_files(tmp_path, embedder_path):
    import json

    from nanoserve.model.formats.pooling import gguf_pooling, hf_pooling

    assert load_model(embedder_path)[0].pooling == "last"
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 1}) == "mean"
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 0}) is None
    assert gguf_pooling({"general.architecture": "llama"}) is None
    assert hf_pooling(tmp_path) is None  # no Sentence-Transformers config: a generation model
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    for mode, pooling in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                          ("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", None)):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
        assert hf_pooling(tmp_path) == pooling
