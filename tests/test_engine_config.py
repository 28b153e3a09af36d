"""One configuration object: build_engine's keywords, the command line's flags and the README's
options table all come from EngineConfig's fields, and Engine.config is that record resolved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nanoserve.engine import EngineConfig, build_engine
from nanoserve.engine.config import cli_flag, options_table
from nanoserve.launch import build_parser
from nanoserve.model.synthetic import random_model, tiny_config


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
    config = engine.config
    assert (config.max_batch_size, config.block_size, config.max_model_len) == (2, 4, 48)
    # Resolved: the unset budget, the dtype and the weight format's name.
    assert config.max_num_batched_tokens == 2 + 48 and config.dtype == torch.float32 and config.weights == "fp32"
    assert config.kv_cache_bytes == engine.cache.pool.num_blocks * 2 * 2 * 2 * 16 * 4 * 4


def test_the_readmes_options_table_is_the_one_the_config_makes():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("<!-- options table: python -m nanoserve.engine.config -->\n")
    end = readme.index("\n<!-- end of options table -->")
    assert readme[readme.index("\n", start) + 1:end] == options_table().strip(), (
        "README's options table is stale: paste `python -m nanoserve.engine.config` between its markers")
