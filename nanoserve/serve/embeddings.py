"""POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank, /rerank (Jina's and Cohere's shape).

Each input (each query-document pair) is one prompt-only request through the engine's scheduler,
batched with generation traffic; the engine returns its pooled final hidden state (after the
final norm) instead of a token (SamplingParams.pooling), and frees its blocks and row.

Policy: a server embeds only with a pooling: the model's own (a GGUF's ``pooling_type``, a
Hugging Face directory's Sentence-Transformers config: model/formats/pooling.py) or the one
``--pooling`` names (which wins). A generation model served without ``--pooling`` answers
/v1/embeddings with a 400 saying so. Vectors are L2-normalised (after ``dimensions`` cut them,
Matryoshka-style). Rerank needs pooling "rank" (a Qwen3-Reranker: its GGUF says rank, or
``--pooling rank``): each pair is written in the prompt format Qwen3-Reranker documents and
scored at its last token as softmax([logit("no"), logit("yes")])[1].
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
import torch
from pydantic import ConfigDict
from starlette.requests import Request

from nanoserve.engine import SamplingParams
from nanoserve.serve import serving
from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import StrictModel, Text
from nanoserve.serve.serving import ServeState

MAX_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
MAX_DOCUMENTS = 1024  # documents in one rerank request
EMBEDDING_POOLING = ("last", "mean", "cls")
# Qwen3-Reranker's prompt (its model card): a system turn fixing the answer to yes or no, the
# pair in the user turn, an empty thinking block; the answer token's logits give the score.
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                  "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                  "<|im_start|>user\n")
_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class EmbeddingRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None  # accepted and ignored (OpenAI's end-user id)


class RerankDocument(StrictModel):
    text: Text


class RerankRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    query: Text
    documents: list[Text | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    instruction: Text | None = None  # extension: Qwen3-Reranker's task instruction


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """One query-document pair in Qwen3-Reranker's prompt format."""
    return (f"{_RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{_RERANK_SUFFIX}")


def answer_token(tokenizer, word: str) -> int:
    """The vocabulary's token for `word` ("yes", "no"): the token itself where the vocabulary
    has it (Qwen's does), else the first token `word` encodes to."""
    backend = getattr(tokenizer, "backend", None)
    token_id = backend.token_to_id(word) if backend is not None else None
    return token_id if token_id is not None else tokenizer.encode(word, add_special_tokens=False)[0]


def rerank_score(logits: torch.Tensor, yes: int, no: int) -> float:
    return float(torch.softmax(torch.stack([logits[no], logits[yes]]).double(), 0)[1])


def _pooling(state: ServeState, route: str) -> str:
    pooling = state.pooling
    if route == "rerank":
        if pooling != "rank":
            what = "no pooling" if pooling is None else f"{pooling!r} pooling (an embedding model)"
            raise ApiError(400, f"this server's model cannot rerank: it has {what}; /v1/rerank needs a reranker "
                                "(a Qwen3-Reranker: a GGUF with pooling_type rank, or a server started with "
                                "--pooling rank)", param="model", code="invalid_value")
        return pooling
    if pooling is None:
        raise ApiError(400, "this server's model cannot embed: it is a generation model with no pooling "
                            "configured (neither its GGUF pooling_type nor a Sentence-Transformers config); "
                            "start the server with --pooling last|mean|cls to embed with it",
                       param="model", code="invalid_value")
    if pooling == "rank":
        raise ApiError(400, "this server's model is a reranker (pooling rank): use /v1/rerank", param="model",
                       code="invalid_value")
    return pooling


async def _run(state: ServeState, request: Request, prompts: list[list[int]], pooling: str,
               prefix: str) -> list[torch.Tensor]:
    """Each prompt as a prompt-only request; their pooled vectors, in order."""
    params = SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling)
    request_id, _ = serving.new_id(prefix)
    submitted = []
    try:
        for index, ids in enumerate(prompts):
            rid = f"{request_id}-{index}"
            submitted.append((await serving.submit(state, ids, params, rid, "input"), rid))
    except BaseException:
        serving.abort_all(state, submitted)
        raise
    outputs = await serving.collect(state, request, submitted)
    return [output.pooled for output in outputs]


async def _token_prompts(state: ServeState, texts: list[str | list[int]], param: str,
                         add_special_tokens: bool = True) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = list(text) if isinstance(text, list) else await serving.encode(state, text, param, add_special_tokens)
        if not ids:
            raise ApiError(400, f"{param}: an input may not be empty", param=param, code="invalid_value")
        serving.resolve_max_tokens(state, len(ids), None, param)  # a 400 if it cannot fit the context
        prompts.append(ids)
    return prompts


async def create_embeddings(state: ServeState, body: EmbeddingRequest, request: Request) -> dict:
    state.check_model(body.model)
    pooling = _pooling(state, "embeddings")
    given = body.input
    inputs = given if isinstance(given, list) and given and isinstance(given[0], str | list) else [given]
    if not inputs or inputs == [[]]:
        raise ApiError(400, "input: at least one input is needed", param="input", code="invalid_value")
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"input: at most {MAX_INPUTS} inputs a request, got {len(inputs)}", param="input",
                       code="invalid_value")
    hidden = state.engine_loop.engine.model.config.hidden_size
    if body.dimensions is not None and not 1 <= body.dimensions <= hidden:
        raise ApiError(400, f"dimensions: must be in [1, {hidden}] (the model's embedding size), got "
                            f"{body.dimensions}", param="dimensions", code="invalid_value")
    prompts = await _token_prompts(state, inputs, "input")
    vectors = await _run(state, request, prompts, pooling, "embd")
    data = []
    for index, vector in enumerate(vectors):
        vector = normalised(vector[:body.dimensions] if body.dimensions is not None else vector)
        data.append({"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)})
    tokens = sum(map(len, prompts))
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def normalised(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector.float(), dim=0)


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(vector.numpy(), dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_rerank(state: ServeState, body: RerankRequest, request: Request) -> dict:
    state.check_model(body.model)
    _pooling(state, "rerank")
    if not body.documents:
        raise ApiError(400, "documents: at least one document is needed", param="documents", code="invalid_value")
    if len(body.documents) > MAX_DOCUMENTS:
        raise ApiError(400, f"documents: at most {MAX_DOCUMENTS} a request, got {len(body.documents)}",
                       param="documents", code="invalid_value")
    if body.top_n is not None and body.top_n < 1:
        raise ApiError(400, f"top_n: must be at least 1, got {body.top_n}", param="top_n", code="invalid_value")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    tokenizer = serving.need_tokenizer(state, "query")
    yes, no = answer_token(tokenizer, "yes"), answer_token(tokenizer, "no")
    prompts = await _token_prompts(state, [rerank_prompt(body.query, text, body.instruction) for text in texts],
                                   "documents", add_special_tokens=False)
    logits = await _run(state, request, prompts, "rank", "rerank")
    results = [{"index": index, "relevance_score": rerank_score(row, yes, no)} for index, row in enumerate(logits)]
    results.sort(key=lambda result: -result["relevance_score"])
    if body.top_n is not None:
        results = results[:body.top_n]
    if body.return_documents:
        for result in results:
            result["document"] = {"text": texts[result["index"]]}
    tokens = sum(map(len, prompts))
    request_id, _ = serving.new_id("rerank")
    return {"id": request_id, "model": state.model_name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
