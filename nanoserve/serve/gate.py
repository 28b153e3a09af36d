"""The door every HTTP request passes: a body size limit (413), no new work while draining
(503), and a count of the requests in flight that a graceful drain waits on.

Plain ASGI, not BaseHTTPMiddleware, which would get between a streaming response and the
client's disconnect.
"""

from __future__ import annotations

import asyncio

from nanoserve.serve.errors import ApiError
from nanoserve.serve.limits import DEFAULT_MAX_REQUEST_BYTES

PROBES = frozenset({"/health", "/metrics"})  # always answered, never counted as work


class Admission:
    """Whether the server takes new work, and how many requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class RequestGate:
    def __init__(self, app, admission: Admission, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.admission = admission
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            await ApiError(503, "the server is shutting down and takes no new requests",
                           code="server_shutting_down").response()(scope, receive, send)
            return
        self.admission.enter()
        try:
            body = await self._read_body(receive)
            if body is None:
                await ApiError(413, f"request body is larger than the server's limit of "
                                    f"{self.max_request_bytes} bytes (--max-request-bytes)",
                               code="request_too_large").response()(scope, receive, send)
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.admission.leave()

    async def _read_body(self, receive) -> list[dict] | None:
        """The request's body messages, or None once they pass the limit (a declared
        Content-Length is not trusted: the bytes are counted as they come)."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client left; the app sees the disconnect
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                return messages

def _replay(messages: list[dict], receive):
    """A receive that hands the app the buffered body first, then the client's own channel
    (so a disconnect still reaches the handler)."""
    pending = list(messages)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
