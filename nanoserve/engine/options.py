"""Engine options on a command line, shared by `nanoserve generate` and `nanoserve serve`.

Imports nothing heavy: the command line parses its arguments before torch is loaded."""

from __future__ import annotations

import argparse
import re

from nanoserve.engine.config import EngineConfig, cli_flag, options
from nanoserve.model_path import resolve_model_path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1.5GiB' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 536870912, 512M, 2G)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def add_engine_args(parser: argparse.ArgumentParser, *, max_batch_size: int, kv_cache_bytes: int | None,
                    kv_cache_default: str) -> None:
    """EngineConfig's options that the command line offers, as flags, with a command's own
    defaults for the rows and the K/V budget (`kv_cache_default` says in words what an unset
    budget means)."""
    group = parser.add_argument_group("engine")
    defaults = {"max_batch_size": max_batch_size, "kv_cache_bytes": kv_cache_bytes}
    for option in options():
        if not option.metadata["cli"]:
            continue
        help = option.metadata["help"]
        if option.name == "kv_cache_bytes":
            help = f"K/V pool budget, e.g. 512M, 2G (default: {kv_cache_default})"
        if option.metadata["kind"] == "switch":  # unset, --compile or --no-compile
            group.add_argument(cli_flag(option), dest=option.name, help=help, default=None,
                               action=argparse.BooleanOptionalAction)
            continue
        if isinstance(option.default, bool):  # a switch: --compile, or --no-chunked-prefill for a True default
            group.add_argument(cli_flag(option), dest=option.name, help=help,
                               action="store_false" if option.default else "store_true")
            continue
        default = defaults.get(option.name, option.default)
        if default is not None:
            help += " (default %(default)s)"
        kind = {"str": str, "int": int, "bytes": parse_bytes, "json": str}[option.metadata["kind"]]
        group.add_argument(cli_flag(option), dest=option.name, type=kind, default=default,
                           choices=option.metadata["choices"], help=help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """build_engine's keyword arguments from add_engine_args' options."""
    return {option.name: getattr(args, option.name) for option in options() if option.metadata["cli"]}


def engine_options(args: argparse.Namespace, model: str | None = None) -> dict:
    """build_engine's keyword arguments, checked as an EngineConfig (a bad value raises ValueError
    before anything loads), then ``model`` checked to exist (FileNotFoundError, before torch
    loads), with --threads then in effect: the load packs on them too."""
    kwargs = engine_kwargs(args)
    config = EngineConfig(**kwargs)
    if model is not None:
        resolve_model_path(model)
    from nanoserve.engine.threads import apply_threads

    apply_threads(config.threads)
    return kwargs
