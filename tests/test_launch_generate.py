"""`nanoserve generate` end to end on a planted tiny GGUF (the real model is too slow for CI here):
the text, what was loaded, the token counts and why the reply ended."""

from __future__ import annotations

import re

import pytest
import torch

from nanoserve.engine import SamplingParams
from nanoserve.engine.options import engine_kwargs
from nanoserve.launch import build_parser, main
from nanoserve.model.formats.loader import load_model
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config

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
    # One prompt takes one row, and an unset budget is what that row needs at full length.
    assert (args.max_batch_size, args.kv_cache_bytes, args.compile) == (1, None, None)  # unset: compiled


def test_the_library_and_the_command_line_default_to_the_same_reply_length():
    assert SamplingParams().max_tokens == build_parser().parse_args(["generate", "p"]).max_tokens == 128


def counts(err: str) -> tuple[int, int, str]:
    """(prompt tokens, new tokens, finish note) from generate's closing line on stderr."""
    match = re.search(r"^\[(\d+) prompt \+ (\d+) new tokens in .*; finish: (.*)\]$", err, re.M)
    assert match, err
    return int(match.group(1)), int(match.group(2)), match.group(3)


def test_the_closing_line_counts_the_new_tokens_and_says_why_the_reply_ended(tiny_gguf, capsys):
    # fp32: the exact network, so the greedy tokens (and where an end-of-text falls) are fixed.
    run = ["generate", "--model", str(tiny_gguf), "--weights", "fp32"]
    assert main([*run, "--max-tokens", "0", "hello"]) == 0
    out = capsys.readouterr()
    assert out.out == "\n" and counts(out.err) == (5, 0, "length (max_tokens 0 reached)")
    assert main([*run, "--max-tokens", "6", "hello"]) == 0
    assert counts(capsys.readouterr().err) == (5, 6, "length (max_tokens 6 reached)")
    assert main([*run, "--max-model-len", "4", "hi"]) == 0
    prompt, new, finish = counts(capsys.readouterr().err)
    assert (prompt, new) == (2, 2) and finish.startswith("length (max_model_len 4 reached"), finish


def test_generate_says_what_it_loaded(tiny_gguf, capsys):
    assert main(["generate", "--model", str(tiny_gguf), "--weights", "fp32", "--max-tokens", "1", "hi"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"^nanoserve: model {re.escape(str(tiny_gguf))}: loaded in [0-9.]+ s on cpu "
                     r"\(metadata [0-9.]+ s, weights [0-9.]+ s, tokenizer [0-9.]+ s\)$", err, re.M), err
    assert "nanoserve: weights fp32, " in err and "compute dtype float32" in err and "CPU kernels: " in err, err
    # One row at the model's full length (1,024 tokens = 64 blocks of 16) plus the scratch block,
    # float32 K/V at 2 layers x 2 KV heads x 16 x 2 x 4 bytes = 512 bytes a token.
    assert "nanoserve: K/V pool 520.0 KiB of float32: 65 blocks of 16 tokens (1,024 tokens for requests" in err, err
    assert "nanoserve: max_model_len 1,024; up to 1 row and " in err, err


def test_generate_runs_on_the_threads_asked_and_says_so(tiny_gguf, capsys):
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(tiny_gguf), "--threads", "1", "--max-tokens", "1", "hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert re.search(r"^nanoserve: weights .*; CPU kernels: .*; threads 1$", capsys.readouterr().err, re.M)


def test_zero_threads_is_refused_before_the_model_loads(tmp_path, capsys):
    # The model does not exist: the option is checked first.
    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--threads", "0", "x"]) == 2
    err = capsys.readouterr().err
    assert "threads must be an integer >= 1, got 0" in err and "missing.gguf" not in err


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


def test_generate_closes_with_speculations_acceptance(tiny_gguf, capsys):
    # A prompt that repeats itself gives n-gram lookup something to propose.
    speculative = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": false}'
    args = ["generate", "--model", str(tiny_gguf), "--weights", "fp32", "--max-tokens", "12",
            "--speculative-config", speculative, "hello hello hello hello hello hello"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "speculative decoding:" in err
    assert "proposed tokens accepted" in err and "verify steps" in err


@pytest.mark.parametrize("command", [["generate", "--model", "{missing}", "x"], ["serve", "{missing}", "--port", "0"],
                                     ["warmup", "{missing}"]])
def test_a_missing_model_is_refused_in_one_line_before_torch_is_imported(tmp_path, command):
    import subprocess
    import sys

    missing = tmp_path / "missing.gguf"
    script = ("import sys\nfrom nanoserve.launch import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit as exit:\n    print(exit, file=sys.stderr)\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, *[part.format(missing=missing) for part in command]],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False"], done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{missing}: model not found" in lines[0], done.stderr


def test_a_large_file_loads_with_a_progress_bar_and_the_tokenizer_is_a_stage_of_its_own(tiny_gguf, capsys,
                                                                                         monkeypatch):
    from nanoserve.model.formats import loader

    monkeypatch.setattr(loader, "PROGRESS_FROM_BYTES", 0)  # the tiny file counts as large
    assert main(["generate", "--model", str(tiny_gguf), "--weights", "fp32", "--max-tokens", "1", "hi"]) == 0
    err = capsys.readouterr().err
    assert f"loading {tiny_gguf.name}" in err and "layer" in err
    load_line = next(line for line in err.splitlines() if "loaded in" in line)
    assert "metadata" in load_line and "weights" in load_line and "tokenizer" in load_line


def test_nanoserve_chat_in_a_terminal_keeps_turns_resets_stops_a_reply_and_exits(tiny_gguf):
    import os
    import pty
    import select
    import subprocess
    import sys

    leader, follower = pty.openpty()
    argv = [sys.executable, "-m", "nanoserve.launch", "chat", str(tiny_gguf), "--weights", "fp32",
            "--chat-template", "chatml", "--max-tokens", "6", "--no-compile"]
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""

    def until(text: bytes, timeout: float = 120) -> None:
        nonlocal seen
        while text not in seen:
            ready, _, _ = select.select([leader], [], [], timeout)
            assert ready, f"no {text!r} in {seen[-2000:]!r}"
            seen += os.read(leader, 4096)

    try:
        until(b">>> ")
        for line in (b"hello there\n", b"and again\n"):
            seen = b""
            os.write(leader, line)
            until(b">>> ")  # the reply streamed, then the next prompt
        seen = b""
        os.write(leader, b"/reset\n")
        until(b"(conversation reset)")
        until(b">>> ")
        os.write(leader, b"\x03")  # Ctrl-C at the prompt: a fresh line, not the end
        until(b">>> ")
        os.write(leader, b"/exit\n")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)


def test_ctrl_c_stops_a_chat_reply_between_steps_and_keeps_what_came(tiny_gguf, capsys):
    from nanoserve.chat_cli import Conversation
    from nanoserve.engine import SamplingParams, build_engine

    engine = build_engine(str(tiny_gguf), weights="fp32", chat_template="chatml", compile=False)
    conversation = Conversation(engine, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "be brief")
    step = engine.step

    def step_then_interrupt():
        outputs = step()
        if any(o.new_text for o in outputs):
            conversation._interrupt(None, None)  # what SIGINT's handler does
        return outputs

    engine.step = step_then_interrupt
    conversation.turn("hello")
    assert "(stopped)" in capsys.readouterr().out
    assert [m["role"] for m in conversation.history] == ["system", "user", "assistant"]
    assert conversation.history[-1]["content"]
    engine.check_drained()  # the stopped request gave back its blocks and its row
