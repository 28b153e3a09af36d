"""A loaded server sheds load: past the free rows and --max-waiting-requests waiting requests,
a new request gets a 503 with Retry-After at once instead of queueing without limit; the queue
and the shed count are in /metrics, and a client that gives up while queued leaves the queue."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import served, tiny_text_engine  # noqa: E402

from nanoserve.serve.engine_loop import EngineLoop  # noqa: E402
from nanoserve.serve.limits import DEFAULT_MAX_WAITING  # noqa: E402

ROWS, MAX_WAITING, BURST = 2, 3, 12
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class StepGate:
    """Holds the engine thread inside its next step until `open()`: requests posted meanwhile
    pile up unanswered, so a burst reaches the loop all at once, whatever the host's speed."""

    def __init__(self, engine) -> None:
        self.gate = threading.Event()
        step = engine.step

        def gated():
            self.gate.wait(30)
            return step()

        engine.step = gated

    def open(self) -> None:
        self.gate.set()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.fixture
def gated_server(tmp_path):
    engine = tiny_text_engine(tmp_path, max_batch_size=ROWS, max_model_len=64, kv_cache_bytes=1 << 20)
    gate = StepGate(engine)
    with served(engine, "tiny", None) as server:
        server.engine_loop.max_waiting = MAX_WAITING
        yield server, gate
        gate.open()


def test_a_burst_past_the_queue_gets_503s_with_retry_after_and_none_is_lost(gated_server):
    server, gate = gated_server
    loop = server.engine_loop

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            await asyncio.to_thread(wait_for, lambda: len(loop._streams) == 1)
            rest = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(BURST - 1)]
            await asyncio.to_thread(wait_for, lambda: len(loop._commands) == BURST - 1)
            gate.open()
            return await asyncio.gather(first, *rest)

    responses = asyncio.run(burst())
    assert len(responses) == BURST
    ok = [r for r in responses if r.status_code == 200]
    shed = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(shed) == BURST, [r.status_code for r in responses]
    assert len(ok) == ROWS + MAX_WAITING  # a row each for two, three waiting; the rest refused at once
    for response in ok:
        assert response.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    for response in shed:
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "server_overloaded" and "--max-waiting-requests" in error["message"]
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "nanoserve_requests_shed_total") == len(shed)
    assert metric(text, "nanoserve_requests_waiting_max") == MAX_WAITING
    assert metric(text, "nanoserve_requests_waiting") == 0
    wait_for(lambda: loop.stats.running == 0)
    loop.engine.check_drained()


def test_a_client_that_times_out_while_queued_leaves_the_queue(tmp_path):
    engine = tiny_text_engine(tmp_path, max_batch_size=ROWS, max_model_len=1024, kv_cache_bytes=4 << 20)
    long = {**BODY, "max_tokens": 1000, "stream": True}  # holds its row far longer than the client waits

    async def scenario(server):
        loop = server.engine_loop
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            streams = [await client.send(client.build_request("POST", "/v1/completions", json=long), stream=True)
                       for _ in range(ROWS)]
            lines = [stream.aiter_lines() for stream in streams]  # held: a dropped iterator hangs up
            for line in lines:  # both rows are taken: the next request waits
                await anext(line)
            async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):  # the client's own timeout, while queued
                    await impatient.post("/v1/completions", json={**BODY, "max_tokens": 20})
            await asyncio.to_thread(wait_for, lambda: loop.metrics.finished["abort"] == 1 == loop.metrics.disconnects)
            for stream in streams:
                await stream.aclose()

    with served(engine, "tiny", None) as server:
        asyncio.run(scenario(server))
        wait_for(lambda: server.engine_loop.stats.running == 0 and server.engine_loop.stats.waiting == 0)
        assert server.engine_loop.metrics.shed == 0
        engine.check_drained()


def test_the_default_queue_holds_512_whatever_the_batch(tmp_path):
    # As Ollama's queue: 64 streaming clients on a 32-row server wait their turn, not a 503.
    engine = tiny_text_engine(tmp_path, max_batch_size=5, max_model_len=64, kv_cache_bytes=1 << 20)
    assert EngineLoop(engine).max_waiting == DEFAULT_MAX_WAITING == 512
    with pytest.raises(ValueError, match="max_waiting must be >= 0"):
        EngineLoop(engine, max_waiting=-1)


def test_serve_takes_max_waiting_requests():
    import argparse

    from nanoserve.serve.cli import add_serve_subcommand

    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers())
    assert parser.parse_args(["serve", "--max-waiting-requests", "7"]).max_waiting_requests == 7
    assert parser.parse_args(["serve"]).max_waiting_requests == DEFAULT_MAX_WAITING
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-waiting-requests", "-1"])
