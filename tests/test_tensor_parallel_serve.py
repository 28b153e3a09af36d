"""A tensor-parallel engine behind the server: requests through the official openai client
give the one-process engine's text, a worker lost mid-service turns the server to 503s with
every rank gone, and two "hosts" launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT over loopback) serve a request end to end and stop together."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import free_port, served, stop_and_collect, tiny_text_engine, wait_until_serving  # noqa: E402

from nanoserve.engine import SamplingParams  # noqa: E402
from nanoserve.model.network.llama import unfuse_hf_weights  # noqa: E402
from nanoserve.model.network.synthetic import random_model, tiny_config  # noqa: E402

ENGINE = dict(max_batch_size=4, max_model_len=64, kv_cache_bytes=1 << 20, block_size=4)
COMPLETION = dict(model="tiny", prompt="hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def workers_left() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]


def test_the_server_over_two_ranks_answers_the_openai_client_as_one_rank(tmp_path):
    reference = tiny_text_engine(tmp_path, **ENGINE)
    with tiny_text_engine(tmp_path, tensor_parallel_size=2, **ENGINE) as engine:
        with served(engine, "tiny", "k") as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k")
            text = client.completions.create(**COMPLETION).choices[0].text
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    params = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert text == reference.generate(["hello there"], SamplingParams(**params), use_tqdm=False)[0].text
    expected = reference.chat([{"role": "user", "content": "hi"}],
                              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)).text
    assert chat.choices[0].message.content == expected
    assert not workers_left()


def test_a_lost_worker_turns_the_server_to_503_and_every_rank_ends(tmp_path):
    engine = tiny_text_engine(tmp_path, tensor_parallel_size=2, **ENGINE)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with served(engine, "tiny", None) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        (worker,) = engine.worker.driver.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 503 and "nanoserve-tp1" in failed.json()["error"]["message"]
        assert client.get("/health").status_code == 503
    assert not workers_left()


def test_a_fault_on_rank_0_alone_stops_the_other_ranks(tmp_path):
    """A fault outside the collectives (rank 0's own bookkeeping) leaves the other ranks idle
    and healthy: the faulted loop closes the engine, and they leave."""
    engine = tiny_text_engine(tmp_path, tensor_parallel_size=2, **ENGINE)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with served(engine, "tiny", None) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        (worker,) = engine.worker.driver.workers

        def broken_advance(rows):
            raise AssertionError("planted: the slot table disagrees with the pool")

        engine.scheduler.blocks.advance = broken_advance
        assert client.post("/v1/completions", json=body).status_code == 503
        worker.join(30)
        assert worker.exitcode == 0  # told to stop, not killed
        assert client.get("/health").status_code == 503
    assert not workers_left()


@pytest.mark.slow  # two fresh interpreters importing torch
def test_two_hosts_joined_as_torchrun_serve_a_request_and_stop_together(tmp_path, gguf_writer):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = gguf_writer(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    master, port = free_port(), free_port()
    processes = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "nanoserve.launch", "serve", str(path), "--port", str(port),
                "--tensor-parallel-size", "2", "--weights", "fp32", "--max-model-len", "64",
                "--kv-cache-bytes", "1M", "--max-batch-size", "4"]
        processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=env))
    try:
        url = f"http://127.0.0.1:{port}"  # one port for both: only rank 0 binds it
        wait_until_serving(processes[0], url, timeout=120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.completions.create(**COMPLETION)
        assert reply.usage.completion_tokens == 6
    finally:
        output = stop_and_collect(processes[0], signal.SIGINT)
        try:
            worker_output = processes[1].communicate(timeout=30)[0]
        finally:
            processes[1].kill()
    assert processes[0].returncode == 0, output
    assert processes[1].returncode == 0, worker_output
