"""`nanoserve generate` end to end on a planted tiny GGUF (the real model is too slow for CI here)."""

from __future__ import annotations

import pytest

from nanoserve.engine.options import engine_kwargs
from nanoserve.launch import build_parser, main
from nanoserve.model.llama import unfuse_hf_weights
from nanoserve.model.loader import load_model
from nanoserve.model.synthetic import random_model, tiny_config

CONFIG = tiny_config(vocab_size=260)


@pytest.fixture
def tiny_gguf(tmp_path, gguf_writer):
    weights = unfuse_hf_weights(random_model(CONFIG, seed=5))
    return gguf_writer(tmp_path / "tiny.gguf", CONFIG, weights)


def test_generate_prints_the_greedy_continuation(tiny_gguf, capsys, dense_greedy):
    # fp32: the greedy reference below is the fp32 network (a named model otherwise loads as auto).
    assert main(["generate", "--model", str(tiny_gguf), "--weights", "fp32", "--max-tokens", "6", "hello"]) == 0
    out = capsys.readouterr()
    model, tokenizer = load_model(str(tiny_gguf))
    ids = dense_greedy(model, tokenizer.encode("hello"), 6)
    stop = tokenizer.eos_token_id
    expected = tokenizer.decode(ids[: ids.index(stop)] if stop in ids else ids, skip_special_tokens=True)
    assert out.out == expected + "\n"
    assert "new tokens" in out.err


def test_generate_sampling_with_seed_is_reproducible(tiny_gguf, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--max-tokens", "8", "--temperature", "1.0",
            "--top-k", "20", "--top-p", "0.9", "--seed", "3", "hi"]
    main(argv)
    first = capsys.readouterr().out
    main(argv)
    assert capsys.readouterr().out == first


def test_generate_reports_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "x"]) == 2
    assert "missing.gguf" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-1", "x"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_parser_has_generate_subcommand_with_documented_options():
    args = build_parser().parse_args(["generate", "--chat", "--max-tokens", "3", "--top-k", "5", "p"])
    assert (args.command, args.chat, args.max_tokens, args.top_k, args.prompt) == ("generate", True, 3, 5, "p")
    assert args.model == "smollm2" and args.dtype is None  # float32 on cpu, bfloat16 on cuda
    assert (args.max_batch_size, args.compile) == (32, False)


def test_parser_has_serve_subcommand_with_engine_options():
    args = build_parser().parse_args(["serve", "--port", "9000", "--compile", "--kv-cache-bytes", "64M"])
    assert (args.command, args.port, args.compile, args.kv_cache_bytes) == ("serve", 9000, True, 64 << 20)


def test_weights_option_reaches_build_engine(tiny_gguf, capsys):
    args = build_parser().parse_args(["generate", "--weights", "int4", "p"])
    assert engine_kwargs(args)["weights"] == "int4"
    assert build_parser().parse_args(["serve"]).weights is None  # auto for a named model
    assert main(["generate", "--model", str(tiny_gguf), "--weights", "int4", "--max-tokens", "4", "hi"]) == 0
    assert "new tokens" in capsys.readouterr().err  # ran to the end on int4 weights


def test_chunked_prefill_and_prefix_caching_switches_reach_build_engine():
    on = engine_kwargs(build_parser().parse_args(["serve"]))
    assert (on["enable_chunked_prefill"], on["enable_prefix_caching"], on["max_num_batched_tokens"]) == (True, True, None)
    off = engine_kwargs(build_parser().parse_args(
        ["generate", "--no-chunked-prefill", "--no-prefix-caching", "--max-num-batched-tokens", "64", "p"]))
    assert (off["enable_chunked_prefill"], off["enable_prefix_caching"], off["max_num_batched_tokens"]) == (False, False, 64)
