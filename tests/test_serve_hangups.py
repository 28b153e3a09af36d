"""A client hanging up is normal traffic: against the real `nanoserve serve` process, a burst of
hang-ups (streamed and not, single and batched prompts, and one in the middle of its body)
is counted in /metrics, gives every row and block back, and leaves no traceback, no ERROR
line and no unretrieved task in the log."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import free_port, stop_and_collect, wait_until_serving, write_gguf  # noqa: E402

from nanoserve.model.network.llama import unfuse_hf_weights  # noqa: E402
from nanoserve.model.network.synthetic import random_model, tiny_config  # noqa: E402

# Long enough that no request can finish before its client leaves (thousands of steps).
LONG = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 4000}
HANGUPS = [  # (body, engine requests it makes)
    ({**LONG, "prompt": "hello"}, 1),
    ({**LONG, "prompt": ["one", "two", "three"]}, 3),
    ({**LONG, "prompt": [[5, 6, 7], [8, 9]]}, 2),
    ({**LONG, "prompt": "hello", "stream": True}, 1),
    ({**LONG, "prompt": [5, 6, 7], "stream": True}, 1),
]
ENGINE_REQUESTS = sum(count for _, count in HANGUPS)
CLIENTS = len(HANGUPS) + 1  # and one that leaves in the middle of its body


def metrics(url: str) -> dict[str, float]:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def send(port: int, body: bytes, declared: int | None = None) -> socket.socket:
    """A raw HTTP request whose socket the test closes (hangs up) when it likes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (declared or len(body)) + body)
    return sock


@pytest.mark.slow  # a fresh interpreter importing torch: ~5-10 s on 2 cores
def test_a_burst_of_hangups_is_counted_frees_everything_and_logs_no_error(tmp_path):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True, max_position_embeddings=4096)
    path = write_gguf(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    port = free_port()
    argv = [sys.executable, "-m", "nanoserve.launch", "serve", str(path), "--port", str(port),
            "--max-model-len", "4096", "--kv-cache-bytes", "16M", "--max-batch-size", "8",
            "--drain-timeout", "5", "--log-level", "info"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, url)
        baseline = metrics(url)["nanoserve_kv_blocks_free"]
        for _ in range(2):  # twice: the first round's leftovers (if any) would show in the second
            sockets = [send(port, json.dumps(body).encode()) for body, _ in HANGUPS]
            sockets.append(send(port, b'{"model": "tiny", ', declared=1000))
            wait_for(lambda: (m := metrics(url))["nanoserve_requests_running"]
                     + m["nanoserve_requests_waiting"] == ENGINE_REQUESTS
                     and m["nanoserve_http_requests_in_flight"] == CLIENTS)
            for sock in sockets[3:5]:  # the streams have started sending
                assert sock.recv(64).startswith(b"HTTP/1.1 200 ")
            for sock in sockets:
                sock.close()
            wait_for(lambda: (m := metrics(url))["nanoserve_requests_running"] == m["nanoserve_requests_waiting"]
                     == m["nanoserve_http_requests_in_flight"] == 0 and m["nanoserve_kv_blocks_free"] == baseline)
        after = metrics(url)
        assert after["nanoserve_client_disconnects_total"] == 2 * CLIENTS, after
        assert after['nanoserve_requests_finished_total{reason="abort"}'] == 2 * ENGINE_REQUESTS, after
        assert httpx.post(f"{url}/v1/completions", json={**LONG, "prompt": "hi", "max_tokens": 3},
                          timeout=30).status_code == 200
    finally:
        output = stop_and_collect(process, signal.SIGTERM)
    assert process.returncode == 0, output
    assert "Traceback" not in output and "ERROR" not in output, output
    assert "never retrieved" not in output and "CancelledError" not in output, output
    # At most one INFO line a hang-up: the access line of a stream that had started.
    assert sum('"POST /v1/completions' in line for line in output.splitlines()) <= 2 * CLIENTS + 1, output
