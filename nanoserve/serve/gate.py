"""The door every HTTP request passes: a body size limit (413), a body that stalls (408), no new
work while draining (503), and a count of the requests in flight that a graceful drain waits on.

Plain ASGI, not BaseHTTPMiddleware, which would get between a streaming response and the
client's disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nanoserve.serve.errors import ApiError
from nanoserve.serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES

PROBES = frozenset({"/health", "/metrics"})  # always answered, never counted as work


class Admission:
    """Whether the server takes new work, and how many requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Set when a drain's time is up: a body still arriving then is refused, not waited for.
        self.cut = asyncio.Event()

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


class _ClientLeft(Exception):
    """The client hung up before its body was complete: there is nobody to answer."""


class RequestGate:
    """Counts every request but the probes as in flight until its response is done, and hands
    the app only complete bodies. `on_disconnect` is called for a client that leaves mid-body."""

    def __init__(self, app, admission: Admission, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, on_disconnect: Callable[[], None] | None = None) -> None:
        self.app = app
        self.admission = admission
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self.on_disconnect = on_disconnect or (lambda: None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            await ApiError(503, "the server is shutting down and takes no new requests",
                           code="server_shutting_down").response(scope["path"])(scope, receive, send)
            return
        self.admission.enter()
        try:
            try:
                body = await self._read_body(receive)
            except _ClientLeft:
                self.on_disconnect()
                return
            except ApiError as refusal:  # the rest of the body is never read: close the connection
                response = refusal.response(scope["path"])
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.admission.leave()

    async def _read_body(self, receive) -> list[dict]:
        """The request's body messages. A declared Content-Length is not trusted: the bytes are
        counted as they come (413 past the limit)."""
        messages, size = [], 0
        while True:
            message = await self._next_message(receive)
            if message["type"] != "http.request":
                raise _ClientLeft
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                raise ApiError(413, f"request body is larger than the server's limit of "
                                    f"{self.max_request_bytes} bytes (--max-request-bytes)",
                               code="request_too_large")
            if not message.get("more_body", False):
                return messages

    async def _next_message(self, receive) -> dict:
        """The client's next message; a 408 after `body_timeout` seconds without one, a 503 once
        a drain's time is up."""
        if self.admission.cut.is_set():
            raise _shut_before_body()
        read = asyncio.ensure_future(receive())
        cut = asyncio.ensure_future(self.admission.cut.wait())
        try:
            await asyncio.wait({read, cut}, timeout=self.body_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            if not read.done():
                read.cancel()
        if read.done():
            return read.result()
        if self.admission.cut.is_set():
            raise _shut_before_body()
        raise ApiError(408, f"the request body stalled: nothing arrived for {self.body_timeout:g} s "
                            "(--body-timeout)", code="request_timeout")


def _shut_before_body() -> ApiError:
    return ApiError(503, "the server shut down before the request body arrived", code="server_shutting_down")


def _replay(messages: list[dict], receive):
    """A receive that hands the app the buffered body first, then the client's own channel
    (so a disconnect still reaches the handler)."""
    pending = list(messages)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
