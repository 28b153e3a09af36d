"""Graceful drain: new work gets a 503 at once, work in flight finishes within the drain
timeout or is ended with a final error event (streams) or a 503, and on SIGTERM the process
exits 0 with a clean log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import free_port, tiny_text_engine, wait_until_serving  # noqa: E402

ENGINE = dict(max_batch_size=8, kv_cache_bytes=1 << 20, block_size=4, max_model_len=256)


def read_stream(client, body: dict) -> list[str]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def stream_outcome(events: list[str]) -> str:
    """'complete' (a finish_reason, then [DONE]) or 'ended' (an error event, then [DONE])."""
    assert events and events[-1] == "[DONE]", events
    last = json.loads(events[-2])
    if "error" in last:
        assert set(last["error"]) == {"message", "type", "param", "code"}
        return "ended"
    assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
    return "complete"


def test_drain_finishes_short_work_ends_long_work_and_refuses_new_work(tmp_path):
    from nanoserve.serve.app import create_app
    from nanoserve.serve.engine_loop import EngineLoop
    from nanoserve.serve.server import BackgroundServer

    engine = tiny_text_engine(tmp_path, **ENGINE)
    original_step = engine.step

    def slow_step():  # 200 tokens take ~4 s: far past the drain timeout
        time.sleep(0.02)
        return original_step()

    engine.step = slow_step
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, "tiny"), drain_timeout=1.0).start()
    base = {"model": "tiny", "prompt": "drain", "temperature": 0, "ignore_eos": True}
    results: dict[str, object] = {}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        def run(name, call):
            results[name] = call()

        workers = [
            threading.Thread(target=run, args=("short", lambda: read_stream(client, {**base, "max_tokens": 3}))),
            threading.Thread(target=run, args=("long", lambda: read_stream(client, {**base, "max_tokens": 200}))),
            threading.Thread(target=run, args=("whole", lambda: client.post(
                "/v1/completions", json={**base, "max_tokens": 200}))),
        ]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 10
        while loop.stats.running + loop.stats.waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        drained = threading.Thread(target=server.drain)
        started = time.monotonic()
        drained.start()
        while client.get("/health").status_code == 200:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        refused = client.post("/v1/completions", json={**base, "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        for worker in workers:
            worker.join(30)
        drained.join(30)
    assert time.monotonic() - started < 1.0 + 6.0  # the drain timeout, plus the ending grace
    assert stream_outcome(results["short"]) == "complete"
    assert stream_outcome(results["long"]) == "ended"
    assert results["whole"].status_code == 503
    assert results["whole"].json()["error"]["code"] == "engine_unavailable"
    assert not loop.alive
    engine.check_drained()


@pytest.mark.slow  # a fresh interpreter importing torch: ~5-10 s on 2 cores
def test_sigterm_with_streams_in_flight_exits_0_within_the_drain_timeout_with_a_clean_log(tmp_path):
    from conftest import write_gguf

    from nanoserve.model.network.llama import unfuse_hf_weights
    from nanoserve.model.network.synthetic import random_model, tiny_config

    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    port, drain_timeout = free_port(), 2.0
    argv = [sys.executable, "-m", "nanoserve.launch", "serve", "--model", str(path), "--port", str(port),
            "--max-model-len", "1024", "--kv-cache-bytes", "4M", "--max-batch-size", "8",
            "--drain-timeout", str(drain_timeout), "--log-level", "info"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    results: list[list[str]] = []
    try:
        wait_until_serving(process, url)
        body = {"model": "tiny", "prompt": "hello", "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client:
            workers = [threading.Thread(target=lambda n=n: results.append(
                read_stream(client, {**body, "max_tokens": n}))) for n in (4, 8, 1000, 1000)]
            for worker in workers:
                worker.start()
            time.sleep(0.5)  # every stream admitted and under way
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.join(60)
        output = process.communicate(timeout=60)[0]
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert elapsed < drain_timeout + 8, output
    assert len(results) == 4 and all(stream_outcome(events) in ("complete", "ended") for events in results)
    assert "Traceback" not in output and "CancelledError" not in output and " 500" not in output, output
    assert "draining" in output


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(f"{name} ")))


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow  # a fresh interpreter importing torch: ~5-10 s on 2 cores
def test_sigterm_with_a_stalled_half_sent_body_exits_within_the_drain_timeout(tmp_path):
    """A client that sends its headers and half its body, then stalls, cannot hold the process
    past --drain-timeout (the body timeout is left long, so the drain is what ends it), and a
    stream in flight beside it still ends with [DONE]."""
    import socket

    from conftest import write_gguf

    from nanoserve.model.network.llama import unfuse_hf_weights
    from nanoserve.model.network.synthetic import random_model, tiny_config

    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    port, drain_timeout = free_port(), 2.0
    argv = [sys.executable, "-m", "nanoserve.launch", "serve", str(path), "--port", str(port), "--api-key", "k",
            "--max-model-len", "1024", "--kv-cache-bytes", "4M", "--drain-timeout", str(drain_timeout),
            "--body-timeout", "60", "--log-level", "info"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"}
    stream: list[list[str]] = []
    try:
        wait_until_serving(process, url)
        stalled = socket.create_connection(("127.0.0.1", port), timeout=30)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b"{" + b" " * 499)
        body = {"model": "tiny", "prompt": "hello", "temperature": 0, "ignore_eos": True, "max_tokens": 1000}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            reader = threading.Thread(target=lambda: stream.append(read_stream(client, body)))
            reader.start()
            # Both in flight: the stalled body in the door, the stream in the engine.
            wait_for(lambda: metric(url, "nanoserve_http_requests_in_flight") == 2
                     and metric(url, "nanoserve_requests_running") == 1)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=drain_timeout + 30)
            elapsed = time.monotonic() - signalled
            reader.join(30)
        answer = stalled.recv(65536)
        stalled.close()
        output = process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert elapsed < drain_timeout + 1.0, (elapsed, output)
    assert len(stream) == 1 and stream_outcome(stream[0]) in ("complete", "ended"), stream
    assert answer.startswith(b"HTTP/1.1 503 ") and b"server_shutting_down" in answer, answer
    assert "Traceback" not in output and "ERROR" not in output, output
    assert "draining: 2 requests in flight" in output, output
