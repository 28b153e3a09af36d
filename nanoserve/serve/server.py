"""Run an app under uvicorn: in a background thread (tests, notebooks, benchmarks), or in the
main thread with a graceful drain on SIGTERM/SIGINT (`nanoserve serve`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import uvicorn

from nanoserve.serve.limits import DEFAULT_DRAIN_TIMEOUT, SHUTDOWN_GRACE

logger = logging.getLogger("nanoserve.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM or SIGINT drains the app (``app.state.drain``:
    new work gets a 503, work in flight finishes or is ended) before the server stops, so the
    process exits 0 with no request cut mid-response. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout: float) -> None:
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._drain is not None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        logger.info("signal %d: draining for up to %g s (send it again to stop at once)",
                    sig, self.drain_timeout)
        self.begin_drain()

    def begin_drain(self) -> concurrent.futures.Future:
        """Drain, then stop (from any thread); the future is done when the drain is."""
        if self._drain is None:
            self._drain = asyncio.run_coroutine_threadsafe(self._drain_then_exit(), self._loop)
        return self._drain

    async def _drain_then_exit(self) -> None:
        try:
            await self.app.state.drain(self.drain_timeout)
        finally:
            self.should_exit = True


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread. Port 0 picks a free port; `url` says which.

    >>> server = BackgroundServer(app).start(); ...; server.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE)
        self.server = DrainingServer(config, app, drain_timeout)
        self._thread = threading.Thread(target=self.server.run, name="nanoserve-http", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start (see its log above)")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def drain(self, timeout: float = 30.0) -> None:
        """Drain as on SIGTERM (see DrainingServer), then wait for the server to stop."""
        self.server.begin_drain().result(timeout)
        self._thread.join(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
