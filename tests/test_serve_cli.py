"""`nanoserve serve` from the command line: options parse (the model as MODEL or --model), and a
real process serves a planted tiny GGUF on a loopback port, says what it loaded, then shuts
down cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys

import pytest

from nanoserve.engine.options import parse_bytes
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.serve.cli import add_serve_subcommand, chosen_model, served_name
from nanoserve.serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import free_port, stop_and_collect, wait_until_serving  # noqa: E402


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanoserve")
    add_serve_subcommand(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback_and_sizes_parse():
    args = parse()
    assert (chosen_model(args), args.host, args.port, args.compile) == ("smollm2", "127.0.0.1", 8000, None)
    assert (args.max_batch_size, args.kv_cache_bytes) == (32, None)  # the engine's default, in tokens
    assert callable(args.func)
    assert parse("--kv-cache-bytes", "512M").kv_cache_bytes == 512 << 20
    assert [parse_bytes(s) for s in ("1024", "2k", "1.5GiB", "3 MB")] == [1024, 2048, 3 << 29, 3 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes("lots")


def test_request_limit_and_timeouts_parse_with_defaults():
    args = parse()
    assert (args.max_request_bytes, args.drain_timeout, args.body_timeout) == (
        DEFAULT_MAX_REQUEST_BYTES, DEFAULT_DRAIN_TIMEOUT, DEFAULT_BODY_TIMEOUT)
    args = parse("--max-request-bytes", "2M", "--drain-timeout", "7.5", "--body-timeout", "3")
    assert (args.max_request_bytes, args.drain_timeout, args.body_timeout) == (2 << 20, 7.5, 3.0)


def test_the_model_is_a_positional_argument_or_model():
    assert chosen_model(parse("/models/a.gguf", "--port", "9000")) == "/models/a.gguf"  # as `vllm serve MODEL`
    assert chosen_model(parse("--model", "/models/a.gguf")) == "/models/a.gguf"
    assert chosen_model(parse("/models/a.gguf", "--model", "/models/a.gguf")) == "/models/a.gguf"
    with pytest.raises(SystemExit, match="two models"):
        chosen_model(parse("/models/a.gguf", "--model", "/models/b.gguf"))


def test_served_name_comes_from_the_model_argument():
    assert served_name("smollm2") == "smollm2"
    assert served_name("/models/SmolLM2-135M.Q4_1.gguf") == "SmolLM2-135M.Q4_1"
    assert served_name("/models/llama-dir/") == "llama-dir"


def test_a_missing_model_file_is_a_clean_exit(tmp_path):
    with pytest.raises(SystemExit, match="model not found"):
        args = parse(str(tmp_path / "nothing.gguf"), "--port", str(free_port()))
        args.func(args)


@pytest.mark.slow  # a fresh interpreter importing torch: ~5-10 s on 2 cores
def test_serve_process_answers_says_what_it_loaded_and_stops_on_ctrl_c(tmp_path, gguf_writer):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    path = gguf_writer(tmp_path / "tiny.gguf", config, unfuse_hf_weights(random_model(config, seed=0)))
    port = free_port()
    argv = [sys.executable, "-m", "nanoserve.launch", "serve", str(path), "--port", str(port),
            "--api-key", "k", "--max-model-len", "64", "--kv-cache-bytes", "1M", "--max-batch-size", "4",
            "--log-level", "info"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, url)
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        output = stop_and_collect(process, signal.SIGINT)
    assert process.returncode == 0, output
    # The startup summary: what was loaded, how, and what the K/V pool holds (1M of K/V at 2
    # layers x 2 heads x 16 dims x K and V = 128 values a token: 256 blocks of 16 tokens in bf16,
    # 128 in fp32, the compute dtype of this CPU's kernel tier).
    from nanoserve.model.quant import cpu_kernels
    tier = cpu_kernels.resolve_tier()
    dtype = str(cpu_kernels.compute_dtype(tier)).removeprefix("torch.")
    blocks = 256 if dtype == "bfloat16" else 128
    assert f"model {path}: loaded in " in output, output
    assert f"compute dtype {dtype}; CPU kernels: {tier}" in output, output
    assert re.search(r"weights \S+, [0-9.]+ [KMG]iB resident \(the file: [0-9.]+ [KMG]iB\);", output), output
    assert (f"K/V pool 1.0 MiB of {dtype}: {blocks} blocks of 16 tokens ({(blocks - 1) * 16:,} tokens for requests"
            in output), output
    assert "max_model_len 64 (the model takes up to 1,024); up to 4 rows" in output, output
    assert f"serving 'tiny' at http://127.0.0.1:{port} (API key required)" in output, output
