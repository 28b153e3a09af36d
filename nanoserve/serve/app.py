"""The FastAPI app: OpenAI's routes (chat, completions, responses, embeddings, rerank) and Anthropic's
Messages over one EngineLoop, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.routing import Match

from nanoserve.engine.sampling_params import POOLING
from nanoserve.serve.chat import create_chat_completion
from nanoserve.serve.completions import create_completion
from nanoserve.serve.embeddings import EmbeddingRequest, RerankRequest, create_embeddings, create_rerank
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.errors import ApiError, install_error_handlers
from nanoserve.serve.gate import PROBES, Admission, RequestGate
from nanoserve.serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, ENDING_GRACE
from nanoserve.serve.messages import count_message_tokens, create_message
from nanoserve.serve.messages_protocol import CountTokensRequest, MessagesRequest
from nanoserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.serve.responses import create_response
from nanoserve.serve.responses_protocol import ResponsesRequest
from nanoserve.serve.serving import ServeState
from nanoserve.serve.tokenize import detokenize, tokenize

logger = logging.getLogger("nanoserve.serve")


def create_app(engine_loop: EngineLoop, model_name: str, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, tool_call_parser: str | None = None,
               pooling: str | None = None) -> FastAPI:
    """An app serving `engine_loop`'s engine as `model_name`. The app starts the loop when it
    starts and stops it when it stops. With `api_key`, every route needs
    `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (the API, /tokenize, /docs,
    /openapi.json) except /health and /metrics (probes, scrapers). A body larger than `max_request_bytes` is a 413,
    one that stalls for `body_timeout` seconds a 408. `tool_call_parser` names the tool-call
    format (structured/tool_parsers.py; None: chosen from the chat template). `pooling` ("last",
    "mean", "cls", "rank") is what /v1/embeddings and /v1/rerank pool with; None: the model's own
    (its files' pooling config), and without one those routes answer 400 (serve/embeddings.py).
    `await app.state.drain(timeout)` drains it."""
    if pooling is not None and pooling not in POOLING:
        raise ValueError(f"pooling: must be one of {', '.join(POOLING)}, got {pooling!r}")
    state = ServeState(engine_loop, model_name, tool_call_parser=tool_call_parser,
                       pooling=pooling or getattr(engine_loop.engine.model, "pooling", None))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.serve = state
    install_error_handlers(app)
    admission = app.state.admission = Admission()
    # The last added runs first: the key check, then the gate (an unauthorised body is never read).
    app.add_middleware(RequestGate, admission=admission, max_request_bytes=max_request_bytes,
                       body_timeout=body_timeout, on_disconnect=engine_loop.metrics.record_disconnect)
    if api_key:  # an empty key (e.g. an empty $NANOSERVE_API_KEY) means no key
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(UnknownRoutes, routes=app.router.routes)  # first of all: a probe costs nothing

    async def drain(timeout: float) -> None:
        """Stop admitting (503), let requests in flight finish for up to `timeout` seconds,
        then end the rest: streams get a final error event, the others a 503, and a request
        whose body is still arriving a 503 too (every request is bounded by the timeout)."""
        admission.draining = True
        logger.info("draining: %d requests in flight, up to %g s", admission.in_flight, timeout)
        if not await admission.wait_idle(timeout):
            logger.info("drain timeout: ending %d requests still in flight", admission.in_flight)
            admission.cut.set()
            await asyncio.to_thread(engine_loop.stop)  # outputs still reach this event loop
            await admission.wait_idle(ENDING_GRACE)

    app.state.drain = drain

    @app.get("/health")
    async def health():
        if admission.draining:
            return ApiError(503, "the server is shutting down", code="server_shutting_down").response()
        if not engine_loop.alive:
            return ApiError(503, engine_loop.stopped_reason, code="engine_unavailable").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = engine_loop.metrics.render(engine_loop.stats, http_in_flight=admission.in_flight,
                                          max_waiting=engine_loop.max_waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state, created)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        state.check_model(model)
        return _model_card(state, created)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(state, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await create_embeddings(state, body, request)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(body: RerankRequest, request: Request):
        return await create_rerank(state, body, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await count_message_tokens(state, body)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(state, body)

    return app


def _model_card(state: ServeState, created: int) -> dict:
    return {"id": state.model_name, "object": "model", "created": created, "owned_by": "nanoserve",
            "max_model_len": state.max_model_len}


class ApiKeyMiddleware:
    """Refuse requests (all but the probes) without the right key, as a bearer token
    (`Authorization: Bearer KEY`, OpenAI's clients) or as `x-api-key: KEY` (Anthropic's), before
    the body is even read (so a bad key wins over a bad body). Plain ASGI, not
    BaseHTTPMiddleware, which would get between a streaming response and the client's disconnect."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBES:
            headers = dict(scope["headers"])
            bearer, key = headers.get(b"authorization"), headers.get(b"x-api-key")
            if not (bearer is not None and secrets.compare_digest(bearer, self.bearer)
                    or key is not None and secrets.compare_digest(key, self.key)):
                message = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'" \
                    if bearer is None and key is None else "incorrect API key provided"
                response: JSONResponse = ApiError(401, message, code="invalid_api_key").response(scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class UnknownRoutes:
    """A path no route serves gets its 404 at once: before the key check, without its body
    being read (clients probe: Claude Code posts telemetry to /api/event_logging/batch)."""

    def __init__(self, app, routes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and all(route.matches(scope)[0] is Match.NONE for route in self.routes):
            response = ApiError(404, f"{scope['method']} {scope['path']}: Not Found").response(scope["path"])
            headers = dict(scope["headers"])
            if b"content-length" in headers and headers[b"content-length"] != b"0" or b"transfer-encoding" in headers:
                response.headers["connection"] = "close"  # its body is never read
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
