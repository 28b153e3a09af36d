"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, for every
failure the server answers, including FastAPI's own (bad JSON, missing fields, unknown routes);
under Anthropic's routes (/v1/messages...) in Anthropic's: ``{"type": "error", "error": {"type",
"message"}}``, with the same status."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("nanoserve.serve")

# OpenAI's `type` per status; the client maps the status to its exception class.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}
# Anthropic's `error.type` per status (its client maps the status to its exception class); a 503
# (a full queue, a drain, a stopped engine) is its "overloaded_error", which clients retry.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_ROUTE = "/v1/messages"
ECHO_LIMIT = 200  # characters of a refused value quoted back in a message


class ApiError(Exception):
    """A request the server refuses or cannot finish; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        # Whatever the message quotes (a model name, a field's value) must encode as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The error as a response, in the shape of the protocol `path` belongs to."""
        body = self.anthropic_body() if path is not None and anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def anthropic_path(path: str) -> bool:
    """Whether a request path is one of Anthropic's routes (answered in Anthropic's shapes)."""
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def from_validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's list of pydantic errors -> one 400 naming the first offending field. Where a
    field may take several types (a union), a value our own validators refused (bad Unicode)
    explains more than "not a list", so that error is preferred."""
    errors = exc.errors()
    unknown = [".".join(str(part) for part in e["loc"] if part != "body") for e in errors
               if e.get("type") == "extra_forbidden"]
    if unknown:  # named first: a misspelt field also makes the field it meant look missing
        names = ", ".join(repr(name) for name in unknown)
        return ApiError(400, f"unknown parameter{'s' if len(unknown) > 1 else ''}: {names}", param=unknown[0],
                        code="unknown_parameter")
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    # Union members appear in `loc` as type names ("list[int]"); the client's path is the rest.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"
           and (isinstance(part, int) or str(part).isidentifier())]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"request body is not valid JSON ({detail})".replace(" ()", ""))
    if not loc and kind == "missing":
        return ApiError(400, "request body is missing: send a JSON object")
    if not loc:  # the body is not an object
        return ApiError(400, f"request body must be a JSON object ({first.get('msg', kind)})")
    param, field = loc[0], ".".join(loc)  # param is the top-level field, as OpenAI reports it
    if kind == "missing":
        return ApiError(400, f"missing required parameter: {field!r}", param=param,
                        code="missing_required_parameter")
    return ApiError(400, f"{field}: {first.get('msg', 'invalid value')}, got {quoted(first.get('input'))}",
                    param=param, code="invalid_value")


def quoted(value: object) -> str:
    """A refused value as a message quotes it: its repr, cut at ECHO_LIMIT characters."""
    text = repr(value)
    return text if len(text) <= ECHO_LIMIT else text[:ECHO_LIMIT] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through ApiError so clients always see the same shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response(request.url.path)


@contextmanager
def renamed_fields(names: Sequence[tuple[re.Pattern, str]]) -> Iterator[None]:
    """An ApiError raised inside names another protocol's fields (the chat path's) as this
    request names them: each (pattern, name) substituted in its message and its param."""
    try:
        yield
    except ApiError as exc:
        for pattern, name in names:
            exc.message = pattern.sub(name, exc.message)
            if exc.param is not None:
                exc.param = pattern.sub(name, exc.param)
        raise
