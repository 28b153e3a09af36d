"""One configuration object: build_engine's keywords, the command line's flags and the README's
options table all come from EngineConfig's fields; Engine.config is that record as asked (it
builds the same engine again) and Engine.resolved what it resolved to."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from conftest import write_gguf

from nanoserve.engine import EngineConfig, SamplingParams, build_engine
from nanoserve.engine.config import cli_flag, options_table
from nanoserve.launch import build_parser
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config


def test_every_option_has_help_and_a_row_in_the_table():
    table = options_table().splitlines()
    fields = dataclasses.fields(EngineConfig)
    assert len(table) == 2 + len(fields)
    for option, row in zip(fields, table[2:]):
        assert option.metadata["help"] and row.startswith(f"| `{option.name}` |")


@pytest.mark.parametrize("command", [["serve"], ["generate", "p"]])
def test_the_command_lines_engine_flags_are_the_configs_fields(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command[0]]
    flags = {flag for action in sub._actions for flag in action.option_strings}
    offered = [o for o in dataclasses.fields(EngineConfig) if o.metadata["cli"]]
    assert {cli_flag(o) for o in offered} <= flags
    args = parser.parse_args(command)
    assert all(hasattr(args, o.name) for o in offered)


def test_build_engine_takes_the_fields_and_refuses_anything_else():
    model = random_model(tiny_config(), seed=0)
    with pytest.raises(TypeError, match="max_rows"):
        build_engine(model, max_rows=2)
    base = EngineConfig(max_batch_size=2, block_size=4)
    engine = build_engine(model, config=base, max_model_len=48, kv_cache_bytes=1 << 20)
    assert engine.config == dataclasses.replace(base, max_model_len=48, kv_cache_bytes=1 << 20)  # as asked
    resolved = engine.resolved
    # Resolved: the unset budget, the dtype, the weight format's name, the pool's bytes.
    assert resolved.max_model_len == 48 and resolved.max_num_batched_tokens == 2 + 48
    assert resolved.dtype == torch.float32 and resolved.weights == "fp32" and resolved.weight_plan is None
    assert resolved.kv_cache_bytes == engine.scheduler.blocks.pool.num_blocks * 2 * 2 * 2 * 16 * 4 * 4


@pytest.mark.parametrize("threads", [0, -2, True, 1.5, "2"])
def test_threads_below_one_or_not_an_integer_are_refused(threads):
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        EngineConfig(threads=threads)


@pytest.fixture
def restores_torch_threads():
    """The test sets torch's process-wide thread count; the next test gets it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_set_torchs_threads_for_the_steps_and_the_servers_loop_thread(restores_torch_threads):
    engine = build_engine(random_model(tiny_config(), seed=0), max_batch_size=2, kv_cache_bytes=1 << 20, threads=1)
    assert engine.config.threads == 1 and engine.threads == 1 and torch.get_num_threads() == 1
    seen = []
    loop = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # as the server's engine loop
    loop.start()
    loop.join()
    assert seen == [1]
    unset = build_engine(random_model(tiny_config(), seed=0), max_batch_size=2, kv_cache_bytes=1 << 20)
    assert unset.config.threads is None and unset.threads == 1  # None leaves the count as it is


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    config = tiny_config(vocab_size=260, tie_word_embeddings=True)
    return str(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", config,
                          unfuse_hf_weights(random_model(config, seed=0))))


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4", "auto", None])
def test_the_engines_config_builds_the_same_engine_again(weights, tiny_gguf):
    first = build_engine(tiny_gguf, weights=weights, max_batch_size=2, max_model_len=64, kv_cache_bytes=1 << 20)
    again = build_engine(tiny_gguf, config=first.config)
    assert again.config == first.config and again.resolved == first.resolved
    prompt, params = [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = [engine.generate([prompt], params, use_tqdm=False)[0].token_ids for engine in (first, again)]
    assert outputs[0] == outputs[1]


def test_the_default_models_cpu_default_config_builds_it_again(smollm2_path):
    first = build_engine(str(smollm2_path), max_batch_size=2, max_model_len=64, kv_cache_bytes=1 << 22)
    assert first.config.weights is None and first.resolved.weight_plan is not None  # asked: nothing; resolved: auto
    again = build_engine(str(smollm2_path), config=first.config)
    assert again.resolved == first.resolved


def test_the_readmes_options_table_is_the_one_the_config_makes():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("<!-- options table: python -m nanoserve.engine.config -->\n")
    end = readme.index("\n<!-- end of options table -->")
    assert readme[readme.index("\n", start) + 1:end] == options_table().strip(), (
        "README's options table is stale: paste `python -m nanoserve.engine.config` between its markers")
