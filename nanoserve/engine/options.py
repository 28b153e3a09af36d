"""Engine options on a command line, shared by `nanoserve generate` and `nanoserve serve`.

Imports nothing heavy: the command line parses its arguments before torch is loaded."""

from __future__ import annotations

import argparse
import re

DEFAULT_MODEL = "smollm2"  # nanoserve.model.loader.DEFAULT_MODEL, named here without importing torch
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
    """The engine's options, with a command's own defaults for the rows and the K/V budget
    (`kv_cache_default` says in words what an unset budget means)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + reply, in tokens (default: the model's context length, "
                            "lowered to what the K/V pool holds)")
    group.add_argument("--max-batch-size", type=int, default=max_batch_size,
                       help="rows: requests decoded together in one step (default %(default)s)")
    group.add_argument("--kv-cache-bytes", type=parse_bytes, default=kv_cache_bytes,
                       help=f"K/V pool budget, e.g. 512M, 2G (default: {kv_cache_default})")
    group.add_argument("--block-size", type=int, default=16,
                       help="tokens per K/V block, the pool's unit of allocation (default %(default)s)")
    group.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="default: float32 on cpu, bfloat16 on cuda")
    group.add_argument("--weights", default=None, choices=["auto", "fp32", "bf16", "int8", "int4"],
                       help="weight format (default: auto, or dense in --dtype when that is given)")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the decode step (reduce-overhead, bucketed static shapes)")
    group.add_argument("--warmup", default="lazy", choices=["lazy", "eager"],
                       help="with --compile: build every bucket's graph up front (eager) or on first use")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="a step's token budget (decode rows + prefill chunks), binding every step; "
                            "default on the CPU: max batch size + max(48, half of it), 512 with no row "
                            "decoding; on a GPU: 512")
    group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                       help="prefill whole prompts in steps of their own (running streams wait)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="recompute every prompt instead of reusing cached K/V of shared prefixes")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """build_engine's keyword arguments from add_engine_args' options."""
    return dict(max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size, dtype=args.dtype,
                weights=args.weights, device=args.device, compile=args.compile, warmup=args.warmup,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching)
