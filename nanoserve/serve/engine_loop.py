"""The one thread that owns the Engine.

The Engine is not thread-safe, so HTTP handlers never touch it: they post ``add`` and
``abort`` commands to a queue that this thread drains between steps, and it delivers each
RequestOutput to the request's asyncio.Queue through ``call_soon_threadsafe``. Every request
posted before a step shares that step: continuous batching needs nothing more. When there is
no work the thread sleeps on an Event, so an idle server costs nothing.

The waiting queue is bounded: a request that would wait behind more than ``max_waiting``
others that no free row can take is refused at once (Overloaded: the server answers 503 with
Retry-After) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

from nanoserve.engine import Engine, EngineStats, RequestOutput, SamplingParams
from nanoserve.serve.limits import DEFAULT_MAX_WAITING
from nanoserve.serve.metrics import ServeMetrics

logger = logging.getLogger("nanoserve.serve")


class EngineStopped(RuntimeError):
    """The engine loop is not running (shut down, or never started)."""


class Overloaded(RuntimeError):
    """The waiting queue is full: the request was refused, not queued; try again later."""


@dataclass
class _Stream:
    """Where one request's outputs go, and the timing its metrics need."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: _Stream
    accepted: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    """Runs ``engine.step()`` in a background thread for as long as there is work.

    ``stats`` is a snapshot of ``engine.stats()``, replaced after every step and every batch of
    commands, so readers on other threads never call into the engine.
    """

    def __init__(self, engine: Engine, metrics: ServeMetrics | None = None, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServeMetrics()
        self.max_waiting = DEFAULT_MAX_WAITING if max_waiting is None else max_waiting
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        self.stats: EngineStats = engine.stats()
        self._commands: collections.deque = collections.deque()  # append/popleft are thread-safe
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.fault: str | None = None  # set when an engine fault ended the loop

    # -- lifecycle (any thread) ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, wake the thread and wait for it to end."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- commands (event-loop side) --------------------------------------------------------
    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; return the asyncio.Queue its RequestOutputs will arrive on (an
        exception instance there means the engine failed it). Raises the engine's
        RequestError if the request cannot be served, Overloaded if the waiting queue is full,
        EngineStopped if the loop is down."""
        if not self.alive:
            raise EngineStopped(self.stopped_reason)
        stream = _Stream(asyncio.get_running_loop())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Add(request_id, prompt, params, stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while we were queueing
            raise
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Stop a request (its blocks and row go back at once); unknown or finished ids are ignored."""
        self._post(_Abort(request_id))

    def _post(self, command: _Add | _Abort) -> None:
        self._commands.append(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a command posted after the drain re-sets it
                self._drain_commands()
                if self._stopping:
                    break
                if not self.engine.has_unfinished():
                    self.stats = self.engine.stats()
                    self._wake.wait()
                    continue
                self._step()
        except Exception as exc:  # an engine fault: its state cannot be trusted, so stop serving
            logger.exception("engine fault: the engine loop stops; /health reports 503")
            self.fault = f"{type(exc).__name__}: {exc}"
            self._close_engine()
        finally:
            self._stopping = True
            self._shutdown()

    def _close_engine(self) -> None:
        """Release what a faulted engine started (a tensor-parallel engine's other ranks): it
        will run no more steps, and nothing it started may outlive the fault idle."""
        try:
            self.engine.close()
        except Exception:
            logger.exception("closing the faulted engine failed")

    def _drain_commands(self) -> None:
        room: int | None = None  # adds the queue takes before the next step; counted lazily
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                room = self._room() if room is None else room
                room -= self._add(command, room)
            else:
                self._abort(command.request_id)
                room = None  # an abort may have freed a row or a place in the queue

    def _room(self) -> int:
        """How many more requests may be added now: the free rows, plus the places left in the
        waiting queue."""
        stats = self.engine.stats()
        free_rows = max(self.engine.config.max_batch_size - stats.running, 0)
        return free_rows + self.max_waiting - stats.waiting

    def _add(self, command: _Add, room: int) -> int:
        """Add one request if there is room; how many requests it added (0 or 1)."""
        if not command.accepted.set_running_or_notify_cancel():
            return 0  # cancelled before we got to it; its abort follows in the queue
        if room <= 0:
            self.metrics.record_shed()
            command.accepted.set_exception(Overloaded(
                f"the server is at capacity: {self.max_waiting} requests are already waiting for a row "
                "(--max-waiting-requests); retry later"))
            return 0
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
        except Exception as exc:  # RequestError, or anything else: this request fails alone
            command.accepted.set_exception(exc)
            return 0
        self._streams[command.request_id] = command.stream
        self.metrics.record_admitted(len(command.prompt) if isinstance(command.prompt, list) else 0)
        command.accepted.set_result(None)
        return 1

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished already, or never admitted
        self.engine.abort(request_id)
        self.metrics.record_finished("abort")
        self.stats = self.engine.stats()  # readers see the blocks back without waiting for a step

    def _step(self) -> None:
        """One engine step. A request's own failure comes back as its output; anything that
        raises out of step() is an engine fault and ends the loop (see _run)."""
        before = self.stats
        outputs = self.engine.step()
        now = time.perf_counter()
        self.stats = stats = self.engine.stats()
        if stats.decode_steps > before.decode_steps:
            self.metrics.record_decode_step(stats.decode_tokens - before.decode_tokens)
        for output in outputs:
            self._deliver(output, now)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # aborted: nobody is listening
        count = len(output.new_token_ids)
        if count:
            first = stream.last_token_time is None
            ttft = output.metrics.first_token_time - output.metrics.arrival_time if first else None
            gap = None if first else now - stream.last_token_time
            self.metrics.record_tokens(count, ttft, gap)
            stream.last_token_time = now
        if output.finished:
            del self._streams[output.request_id]
            self.metrics.record_finished(output.finish_reason or "unknown")
        _put(stream, output)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            self.metrics.record_finished("error")
            _put(stream, exc)
        self._streams.clear()

    def _shutdown(self) -> None:
        reason = EngineStopped(self.stopped_reason)
        self._fail_all(reason)
        for command in self._commands:  # adds that will never be served
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(reason)
        self._commands.clear()

    @property
    def stopped_reason(self) -> str:
        """Why the loop takes no work (meaningful once it is not alive)."""
        if self.fault is not None:
            return f"the engine stopped after a fault ({self.fault}); the server takes no more work"
        if self._thread is None:
            return "the engine loop is not running"
        return "the server is shutting down"


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the event loop is closed: the server is gone, so is the reader
        pass
