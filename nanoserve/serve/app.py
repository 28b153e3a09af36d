"""The FastAPI app: OpenAI's routes over one EngineLoop, plus /health and /metrics."""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanoserve.serve.chat import create_chat_completion
from nanoserve.serve.completions import create_completion
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.errors import ApiError, install_error_handlers
from nanoserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.serve.serving import ServeState


def create_app(engine_loop: EngineLoop, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """An app serving `engine_loop`'s engine as `model_name`. The app starts the loop when it
    starts and stops it when it stops. With `api_key`, every /v1 route needs
    `Authorization: Bearer <api_key>`; /health and /metrics stay open (probes, scrapers)."""
    state = ServeState(engine_loop, model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start()
        yield
        engine_loop.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.serve = state
    install_error_handlers(app)
    if api_key:  # an empty key (e.g. an empty $NANOSERVE_API_KEY) means no key
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return ApiError(503, "the engine loop is not running", code="engine_unavailable").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine_loop.metrics.render(engine_loop.stats),
                                 media_type="text/plain; version=0.0.4")

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

    return app


def _model_card(state: ServeState, created: int) -> dict:
    return {"id": state.model_name, "object": "model", "created": created, "owned_by": "nanoserve",
            "max_model_len": state.max_model_len}


class ApiKeyMiddleware:
    """Refuse /v1 requests without the right bearer token, before the body is even parsed (so a
    bad key wins over a bad body). Plain ASGI, not BaseHTTPMiddleware, which would get between
    a streaming response and the client's disconnect."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not secrets.compare_digest(given, self.expected):
                message = "missing API key: send 'Authorization: Bearer <key>'" if given is None \
                    else "incorrect API key provided"
                response: JSONResponse = ApiError(401, message, code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
