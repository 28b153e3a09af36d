"""The command line answers fast and says what it does: --help and --version before torch is
imported, a busy port refused before the model loads, help text and defaults for every option,
and the startup summary's wording of the kernel tier and sizes."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import socket
import subprocess
import sys
import time

import pytest

from nanoserve.launch import build_parser, main
from nanoserve.summary import format_bytes, kernel_tier

# Runs `main(argv)` in a fresh interpreter; prints what it raised and whether torch was imported.
PROBE = """
import json, sys
from nanoserve.launch import main
try:
    main(sys.argv[1:])
    raised = None
except SystemExit as exc:
    raised = str(exc.code)
print(json.dumps({"raised": raised, "torch": "torch" in sys.modules}))
"""


def probe(*argv: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    *printed, last = result.stdout.splitlines()
    return json.loads(last), "\n".join(printed) + result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["serve", "--help"], ["generate", "--help"],
                                  ["serve", "--port", "not-a-port"]])
def test_help_version_and_bad_options_answer_without_importing_torch(argv):
    outcome, _ = probe(*argv)
    assert outcome["raised"] in ("0", "2") and not outcome["torch"], outcome


def test_help_and_version_answer_in_well_under_a_second():
    def best_of_three(*argv: str) -> tuple[float, str]:
        times = []
        for _ in range(3):  # the best of three: a busy machine may stall one start
            started = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "nanoserve.launch", *argv], capture_output=True,
                                    text=True, timeout=60)
            times.append(time.perf_counter() - started)
            assert result.returncode == 0, result.stderr
        return min(times), result.stdout

    seconds, text = best_of_three("--help")
    assert seconds < 1.0 and "generate" in text and "serve" in text, (seconds, text)
    seconds, text = best_of_three("--version")
    assert seconds < 1.0 and text.strip() == f"nanoserve {importlib.metadata.version('nanoserve')}", (seconds, text)


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not exist either: the port is checked first, and torch never loads.
        outcome, _ = probe("serve", str(tmp_path / "missing.gguf"), "--port", str(port))
    assert not outcome["torch"], outcome
    assert f"cannot listen on 127.0.0.1:{port}" in outcome["raised"], outcome
    assert "another process listens there" in outcome["raised"], outcome


def parse_error(capsys, *argv: str) -> str:
    """What `nanoserve ARGV` prints when argparse refuses it (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_misspelled_flag_is_named_in_one_line_with_the_subcommands_usage(capsys):
    err = parse_error(capsys, "generate", "--max-tokenz", "5", "hi")
    assert err.count("\n") == 1, err
    assert err.startswith("nanoserve generate: error: unrecognized option: --max-tokenz (did you mean --max-tokens?)")
    assert "usage: nanoserve generate [options] prompt" in err and "hi" not in err  # the prompt is no culprit


@pytest.mark.parametrize("argv, named", [
    (("generate", "--max-tokens", "abc", "hi"), "argument --max-tokens: invalid int value: 'abc'"),
    (("serve", "--port", "x"), "argument --port: invalid int value: 'x'"),
    (("serve", "--weights", "int3"), "argument --weights: invalid choice: 'int3'"),
    (("generate", "one", "two"), "unrecognized argument: two"),
    (("generate",), "the following arguments are required: prompt"),
])
def test_a_bad_value_is_one_line_naming_it_with_the_subcommands_usage(capsys, argv, named):
    err = parse_error(capsys, *argv)
    assert err.count("\n") == 1 and named in err, err
    assert f"usage: nanoserve {argv[0]} [options]" in err


def test_an_unknown_command_is_one_line_with_the_top_level_usage(capsys):
    err = parse_error(capsys, "bogus")
    assert err.count("\n") == 1 and "invalid choice: 'bogus'" in err and "usage: nanoserve [options] COMMAND" in err


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option and positional, a subcommand's named "COMMAND --option"."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update({f"{name} {key}": value for key, value in options(sub).items()})
        else:
            found[(action.option_strings or [action.dest])[0]] = action
    return found


def test_every_option_has_help_and_the_numeric_defaults_are_shown():
    parser = build_parser()
    everything = options(parser)
    assert not [name for name, action in everything.items() if not action.help], "options without help"
    helps = {name: action.help % {"default": action.default} if "%(default)" in action.help else action.help
             for name, action in everything.items()}
    assert "default 8000" in helps["serve --port"]
    assert "default 128" in helps["generate --max-tokens"]
    for command in ("serve", "generate"):
        assert "default" in helps[f"{command} --max-model-len"] and "default 16" in helps[f"{command} --block-size"]
        assert "default" in helps[f"{command} --kv-cache-bytes"]
    assert "/health and /metrics" in helps["serve --api-key"] and "/tokenize" in helps["serve --api-key"]
    for penalty in ("--repetition-penalty", "--presence-penalty", "--frequency-penalty"):
        assert "default" in helps[f"generate {penalty}"]


def test_an_off_switchs_help_says_it_turns_the_feature_off():
    helps = {name: action.help for name, action in options(build_parser()).items()}
    for command in ("serve", "generate"):
        for switch, feature in (("--no-prefix-caching", "prefix caching"), ("--no-chunked-prefill", "chunked prefill")):
            assert helps[f"{command} {switch}"].startswith(f"turns {feature} off"), helps[f"{command} {switch}"]


def test_the_dtype_help_names_the_cpu_default_this_host_computes_in():
    from nanoserve.engine.build import resolve_weights

    _, dtype = resolve_weights(None, None, "cpu", named_model=True)  # what `generate` resolves with no flags
    help = options(build_parser())["generate --dtype"].help
    default_part = help[help.index("(default"):]
    assert str(dtype).removeprefix("torch.") in default_part and "auto" in default_part


def test_the_kernel_tier_and_sizes_in_words():
    assert kernel_tier("avx2") == "avx2"
    assert kernel_tier(None).startswith("none")  # fp32 weights, or a GPU
    assert [format_bytes(n) for n in (1 << 30, 256 << 20, 532480)] == ["1.00 GiB", "256.0 MiB", "520.0 KiB"]


def test_an_eager_engine_imports_neither_dynamo_nor_inductor():
    # torch.compile's machinery costs about a second of start-up: only a compiled graph pays it
    # (llguidance's torch helpers compile at import, so the grammar masks are filled without them).
    code = ("import sys\n"
            "from nanoserve.engine.build import build_engine\n"
            "from nanoserve.engine.sampling_params import SamplingParams\n"
            "from nanoserve.structured.params import StructuredOutputs\n"
            "e = build_engine(compile=False)\n"
            "out = e.generate(['Yes or no?'], SamplingParams(max_tokens=4, structured=StructuredOutputs("
            "choice=['yes', 'no'])), use_tqdm=False)\n"
            "assert out[0].text in ('yes', 'no'), out\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
