"""The FastAPI app: OpenAI's routes over one EngineLoop, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanoserve.serve.chat import create_chat_completion
from nanoserve.serve.completions import create_completion
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.errors import ApiError, install_error_handlers
from nanoserve.serve.gate import PROBES, Admission, RequestGate
from nanoserve.serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, ENDING_GRACE
from nanoserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.serve.serving import ServeState
from nanoserve.serve.tokenize import detokenize, tokenize

logger = logging.getLogger("nanoserve.serve")


def create_app(engine_loop: EngineLoop, model_name: str, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, tool_call_parser: str | None = None) -> FastAPI:
    """An app serving `engine_loop`'s engine as `model_name`. The app starts the loop when it
    starts and stops it when it stops. With `api_key`, every route needs
    `Authorization: Bearer <api_key>` (the API, /tokenize, /docs, /openapi.json) except
    /health and /metrics (probes, scrapers). A body larger than `max_request_bytes` is a 413,
    one that stalls for `body_timeout` seconds a 408. `tool_call_parser` names the tool-call
    format (structured/tool_parsers.py; None: chosen from the chat template). `await app.state.drain(timeout)` drains it."""
    state = ServeState(engine_loop, model_name, tool_call_parser=tool_call_parser)
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
    """Refuse requests (all but the probes) without the right bearer token, before the body is
    even read (so a bad key wins over a bad body). Plain ASGI, not BaseHTTPMiddleware, which would get between
    a streaming response and the client's disconnect."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBES:
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not secrets.compare_digest(given, self.expected):
                message = "missing API key: send 'Authorization: Bearer <key>'" if given is None \
                    else "incorrect API key provided"
                response: JSONResponse = ApiError(401, message, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
